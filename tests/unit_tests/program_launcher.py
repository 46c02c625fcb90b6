"""`run_program`: a Python program run as `python script.py ARGS` or `torchrun --standalone
--nproc-per-node N script.py ARGS` runs it, without the imports of a new interpreter.

A test that starts a program in a new interpreter pays for importing torch and Megatron in every
process (5-8 s on CI's two cores, plus torchrun's own launcher). Here each rank is still a
process of its own, so nothing carries over between programs, but it starts with those imports
done (`warm_processes`). The program runs as `__main__` with its arguments,
environment (torchrun's variables added), working directory and `sys.path[0]`; its file
descriptors 1 and 2 go to files that become the result's output, rank after rank.

When a rank fails the others get SIGTERM, as torchrun stops them. What it does not reproduce is
the rest of torchrun's own behaviour: its restarts and its report of a failed rank.
"""

from __future__ import annotations

import atexit
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from tests.unit_tests.distributed_harness import free_port
from tests.unit_tests.warm_processes import warm_context

_GRACE_S = 30.0
"""How long the other ranks have to end after the first failed: torchrun's agent sends them
SIGTERM at once, and SIGKILL after this long."""


def _run_as_main(
    script: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str
) -> None:
    """The body of one rank: `script` as `__main__`; exits with its status."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read at start-up, which the server's import did
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    script = os.path.abspath(script)
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(script)
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if isinstance(exit_.code, int) or exit_.code is None:
            status = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # what the interpreter runs at its exit; `os._exit` skips it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_program(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    nproc: int | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess:
    """Runs `script` as `python script ARGS` (`nproc` None) or as `torchrun --standalone
    --nproc-per-node nproc script ARGS` would.

    Args:
        script: the program's path.
        args: its arguments.
        nproc: ranks, as torchrun's `--nproc-per-node`; None: one plain process.
        env: its environment (default: this process's).
        cwd: its working directory (default: this process's).
        timeout: seconds before the still-running ranks are killed and `TimeoutExpired` raised.

    Returns:
        The status (the first failed rank's, else 0) and the ranks' output, rank 0's first.
    """
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    ranks = 1 if nproc is None else nproc
    if nproc is not None:
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            ROLE_RANK="0",
            ROLE_WORLD_SIZE=str(nproc),
        )
    context = warm_context()
    with tempfile.TemporaryDirectory() as logs:
        processes, outputs = [], []
        for rank in range(ranks):
            rank_env = dict(env)
            if nproc is not None:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            out, err = f"{logs}/{rank}.out", f"{logs}/{rank}.err"
            outputs.append((out, err))
            process = context.Process(
                target=_run_as_main, args=(str(script), list(args), rank_env, cwd, out, err)
            )
            process.start()
            processes.append(process)
        status = _wait(processes, timeout, script)
        stdout, stderr = ("".join(_read(pair[i]) for pair in outputs) for i in (0, 1))
    command = [sys.executable, str(script), *args]
    return subprocess.CompletedProcess(command, status, stdout, stderr)


def _wait(processes: list, timeout: float, script: str | Path) -> int:
    """Waits for every rank as torchrun's agent does: when one fails, the others get SIGTERM,
    and SIGKILL `_GRACE_S` later. Returns the first failed rank's status, else 0.

    Raises:
        subprocess.TimeoutExpired: no rank failed, and some still ran after `timeout` (they are
            killed).
    """
    deadline = time.monotonic() + timeout
    status = 0
    while any(process.is_alive() for process in processes):
        failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        if failed and not status:
            status = failed[0]
            for process in processes:
                if process.is_alive():
                    process.terminate()
            deadline = time.monotonic() + _GRACE_S
        if time.monotonic() > deadline:
            _kill(processes)
            if not status:
                raise subprocess.TimeoutExpired([str(script)], timeout)
        time.sleep(0.02)
    failed = [process.exitcode for process in processes if process.exitcode != 0]
    return status or (failed[0] if failed else 0)


def _kill(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()


def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace")
