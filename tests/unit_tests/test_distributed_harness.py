"""The multi-rank harness reports results, propagates failures and bounds hangs."""

import os
import signal
import socket
import weakref

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests import distributed_harness
from tests.unit_tests.distributed_harness import (
    DistributedTestError,
    current_device,
    free_port,
    run_distributed,
    select_backend,
)


def _all_reduce_rank() -> tuple[int, float]:
    value = torch.tensor([float(dist.get_rank() + 1)], device=current_device())
    dist.all_reduce(value)
    return dist.get_rank(), value.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()


def _crash_rank_one_in_native_code() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # what a crash in a C++ kernel does
    dist.barrier()


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins


@pytest.mark.parametrize("gpu_test", [False, True])
def test_only_gpu_tests_put_their_ranks_on_gpus(gpu_test, monkeypatch):
    """On a machine with two GPUs a test marked `gpu` gets NCCL for two ranks (gloo for more);
    the others, written for CPU tensors, get gloo, as the session says before each test."""
    monkeypatch.delenv("MEGATRON_TEST_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed_harness._ranks_on_gpus is False  # this test is not marked `gpu`
    monkeypatch.setattr(distributed_harness, "_ranks_on_gpus", gpu_test)
    assert select_backend(2) == ("nccl" if gpu_test else "gloo")
    assert select_backend(4) == "gloo"


def test_a_pool_whose_port_was_taken_starts_on_another(monkeypatch):
    """Rank 0 finds the rendezvous port taken (here by a listening socket): the pool starts
    again on a new port instead of failing the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], free_port()])
        monkeypatch.setattr(distributed_harness, "free_port", lambda: next(ports))
        pool = distributed_harness._WorkerPool(2, "gloo")
    try:
        assert pool.run(_all_reduce_rank, (), {}, timeout=60) == [(0, 3.0), (1, 3.0)]
        assert next(ports, None) is None  # both ports were used
    finally:
        pool.close()


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_by_rank(world_size):
    results = run_distributed(_all_reduce_rank, world_size)
    expected_sum = world_size * (world_size + 1) / 2
    assert results == [(rank, expected_sum) for rank in range(world_size)]


def test_failing_rank_traceback_is_raised():
    with pytest.raises(DistributedTestError, match="boom from rank one") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert "rank 1" in str(info.value)
    # The broken pool was discarded: the next call works on fresh processes.
    assert run_distributed(_all_reduce_rank, 2) == [(0, 3.0), (1, 3.0)]


def test_a_crashed_rank_reports_its_signal_and_stack():
    """A rank killed by a signal sends no traceback: the error names the signal and the Python
    frame the rank was in."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_crash_rank_one_in_native_code, 2, timeout=60)
    message = str(info.value)
    assert f"rank 1 died (exit code {-signal.SIGSEGV})" in message
    assert "_crash_rank_one_in_native_code" in message
    assert run_distributed(_all_reduce_rank, 2) == [(0, 3.0), (1, 3.0)]


def test_stuck_collective_fails_within_timeout():
    # A call first: the ranks import this module to unpickle its functions, which on a loaded
    # machine can take rank 1 past the hanging call's 5 s by itself.
    assert run_distributed(_all_reduce_rank, 2) == [(0, 3.0), (1, 3.0)]
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] did not finish"):
        run_distributed(_hang_on_rank_zero, 2, timeout=5)


def _wrap_fsdp_and_count_threads() -> int:
    """Wraps and steps a tiny Megatron-FSDP model, then counts this process's threads."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp import FullyShardedDataParallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    model = FullyShardedDataParallel(config, ddp_config, torch.nn.Linear(8, 8))
    model(torch.ones(2, 8)).sum().backward()
    return len(os.listdir("/proc/self/task"))


# Measured with torch 2.11 on a CUDA host: one DTensor op (`detach() * 2`) on a mesh over a gloo
# group keeps that group's threads alive after the group is destroyed and DTensor's caches are
# cleared, with nothing in Python holding it; torch 2.13 on CPU frees it. Strict: a torch that
# frees it makes this an error, and the mark goes.
_DTENSOR_KEEPS_GROUPS = torch.cuda.is_available() and torch.__version__ < "2.13"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.xfail(
    _DTENSOR_KEEPS_GROUPS,
    reason="torch < 2.13 with CUDA: DTensor ops keep their mesh's process group alive",
    strict=True,
)
def test_a_test_leaves_no_process_group_alive():
    # Every live gloo group owns polling threads; a group kept alive by a cache after its test
    # destroyed it would add some on every call.
    counts = [run_distributed(_wrap_fsdp_and_count_threads, 2)[0] for _ in range(3)]
    assert counts[2] == counts[1], f"threads per call: {counts}"


class _Cycle:
    """An object in a reference cycle with itself (only the collector frees it)."""

    def __init__(self):
        self.me = self


_kept: dict[str, object] = {}
"""Worker-process state across calls: what a test kept, and a weak reference to it."""


def _keep_a_cycle() -> None:
    cycle = _Cycle()
    _kept["cycle"], _kept["ref"] = cycle, weakref.ref(cycle)


def _drop_the_cycle_and_check() -> bool:
    """Drops the kept cycle (after a call froze it); True while it is still alive."""
    _kept.pop("cycle", None)
    return _kept["ref"]() is not None


def test_a_frozen_cycle_that_becomes_garbage_is_collected():
    # The harness freezes what survives each call; a cycle that becomes garbage later must
    # still be freed by one of the periodic full collections.
    run_distributed(_keep_a_cycle, 1)
    alive = [run_distributed(_drop_the_cycle_and_check, 1)[0] for _ in range(25)]
    assert not alive[-1], f"alive after each call: {alive}"
