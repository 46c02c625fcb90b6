"""Programs run as `python script.py ARGS`, `python -c CODE` or `torchrun --standalone
--nproc-per-node N script.py ARGS` run them, without the imports of a new interpreter.

A test that starts a program in a new interpreter pays for importing torch and Megatron in every
process (5-8 s on CI's two cores, plus torchrun's own launcher). Here each process is still a
process of its own, so nothing carries over between programs, but it starts with those imports
done (`warm_processes`). The program runs as `__main__` with its arguments, environment
(torchrun's variables added), working directory and `sys.path[0]`.

`run_program` runs a program to its end and returns its status and output, as `subprocess.run`;
when a rank fails the others get SIGTERM, as torchrun stops them, and ranks that found their
rendezvous port taken meanwhile run again on a new one. What it does not reproduce is
the rest of torchrun's own behaviour: its restarts and its report of a failed rank.
`start_program` starts one process and returns it, as `subprocess.Popen` with pipes to its
standard input and output: for tests that talk to a program or signal it.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing import reduction
from pathlib import Path
from typing import IO

from tests.unit_tests.distributed_harness import START_ATTEMPTS, free_port, port_taken
from tests.unit_tests.warm_processes import warm_context

_GRACE_S = 30.0
"""How long the other ranks have to end after the first failed: torchrun's agent sends them
SIGTERM at once, and SIGKILL after this long."""


def _command(script: str | Path | None, code: str | None, args: Sequence[str]) -> list[str]:
    """The command line the program stands for (in results and errors)."""
    if (script is None) == (code is None):
        raise ValueError("a program is a script or code: pass exactly one")
    return [sys.executable, *((str(script),) if code is None else ("-c", code)), *args]


class _PipeEnd:
    """One end of a pipe, for a process started through the forkserver: pickled into the
    process's arguments, the server passes the descriptor on, and the process receives it as
    an `int`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(duplicate) -> int:
    return duplicate.detach()


Target = str | int
"""Where a process's standard stream goes: a file's path (written anew), or a descriptor it
received (`_PipeEnd`)."""


def _redirect(fd: int, target: Target) -> None:
    if isinstance(target, str):
        target = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(target, fd)
    os.close(target)


def _run_as_main(
    script: str | None,
    code: str | None,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    streams: dict[int, Target],
    stderr_to_stdout: bool = False,
) -> None:
    """The body of one process: `script` (or `code`, as `python -c` runs it) as `__main__`,
    its standard streams (by descriptor) to `streams`; exits with its status."""
    for fd, target in streams.items():
        _redirect(fd, target)
    if stderr_to_stdout:
        os.dup2(1, 2)
    if 0 in streams:  # multiprocessing gave the process /dev/null as sys.stdin
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - for the process
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read at start-up, which the server's import did
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    status = 0
    try:
        if script is None:
            sys.argv = ["-c", *argv]
            sys.path[0] = ""
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = os.path.abspath(script)
            sys.argv = [script, *argv]
            sys.path[0] = os.path.dirname(script)
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


class ProgramResult(subprocess.CompletedProcess):
    """`run_program`'s result: `subprocess.run`'s, and each rank's exit status."""

    def __init__(
        self,
        args: list[str],
        returncode: int,
        stdout: str,
        stderr: str,
        rank_returncodes: list[int],
    ) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.rank_returncodes = rank_returncodes


def run_program(
    script: str | Path | None = None,
    args: Sequence[str] = (),
    *,
    code: str | None = None,
    nproc: int | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 300.0,
    stop_others: bool = True,
) -> ProgramResult:
    """Runs `script` as `python script ARGS` (`nproc` None) or as `torchrun --standalone
    --nproc-per-node nproc script ARGS` would; or `code` as `python -c code ARGS`.

    Args:
        script: the program's path; None with `code`.
        args: its arguments.
        code: Python source run as `python -c` runs it, instead of `script`.
        nproc: ranks, as torchrun's `--nproc-per-node`; None: one plain process.
        env: its environment (default: this process's).
        cwd: its working directory (default: this process's).
        timeout: seconds before the still-running ranks are killed and `TimeoutExpired` raised.
        stop_others: whether a rank's failure stops the others, as torchrun does; False: each
            ends on its own (a test of what every rank does at an error).

    Returns:
        The status (the first failed rank's, else 0), the ranks' output, rank 0's first, and
        each rank's status. Ranks whose rendezvous port was taken meanwhile run again on a new
        one (`START_ATTEMPTS`).
    """
    command = _command(script, code, args)
    script = None if script is None else str(script)
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    if nproc is None:
        return _launch(command, script, code, args, env, cwd, nproc, timeout, stop_others)
    env.update(
        MASTER_ADDR="127.0.0.1",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        ROLE_RANK="0",
        ROLE_WORLD_SIZE=str(nproc),
    )
    attempt = 1
    while True:
        env["MASTER_PORT"] = str(free_port())
        result = _launch(command, script, code, args, env, cwd, nproc, timeout, stop_others)
        if result.returncode == 0 or attempt == START_ATTEMPTS or not port_taken(result.stderr):
            return result
        attempt += 1


def _launch(
    command: list[str],
    script: str | None,
    code: str | None,
    args: Sequence[str],
    env: dict[str, str],
    cwd: str,
    nproc: int | None,
    timeout: float,
    stop_others: bool,
) -> ProgramResult:
    """Starts the program's processes, one per rank with torchrun's variables (`nproc`) or one
    plain process, and waits for them (`run_program`)."""
    ranks = 1 if nproc is None else nproc
    context = warm_context()
    with tempfile.TemporaryDirectory() as logs:
        processes, outputs = [], []
        for rank in range(ranks):
            rank_env = dict(env)
            if nproc is not None:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            out, err = f"{logs}/{rank}.out", f"{logs}/{rank}.err"
            # Made here: a rank stopped before it starts (another failed first) opens neither.
            Path(out).touch()
            Path(err).touch()
            outputs.append((out, err))
            process = context.Process(
                target=_run_as_main,
                args=(script, code, list(args), rank_env, cwd, {1: out, 2: err}),
            )
            process.start()
            processes.append(process)
        status = _wait(processes, timeout, command, stop_others)
        stdout, stderr = ("".join(_read(pair[i]) for pair in outputs) for i in (0, 1))
    return ProgramResult(command, status, stdout, stderr, [p.exitcode for p in processes])


def _wait(processes: list, timeout: float, command: list[str], stop_others: bool) -> int:
    """Waits for every rank as torchrun's agent does: when one fails, the others get SIGTERM,
    and SIGKILL `_GRACE_S` later (unless not `stop_others`). Returns the first failed rank's
    status, else 0.

    Raises:
        subprocess.TimeoutExpired: some rank still ran after `timeout` and none had failed, or
            none was stopped (they are killed).
    """
    deadline = time.monotonic() + timeout
    status = 0
    while any(process.is_alive() for process in processes):
        failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        if failed and not status:
            status = failed[0]
            if stop_others:
                for process in processes:
                    if process.is_alive():
                        process.terminate()
                deadline = time.monotonic() + _GRACE_S
        if time.monotonic() > deadline:
            _kill(processes)
            if not (status and stop_others):
                raise subprocess.TimeoutExpired(command, timeout)
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


class WarmProcess:
    """A process `start_program` started: what tests use of `subprocess.Popen`'s interface,
    with text pipes to its standard input and output."""

    def __init__(self, process, command: list[str], stdin: IO[str], stdout: IO[str]) -> None:
        self._process = process
        self.args = command
        self.stdin = stdin
        self.stdout = stdout

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status, -N if signal N ended it, None while it runs (as `Popen`'s)."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """Waits for it to end; returns its `returncode`.

        Raises:
            subprocess.TimeoutExpired: it still runs after `timeout` seconds.
        """
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Closes its standard input, reads its output to the end and waits for it.

        Raises:
            subprocess.TimeoutExpired: it has not ended after `timeout` seconds (it is killed).
        """
        if not self.stdin.closed:
            self.stdin.close()
        chunks: list[str] = []
        reader = threading.Thread(target=lambda: chunks.append(self.stdout.read()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            self.kill()
            self._process.join()
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        return "".join(chunks), None

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()
        self._process.join()
        for stream in (self.stdin, self.stdout):
            stream.close()


def start_program(
    script: str | Path | None = None,
    args: Sequence[str] = (),
    *,
    code: str | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stderr_to_stdout: bool = False,
) -> WarmProcess:
    """Starts `python script ARGS` (or `python -c code ARGS`) with pipes to its standard input
    and output, as `subprocess.Popen(..., stdin=PIPE, stdout=PIPE, text=True)`.

    Args:
        script: the program's path; None with `code`.
        args: its arguments.
        code: Python source run as `python -c` runs it, instead of `script`.
        env: its environment (default: this process's).
        cwd: its working directory (default: this process's).
        stderr_to_stdout: its standard error into the output pipe (`stderr=STDOUT`); else it
            shares this process's.
    """
    command = _command(script, code, args)
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    stdin_read, stdin_write = os.pipe()
    stdout_read, stdout_write = os.pipe()
    streams = {0: _PipeEnd(stdin_read), 1: _PipeEnd(stdout_write)}
    script = None if script is None else str(script)
    process = warm_context().Process(
        target=_run_as_main,
        args=(script, code, list(args), env, cwd, streams, stderr_to_stdout),
    )
    try:
        process.start()
    except BaseException:
        os.close(stdin_write)
        os.close(stdout_read)
        raise
    finally:  # the process holds its own ends now; its output ends when it does
        os.close(stdin_read)
        os.close(stdout_write)
    stdin = open(stdin_write, "w", encoding="utf-8")  # noqa: SIM115 - closed by the caller
    stdout = open(stdout_read, encoding="utf-8", errors="replace")  # noqa: SIM115
    return WarmProcess(process, command, stdin, stdout)
