"""`program_launcher.run_program` runs a program as `python` and `torchrun` would: as `__main__`
with its arguments, environment and directory, torchrun's variables per rank, every rank's output,
the failed rank's status (the others ended), ranks run again where their rendezvous port was
taken, and a hung program ended at its timeout;
`start_program` starts one as `subprocess.Popen` would, with pipes to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.unit_tests import program_launcher
from tests.unit_tests.distributed_harness import free_port
from tests.unit_tests.program_launcher import run_program, start_program

PROGRAM = """
import os, sys
import torch.distributed as dist

print(__name__, sys.argv[1:], os.getcwd() == sys.argv[1], os.environ["MARK"])
if "RANK" in os.environ:
    dist.init_process_group("gloo")
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dist.get_rank())
    print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "saw", ranks)
    dist.destroy_process_group()
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("STATUS_OF_RANK_" + os.environ.get("RANK", "0"), "0")))
"""


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "program.py"
    path.write_text(body, encoding="utf-8")
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "MARK": "m", **extra}


def test_a_plain_program_runs_as_main_with_its_arguments_and_directory(tmp_path):
    done = run_program(_write(tmp_path, PROGRAM), [str(tmp_path)], env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"__main__ ['{tmp_path}'] True m\n"
    assert done.stderr == "to stderr\n"


def test_ranks_get_torchrun_variables_and_form_a_process_group(tmp_path):
    done = run_program(
        _write(tmp_path, PROGRAM), [str(tmp_path)], nproc=2, env=_env(), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        f"__main__ ['{tmp_path}'] True m",
        "rank 0 of 2 saw [0, 1]",
        f"__main__ ['{tmp_path}'] True m",
        "rank 1 of 2 saw [0, 1]",
    ]
    assert done.stderr == "to stderr\n" * 2


def test_ranks_whose_port_was_taken_run_again_on_another(tmp_path, monkeypatch):
    """Rank 0 finds the rendezvous port taken (here by a listening socket): the program runs
    again on a new port, and the result is that run's."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], free_port()])
        monkeypatch.setattr(program_launcher, "free_port", lambda: next(ports))
        done = run_program(
            _write(tmp_path, PROGRAM), [str(tmp_path)], nproc=2, env=_env(), cwd=tmp_path
        )
    assert done.returncode == 0, done.stderr
    assert "rank 0 of 2 saw [0, 1]" in done.stdout.splitlines()
    assert done.stderr == "to stderr\n" * 2
    assert next(ports, None) is None  # both ports were used


def test_the_status_is_the_failed_ranks(tmp_path):
    env = _env(STATUS_OF_RANK_1="3")
    done = run_program(_write(tmp_path, PROGRAM), [str(tmp_path)], nproc=2, env=env, cwd=tmp_path)
    assert done.returncode == 3


def test_a_failed_rank_ends_the_others_as_torchrun_does(tmp_path):
    """Rank 1 fails at once; rank 0, which would sleep a minute, gets SIGTERM."""
    body = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(4)\ntime.sleep(60)\n"
    start = time.monotonic()
    done = run_program(_write(tmp_path, body), nproc=2, env=_env(), cwd=tmp_path)
    assert done.returncode == 4
    assert done.rank_returncodes == [-signal.SIGTERM, 4]
    assert time.monotonic() - start < 30


def test_ranks_left_to_end_on_their_own_report_each_status(tmp_path):
    """Without stopping the others, rank 0 ends after rank 1's failure with its own status."""
    body = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(4)\ntime.sleep(1)\n"
    done = run_program(_write(tmp_path, body), nproc=2, env=_env(), cwd=tmp_path, stop_others=False)
    assert (done.returncode, done.rank_returncodes) == (4, [0, 4])


def test_an_exception_prints_its_traceback_and_exits_1(tmp_path):
    done = run_program(_write(tmp_path, "raise ValueError('bad flag')\n"), cwd=tmp_path)
    assert done.returncode == 1
    assert "ValueError: bad flag" in done.stderr


def test_a_hung_program_is_killed_at_its_timeout(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_program(_write(tmp_path, "import time\ntime.sleep(60)\n"), cwd=tmp_path, timeout=2)


def test_a_started_program_talks_through_its_pipes_and_exits_with_its_status(tmp_path):
    code = (
        "import os, sys\n"
        "print(__name__, sys.argv[1:], os.getcwd(), flush=True)\n"
        "print(sys.stdin.readline().upper(), end='', flush=True)\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(int(sys.stdin.read()))\n"
    )
    with start_program(code=code, args=["a"], cwd=tmp_path, stderr_to_stdout=True) as process:
        assert process.stdout.readline() == f"__main__ ['a'] {tmp_path}\n"
        process.stdin.write("hello\n")
        process.stdin.flush()
        assert process.stdout.readline() == "HELLO\n"
        process.stdin.write("3")
        assert process.communicate(timeout=60) == ("to stderr\n", None)
        assert process.returncode == 3


def test_a_started_program_ends_at_a_signal_as_a_new_interpreter_does(tmp_path):
    script = _write(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    with start_program(script) as process:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM


def test_communicate_kills_a_program_still_running_at_its_timeout(tmp_path):
    with start_program(code="import time\ntime.sleep(60)\n") as process:
        with pytest.raises(subprocess.TimeoutExpired):
            process.communicate(timeout=1)
        assert process.returncode == -signal.SIGKILL
