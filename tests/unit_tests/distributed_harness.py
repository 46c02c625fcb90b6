"""Runs a test function on N ranks from plain pytest, with no torchrun.

`run_distributed(fn, world_size, *args)` calls `fn(*args)` on every rank of a pool of worker
processes that share one default process group (gloo on CPU; NCCL for a test marked `gpu` where
CUDA has a GPU per rank), and returns the list of per-rank return values. Pools are kept between
tests, because starting processes and importing torch dominates the cost of a small multi-rank
test on CPU; the workers start with torch and Megatron imported (`warm_processes`).

Failure handling is the point of this module:
- a rank that raises has its traceback re-raised in the test (rank number included);
- a rank that dies (a crash in native code, a kill) is named with its exit code, and with the
  Python stacks of its threads where a fatal signal (a crash) killed it;
- a rank stuck in a collective (because a peer failed, or a real deadlock) makes the call fail
  after `timeout` seconds, naming the ranks that did not finish;
- after any failure the pool is killed, so the next test starts from fresh processes;
- a rank whose process group cannot start reports why, and a pool whose rendezvous port another
  process took meanwhile starts again on a new one.

`fn` must be picklable: a module-level function of a test module.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import gc
import importlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from tests.unit_tests.warm_processes import warm_context

DEFAULT_TIMEOUT_S = 180.0
"""Bound on one `run_distributed` call, start-up of a fresh pool excluded."""

_GRACE_AFTER_FAILURE_S = 5.0
"""How long the other ranks may take to finish after one rank failed."""

_COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class DistributedTestError(AssertionError):
    """A rank raised, died or hung; the message holds the rank's traceback."""


_ranks_on_gpus = False
"""Whether the running test is a GPU test (`set_ranks_on_gpus`)."""


def set_ranks_on_gpus(allowed: bool) -> None:
    """Says whether the test about to run may put its ranks on GPUs: the test session sets it
    before each test, True for those marked `gpu`. The others are written for CPU tensors and
    run on gloo on any machine, a machine with GPUs too."""
    global _ranks_on_gpus
    _ranks_on_gpus = allowed


def select_backend(world_size: int) -> str:
    """NCCL for a GPU test where CUDA has one GPU per rank, gloo otherwise;
    `MEGATRON_TEST_BACKEND` overrides."""
    forced = os.environ.get("MEGATRON_TEST_BACKEND")
    if forced:
        return forced
    if _ranks_on_gpus and torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_main(
    rank: int, world_size: int, backend: str, port: int, conn: Connection, crash_log: str
) -> None:
    # A rank killed by a fatal signal (a crash in native code) sends nothing back: the Python
    # stacks of its threads at that moment go to a file the test process reads when the rank
    # dies. Not to stderr, which a forked worker shares with whatever held it when the server
    # started.
    crash_file = open(crash_log, "w")  # noqa: SIM115 - open for the process's life
    faulthandler.enable(crash_file, all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    # Several ranks share two CPU cores in CI; intra-op threads would only oversubscribe them.
    torch.set_num_threads(1)
    init_kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        init_kwargs["device_id"] = torch.device("cuda", rank)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=_COLLECTIVE_TIMEOUT,
            **init_kwargs,
        )
    except BaseException:  # noqa: BLE001 - the pool reports it, or starts again elsewhere
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            # The test process is gone: its peers may be too, so nothing collective is left to
            # tear down, and a worker left waiting would live on, orphaned.
            os._exit(1)
        if message is None:
            break
        fn, args, kwargs = message
        try:
            result = _to_cpu(fn(*args, **kwargs))
            if dist.is_initialized():
                # Every rank past the test before any tears its groups down: gloo's connect of
                # a new group can return on one rank while another is still connecting, and a
                # teardown then closes the link under it ("Connection closed by peer").
                dist.barrier()
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            conn.send(("error", traceback.format_exc()))
        finally:
            _reset_rank_state()
    dist.destroy_process_group()


def _to_cpu(result: Any) -> Any:
    """CUDA tensors cannot be pickled back to the test process; CPU copies can."""
    return tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, result)


def current_device() -> torch.device:
    """The device a test's rank should put its model and data on (its GPU under NCCL)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reset_rank_state() -> None:
    """Leaves no model-parallel groups behind for the next test on this worker."""
    import sys

    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    _release_dtensor_caches()
    global _calls_since_full_collection
    _calls_since_full_collection += 1
    if _calls_since_full_collection == _FULL_COLLECTION_EVERY:
        # Something a test kept (a cache entry) may have become garbage in a cycle since it was
        # frozen: now and then every object is scanned again.
        gc.unfreeze()
        _calls_since_full_collection = 0
    gc.collect()  # the meshes and groups the caches held sit in reference cycles
    # What survives is the worker's own (modules, torch's registries): kept out of the next
    # collection, which then scans only what the next test allocates (a full scan of a worker
    # that imported Megatron takes ~0.1 s, at every call of every rank).
    gc.freeze()


_FULL_COLLECTION_EVERY = 20
"""Calls between two collections that scan the frozen objects too."""
_calls_since_full_collection = 0


_DTENSOR_CACHE_CLEARERS = (
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)
"""Where DTensor's caches of sharding and redistribution plans are emptied: (module, callable)."""


def _release_dtensor_caches() -> None:
    """Empties DTensor's caches of sharding and redistribution plans.

    Their entries hold the device meshes of the DTensors a test computed with, and through them
    the process groups the test destroyed: a gloo group's threads keep polling while it lives,
    so over a few hundred tests the kept groups would cost the workers a CPU core. The caches
    are private to torch and differ between versions; each is cleared where it exists.
    """
    for module_name, path in _DTENSOR_CACHE_CLEARERS:
        try:
            clear = functools.reduce(getattr, path.split("."), importlib.import_module(module_name))
        except (ImportError, AttributeError):
            continue
        clear()


START_ATTEMPTS = 3
"""How many times ranks start, each time on a new port, while their rendezvous port turns out to
be taken: `free_port` finds a port free when it asks, and another process (the ranks of another
test process, a rank's own connections) may bind it before rank 0 does."""


def port_taken(error: str) -> bool:
    """Whether `error` (a rank's traceback) says its rendezvous port was taken."""
    return "EADDRINUSE" in error or "address already in use" in error.lower()


class _WorkerPool:
    """`world_size` worker processes in one default process group."""

    def __init__(self, world_size: int, backend: str, start_timeout: float = 120.0):
        self.world_size = world_size
        self.backend = backend
        for attempt in range(1, START_ATTEMPTS + 1):
            self._spawn(free_port())
            try:
                self._collect(start_timeout, what="process-group start-up")
                return
            except DistributedTestError as error:
                if attempt == START_ATTEMPTS or not port_taken(str(error)):
                    raise

    def _spawn(self, port: int) -> None:
        ctx = warm_context()
        self.conns = []
        self.procs = []
        self.crash_dir = tempfile.mkdtemp(prefix="test-ranks-")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self.backend, port, child_conn, self._crash_log(rank)),
                daemon=True,
                name=f"test-rank-{rank}",
            )
            proc.start()
            child_conn.close()
            self.conns.append(parent_conn)
            self.procs.append(proc)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout, what=getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = dict(zip(self.conns, range(self.world_size)))
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in multiprocessing.connection.wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    failures[rank] = self._death(rank)
                    continue
                if status == "error":
                    failures[rank] = payload
                else:
                    results[rank] = payload
            if failures:
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        if not failures and not pending:
            return results
        self.kill()
        lines = [f"{what} failed on {self.world_size} ranks ({self.backend})."]
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} ---\n{failures[rank]}")
        if pending:
            stuck = sorted(pending.values())
            reason = "after another rank failed" if failures else f"within {timeout:.0f} s"
            lines.append(f"ranks {stuck} did not finish {reason} (hung collective?)")
        raise DistributedTestError("\n".join(lines))

    def _crash_log(self, rank: int) -> str:
        return os.path.join(self.crash_dir, f"rank-{rank}.log")

    def _death(self, rank: int) -> str:
        """What is known of how rank `rank`, whose pipe closed, died: its exit code (negative:
        the signal that killed it; -9 is also the kernel's out-of-memory killer) and, where a
        fatal signal (a crash in native code) killed it, its threads' stacks."""
        proc = self.procs[rank]
        proc.join(timeout=_GRACE_AFTER_FAILURE_S)  # the pipe closes before the exit is reaped
        if proc.exitcode is None:
            return f"rank {rank} closed its pipe and still ran {_GRACE_AFTER_FAILURE_S:.0f} s later"
        stacks = ""
        with contextlib.suppress(OSError), open(self._crash_log(rank)) as log:
            stacks = log.read().strip()
        report = f"rank {rank} died (exit code {proc.exitcode})"
        return f"{report}; its threads' stacks then:\n{stacks}" if stacks else report

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.crash_dir, ignore_errors=True)
        self.procs = []
        self.conns = []


_pools: dict[tuple[int, str], _WorkerPool] = {}


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    reuse_pool: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Calls `fn(*args, **kwargs)` on `world_size` ranks and returns their results by rank.

    Args:
        fn: a module-level (picklable) function; it may use `torch.distributed` freely.
        world_size: number of ranks.
        timeout: seconds the call may take before the still-running ranks count as hung.
        reuse_pool: False for a call that may leave collectives unmatched (a test of ranks
            that disagree): its ranks are stopped afterwards instead of serving the next call.

    Raises:
        DistributedTestError: a rank raised, died or did not finish in time.
    """
    backend = select_backend(world_size)
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()  # a rank died between calls: its peers and files go too
        pool = _pools[key] = _WorkerPool(world_size, backend)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except DistributedTestError:
        _pools.pop(key, None)
        raise
    finally:
        if not reuse_pool and _pools.get(key) is pool:
            _pools.pop(key).kill()


def error_of(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """Runs on a rank (`run_distributed(error_of, n, fn, ...)`): the error `fn(*args, **kwargs)`
    raises, as `"TypeName: message"`, for a test that expects every rank to refuse something.

    The refusal comes back as a result, not as a `DistributedTestError`, so the ranks serve the
    next test instead of being replaced (a new pool costs every rank the import of torch and
    Megatron). A rank that does not raise fails the call; one left waiting for a rank that
    raised fails it at the timeout.
    """
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test's expected refusal
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"{getattr(fn, '__qualname__', fn)} raised nothing on this rank")


@atexit.register
def shutdown_pools() -> None:
    """Stops every kept worker pool (also called at interpreter exit)."""
    for pool in _pools.values():
        pool.close()
    _pools.clear()
