"""The `--save` directory of a run (`megatron.training.save_directory`, `checkpoint_lock`).

- A run that would replace another run's checkpoints (one from scratch, one resuming from
  another directory, one finetuning) is refused on every rank before it builds anything, naming
  the directory, its latest iteration and the fixes, and leaves it byte-identical; `--load`
  equal to `--save` resumes.
- One job writes into a directory at a time: a second is refused, naming the holder (host, pid,
  start time), and nothing of the first's is removed; a stale lock (its process gone, its host
  silent, an earlier attempt of the job) is taken over with a warning, a live one (another
  container or boot of this host name, another job of the same torchrun run id) is not; a run
  holds the lock from its start and releases it at its end, after an error or SIGTERM too.
- The holder's heartbeat outlasts a lock file briefly gone or unreadable, and stops only at one
  naming another holder; a lock file naming this process, which holds none, is its own; a save
  of a run whose lock another job took over is refused.
- `--load` through a bind mount of `--save` resumes it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training import checkpoint_lock
from megatron.training.checkpoint_layout import TRACKER_FILENAME, CheckpointError
from megatron.training.checkpoint_lock import LOCK_FILENAME, STALE_AFTER_S, hold_save_lock
from megatron.training.save_directory import check_save_target
from megatron.training.training import _teardown, pretrain
from megatron.training.utils import LoaderIterator
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.program_launcher import run_program, start_program
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    ZERO3,
    directory_hashes,
    lock_held_by_another_process,
    main,
    main_error,
    read_tracker_text,
)
from tests.unit_tests.training.log_capture import capture_training_log


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A --save directory of a ZeRO-3 run stopped by --exit-interval 3: iterations 2 and 3."""
    root = str(tmp_path_factory.mktemp("saved"))
    flags = [*RUN, *ZERO3, "--exit-interval", "3", "--save", root, "--save-interval", "2"]
    run_distributed(main, 2, flags)
    assert read_tracker_text(root) == "3\n"
    return root


@pytest.mark.parametrize("load", [None, "other"])
def test_a_run_that_would_replace_another_runs_checkpoints_is_refused(load, saved, tmp_path):
    """Before: a run from scratch (or from another directory) saved over them and pointed the
    tracker at its own iterations."""
    save = str(tmp_path / "save")
    shutil.copytree(saved, save)
    flags = [*RUN, *ZERO3, "--save", save, "--save-interval", "2"]
    if load is not None:
        load = str(tmp_path / load)
        shutil.copytree(saved, load)
        flags += ["--load", load]
    before = directory_hashes(save)
    this_run = "starts from scratch (no --load)" if load is None else f"loads --load {load}"
    for kind, message in run_distributed(main_error, 2, flags):
        assert kind == CheckpointError.__name__, message
        assert f"--save {save} holds the checkpoints of another run (iterations [2, 3]; the " in (
            message
        )
        assert "the latest is iteration 3" in message and this_run in message, message
        assert f"pass --load {save}; to start another, pass a new or empty --save" in message
    assert directory_hashes(save) == before


def _args(
    save: str | None, load: str | None = None, finetune: bool = False, pretrained: str | None = None
) -> argparse.Namespace:
    return argparse.Namespace(
        save=save, load=load, finetune=finetune, pretrained_checkpoint=pretrained
    )


def _make(root: str, *names: str) -> None:
    for name in names:
        os.makedirs(os.path.join(root, name), exist_ok=True)


def test_which_save_directories_a_run_may_write_into(tmp_path):
    save, other = str(tmp_path / "save"), str(tmp_path / "other")
    check_save_target(_args(save))  # not created yet
    _make(save, "iter_0000004.tmp")  # an interrupted first save: nothing committed
    check_save_target(_args(save))
    check_save_target(_args(None, load=save))
    _make(save, "iter_0000002", "iter_0000004")
    with open(os.path.join(save, TRACKER_FILENAME), "w") as tracker:
        tracker.write("4\n")
    os.symlink(save, str(tmp_path / "link"))
    check_save_target(_args(save, load=str(tmp_path / "link")))  # resumes it
    check_save_target(_args(save, load=save + "/"))
    with pytest.raises(CheckpointError, match=r"\(iterations \[2, 4\]; the latest is iteration 4"):
        check_save_target(_args(save))
    with pytest.raises(CheckpointError, match=f"this run loads --load {other}:"):
        check_save_target(_args(save, load=other))
    with pytest.raises(CheckpointError, match=r"holds checkpoints already \(iterations \[2, 4\]"):
        check_save_target(_args(save, load=other, finetune=True))
    with pytest.raises(CheckpointError, match=f"finetunes from --pretrained-checkpoint {other} "):
        check_save_target(_args(save, load=str(tmp_path / "new"), pretrained=other))
    _make(save, *(f"iter_000001{i}" for i in range(5)))
    with pytest.raises(CheckpointError, match="7 checkpoints, iterations 2 to 14; the latest"):
        check_save_target(_args(save))


# --- The lock ---


def test_a_second_writer_is_refused_by_name_and_the_first_ones_save_kept(tmp_path):
    """Before: the second job's first save removed the first job's save in progress (every
    `iter_*.tmp`), and the two replaced each other's checkpoints."""
    root = str(tmp_path / "save")
    with lock_held_by_another_process(root) as pid:
        _make(root, "iter_0000007.tmp")  # the first job's save in progress
        with open(os.path.join(root, "iter_0000007.tmp", "__0_0.distcp"), "wb") as shard:
            shard.write(b"shard")
        before = directory_hashes(root)
        holder = f"(host {socket.gethostname()}, pid {pid}, started "
        for kind, message in run_distributed(main_error, 2, [*RUN, *ZERO3, "--save", root]):
            assert kind == CheckpointError.__name__, message
            assert f"--save {root} is in use by another job {holder}" in message, message
            assert "Pass another --save directory, or wait for that job to end" in message
        assert directory_hashes(root) == before
    assert os.listdir(root) == ["iter_0000007.tmp"]  # the first job released its lock


def _lock_path(root: str) -> str:
    return os.path.join(root, LOCK_FILENAME)


def _write_lock(root: str, holder: dict | str, age: float = 0.0) -> None:
    """A lock file naming `holder` (a dict, or any text), whose last heartbeat was `age`
    seconds ago."""
    os.makedirs(root, exist_ok=True)
    with open(_lock_path(root), "w") as file:
        file.write(holder if isinstance(holder, str) else json.dumps(holder))
    when = time.time() - age
    os.utime(_lock_path(root), (when, when))


def _read_lock(root: str) -> dict:
    with open(_lock_path(root)) as file:
        return json.load(file)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.fixture
def job_environment(monkeypatch) -> Iterator[None]:
    """This process as part of no torchrun or Slurm job; a test sets what it needs."""
    for name in (
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "SLURM_JOB_ID",
        "SLURM_RESTART_COUNT",
    ):
        monkeypatch.delenv(name, raising=False)
    yield


HOST = socket.gethostname()


def _pid_space() -> dict:
    """This process's host, boot and PID namespace, as its lock file names them."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pytest.skip("this platform tells no boot id or PID namespace")
    return {"host": HOST, "boot": boot, "pid_namespace": namespace}


TORCHRUN_RESTART = {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1"}
SLURM_REQUEUE = {
    # torchrun --rdzv-id $SLURM_JOB_ID: its restart count starts at 0 again after a requeue.
    "TORCHELASTIC_RUN_ID": "12345",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "SLURM_JOB_ID": "12345",
    "SLURM_RESTART_COUNT": "1",
}
STALE_LOCKS = {
    # id: (holder, age of its heartbeat, this job's environment, the reason logged)
    "process-gone": (
        lambda: {**_pid_space(), "pid": _dead_pid()},
        0.0,
        {},
        "its process is gone",
    ),
    "host-silent": (
        lambda: {"host": "elsewhere", "pid": 1},
        STALE_AFTER_S + 5,
        {},
        f"its last heartbeat is {STALE_AFTER_S + 5:.0f} s old",
    ),
    "earlier-attempt-of-this-job": (
        lambda: {"host": "elsewhere", "pid": 1, "jobs": {"torchrun": ["abc", 0]}},
        0.0,
        TORCHRUN_RESTART,
        "it is of an earlier attempt of this job (torchrun abc, attempt 0; this is attempt 1)",
    ),
    "slurm-requeue-of-a-torchrun-job-named-after-it": (
        lambda: {
            "host": "node7",
            "pid": 1,
            "jobs": {"torchrun": ["12345", 0], "slurm": ["12345", 0]},
        },
        40.0,
        SLURM_REQUEUE,
        "it is of an earlier attempt of this job (slurm 12345, attempt 0; this is attempt 1)",
    ),
    "pid-reused-by-this-process": (
        lambda: {**_pid_space(), "pid": os.getpid(), "token": "an earlier process's"},
        0.0,
        {},
        "this process has its pid, so it ended",
    ),
    "unreadable-and-silent": (lambda: "not json", STALE_AFTER_S + 5, {}, "heartbeat is"),
}


@pytest.mark.parametrize("case", STALE_LOCKS)
def test_a_stale_lock_is_taken_over_with_a_warning(case, tmp_path, monkeypatch, job_environment):
    holder, age, environment, reason = STALE_LOCKS[case]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    root = str(tmp_path)
    _write_lock(root, holder(), age)
    with capture_training_log() as messages, hold_save_lock(root):
        assert _read_lock(root)["pid"] == os.getpid()
    assert any(
        m.startswith(f"> taking over {_lock_path(root)} from ") and reason in m for m in messages
    ), messages
    assert os.listdir(root) == []


LIVE_LOCKS = {
    # id: (holder, age of its heartbeat, this job's environment, how the message names it)
    "another-host": (
        lambda: {"host": "elsewhere", "pid": 7, "started": "2026-11-24T10:00:00+00:00"},
        STALE_AFTER_S - 30,
        {},
        "(host elsewhere, pid 7, started 2026-11-24T10:00:00+00:00; its last heartbeat "
        f"{STALE_AFTER_S - 30:.0f} s ago)",
    ),
    "this-attempt-of-this-job": (
        lambda: {"host": "elsewhere", "pid": 7, "started": "t", "jobs": {"torchrun": ["abc", 1]}},
        0.0,
        TORCHRUN_RESTART,
        "(host elsewhere, pid 7, started t, job torchrun abc attempt 1; its last heartbeat",
    ),
    # Two jobs given one --rdzv-id: a later attempt of the other is no earlier one of this.
    "later-attempt-of-another-job-of-this-run-id": (
        lambda: {"host": "elsewhere", "pid": 7, "started": "t", "jobs": {"torchrun": ["abc", 2]}},
        0.0,
        TORCHRUN_RESTART,
        "(host elsewhere, pid 7, started t, job torchrun abc attempt 2; its last heartbeat",
    ),
    "earlier-attempt-of-this-run-id-in-another-slurm-job": (
        lambda: {
            "host": "elsewhere",
            "pid": 7,
            "started": "t",
            "jobs": {"torchrun": ["abc", 0], "slurm": ["100", 0]},
        },
        0.0,
        {**TORCHRUN_RESTART, "SLURM_JOB_ID": "200"},
        "(host elsewhere, pid 7, started t, job torchrun abc attempt 0, slurm 100 attempt 0; ",
    ),
    # Containers of this host name: its own (--net=host, hostNetwork), or another host's.
    "this-host-name-another-pid-namespace": (
        lambda: {
            **_pid_space(),
            "pid_namespace": _pid_space()["pid_namespace"] + 1,
            "pid": _dead_pid(),
        },
        0.0,
        {},
        f"(host {HOST}, pid ",
    ),
    "this-host-name-another-pid-namespace-this-pid": (
        lambda: {
            **_pid_space(),
            "pid_namespace": _pid_space()["pid_namespace"] + 1,
            "pid": os.getpid(),
        },
        0.0,
        {},
        f"(host {HOST}, pid {os.getpid()}, ",
    ),
    "this-host-name-another-boot": (
        lambda: {**_pid_space(), "boot": "another boot", "pid": _dead_pid()},
        0.0,
        {},
        f"(host {HOST}, pid ",
    ),
    "this-host-name-no-pid-namespace-recorded": (
        lambda: {"host": HOST, "pid": _dead_pid()},
        0.0,
        {},
        f"(host {HOST}, pid ",
    ),
    "being-written": (lambda: "", 0.0, {}, "(an unreadable lock file; its last heartbeat 0 s ago)"),
}


@pytest.mark.parametrize("case", LIVE_LOCKS)
def test_a_live_lock_is_not_taken_over(case, tmp_path, monkeypatch, job_environment):
    """Before: a lock of this host name was taken whatever container (PID namespace) or boot
    of it held it, its pid tested here; one of the same torchrun run id, whatever the attempt
    and the Slurm job."""
    holder, age, environment, named = LIVE_LOCKS[case]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    root = str(tmp_path)
    _write_lock(root, holder(), age)
    before = directory_hashes(root)
    with pytest.raises(CheckpointError) as error, hold_save_lock(root):
        pass
    assert f"--save {root} is in use by another job {named}" in str(error.value)
    assert f"delete {_lock_path(root)}; a lock without a heartbeat for" in str(error.value)
    assert directory_hashes(root) == before


def _assert_heartbeat_refreshes(root: str) -> None:
    """The lock file's time, set to 0, becomes recent again (a beat refreshed it)."""
    os.utime(_lock_path(root), (0, 0))
    deadline = time.monotonic() + 30
    while os.stat(_lock_path(root)).st_mtime == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time.time() - os.stat(_lock_path(root)).st_mtime < 30


def test_the_lock_is_held_once_per_process_and_its_heartbeat_refreshed(tmp_path, monkeypatch):
    """A save during a run holds the run's lock (it neither takes it again nor releases it);
    the heartbeat keeps the lock's time recent."""
    monkeypatch.setattr(checkpoint_lock, "HEARTBEAT_S", 0.05)
    root = str(tmp_path / "save")
    with hold_save_lock(root):
        holder = _read_lock(root)
        with hold_save_lock(root):
            assert _read_lock(root) == holder
        assert _read_lock(root) == holder
        _assert_heartbeat_refreshes(root)
    assert os.listdir(root) == []


def test_the_heartbeat_outlasts_a_lock_file_gone_a_moment(tmp_path, monkeypatch):
    """Put aside for a few beats (as a job checking it puts it aside), then back. Before: the
    heartbeat took the lock for taken over and stopped for good, and 300 s later another job
    took the live lock for stale."""
    monkeypatch.setattr(checkpoint_lock, "HEARTBEAT_S", 0.05)
    root = str(tmp_path)
    with capture_training_log() as messages, hold_save_lock(root):
        holder = _read_lock(root)
        os.rename(_lock_path(root), _lock_path(root) + ".aside")
        time.sleep(0.3)
        os.rename(_lock_path(root) + ".aside", _lock_path(root))
        _assert_heartbeat_refreshes(root)
        assert _read_lock(root) == holder
    assert not any("taken over" in m for m in messages), messages
    assert os.listdir(root) == []


def test_the_heartbeat_outlasts_an_unreadable_lock_file_warning_once(tmp_path, monkeypatch):
    """A file that cannot be read for a while (as NFS's EIO or ESTALE): one warning, and the
    heartbeat goes on once it can. Before: it stopped at the first beat."""
    monkeypatch.setattr(checkpoint_lock, "HEARTBEAT_S", 0.05)
    root = str(tmp_path)
    failed = f"> refreshing {_lock_path(root)} failed (it cannot be read as a lock file)"
    with capture_training_log() as messages, hold_save_lock(root):
        with open(_lock_path(root)) as file:
            text = file.read()
        _write_lock(root, "")
        deadline = time.monotonic() + 30
        while not any(m.startswith(failed) for m in messages) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(10 * checkpoint_lock.HEARTBEAT_S)  # beats that fail again
        _write_lock(root, text)
        _assert_heartbeat_refreshes(root)
    assert [m for m in messages if "refreshing" in m] == [
        f"{failed}; trying again at each beat",
        f"> refreshing {_lock_path(root)} works again",
    ]
    assert os.listdir(root) == []


def test_the_heartbeat_stops_at_a_lock_file_naming_another_holder(tmp_path, monkeypatch):
    """Taken over (this job frozen for longer than `STALE_AFTER_S`): the file stays the new
    holder's, neither refreshed nor removed by this job."""
    monkeypatch.setattr(checkpoint_lock, "HEARTBEAT_S", 0.05)
    root = str(tmp_path)
    other = {"host": "elsewhere", "pid": 7, "started": "t"}
    taken = f"> {_lock_path(root)} was taken over (host elsewhere, pid 7, started t): "
    with capture_training_log() as messages, hold_save_lock(root):
        _write_lock(root, other, age=100)
        deadline = time.monotonic() + 30
        while not any(m.startswith(taken) for m in messages) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(m.startswith(taken) for m in messages), messages
    assert _read_lock(root) == other
    assert time.time() - os.stat(_lock_path(root)).st_mtime > 90


def test_a_save_of_a_run_whose_lock_was_taken_over_is_refused(tmp_path):
    """Whether a hold nests is this process's record, but a use of a hold another job took over
    (this one frozen past `STALE_AFTER_S`) writes nothing beside that job."""
    root = str(tmp_path)
    other = {"host": "elsewhere", "pid": 7, "started": "t"}
    with hold_save_lock(root):
        _write_lock(root, other)
        with pytest.raises(CheckpointError) as error, hold_save_lock(root):
            pass
    assert str(error.value).startswith(
        f"this job's lock {_lock_path(root)} was taken over by a job that found it stale. "
        f"--save {root} is in use by another job (host elsewhere, pid 7, started t; "
    )
    assert _read_lock(root) == other


def test_a_link_that_nfs_reports_failed_although_made_takes_the_lock(tmp_path, monkeypatch):
    """NFS answers a retried link request "exists" when the first one made the link. Before:
    the file naming this process was taken for an outer hold's, so the lock was held without a
    heartbeat and never removed."""
    monkeypatch.setattr(checkpoint_lock, "HEARTBEAT_S", 0.05)
    link = os.link

    def link_reported_failed(source: str, target: str) -> None:
        link(source, target)
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target)

    monkeypatch.setattr(os, "link", link_reported_failed)
    root = str(tmp_path)
    with hold_save_lock(root):
        assert _read_lock(root)["pid"] == os.getpid()
        _assert_heartbeat_refreshes(root)
    assert os.listdir(root) == []


def test_a_lock_file_naming_this_process_is_taken_where_it_holds_none(tmp_path, monkeypatch):
    """Whether a hold nests is this process's record, not the file's word: a file naming this
    process that no hold of it opened (a link NFS reported failed, one whose removal failed)
    is taken, kept fresh and removed. Before: taken for an outer hold's, never removed."""
    monkeypatch.setattr(checkpoint_lock, "HEARTBEAT_S", 0.05)
    root = str(tmp_path)
    with hold_save_lock(root):
        with open(_lock_path(root)) as file:
            text = file.read()
    _write_lock(root, text)
    with hold_save_lock(root):
        _assert_heartbeat_refreshes(root)
    assert os.listdir(root) == []


def test_sigterm_ends_a_holder_releasing_the_lock(tmp_path):
    """SIGTERM (from torchrun to the surviving ranks when one fails, scancel, a time limit, a
    pod deleted) ends the holder through SystemExit. Before: it died with its lock left."""
    root = str(tmp_path)
    code = (
        "import time\n"
        "from megatron.training.checkpoint_lock import hold_save_lock\n"
        f"with hold_save_lock({root!r}):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n"
    )
    with start_program(code=code) as holder:
        assert holder.stdout.readline() == "held\n"
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=120) == 128 + signal.SIGTERM
    assert os.listdir(root) == []


def test_a_programs_own_sigterm_handler_is_kept(tmp_path):
    root = str(tmp_path)
    code = (
        "import signal, sys\n"
        "from megatron.training.checkpoint_lock import hold_save_lock\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('handled', flush=True))\n"
        f"with hold_save_lock({root!r}):\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.readline()\n"
        "print('released', flush=True)\n"
    )
    with start_program(code=code) as holder:
        assert holder.stdout.readline() == "held\n"
        holder.send_signal(signal.SIGTERM)
        assert holder.stdout.readline() == "handled\n"
        assert os.listdir(root) == [LOCK_FILENAME]
        holder.stdin.close()
        assert holder.stdout.read() == "released\n"
        assert holder.wait(timeout=120) == 0
    assert os.listdir(root) == []


_OWN_MOUNT_NAMESPACE = (
    "import ctypes, subprocess\n"
    "if ctypes.CDLL(None, use_errno=True).unshare(0x00020000):  # CLONE_NEWNS\n"
    "    raise OSError(ctypes.get_errno(), 'unshare --mount')\n"
    "subprocess.run(['mount', '--make-rprivate', '/'], check=True)\n"
)
"""What `unshare --mount` does before it runs a program: a mount namespace of its own, whose
mounts no other namespace sees."""


def _in_a_mount_namespace(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a Python process of its own mount namespace (its bind mounts end with
    it); skips the test where this machine allows none."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode:
        pytest.skip("no mount namespace of its own for a test here")
    return run_program(code=_OWN_MOUNT_NAMESPACE + code)


def test_a_lock_file_that_cannot_be_removed_is_left_with_a_warning(tmp_path):
    """Its removal failing (here EBUSY: a file mounted over it) ends the hold with a warning.
    Before: the OSError replaced the block's outcome, and `pretrain()` left its teardown."""
    root, copy = str(tmp_path / "save"), str(tmp_path / "copy")
    lock = os.path.join(root, LOCK_FILENAME)
    ran = _in_a_mount_namespace(
        "import shutil, subprocess\n"
        "from megatron.training.checkpoint_lock import hold_save_lock\n"
        f"with hold_save_lock({root!r}):\n"
        f"    shutil.copy({lock!r}, {copy!r})\n"
        f"    subprocess.run(['mount', '--bind', {copy!r}, {lock!r}], check=True)\n"
        "print('released', flush=True)\n"
    )
    assert (ran.returncode, ran.stdout) == (0, "released\n"), ran.stderr
    assert f"> {lock} was not removed (removing it failed: [Errno {errno.EBUSY}]" in ran.stderr


def test_a_bind_mount_of_the_save_directory_is_that_directory(tmp_path):
    """--load through a bind mount of --save resumes it. Before: refused (the real paths
    differ)."""
    save, mounted = str(tmp_path / "save"), str(tmp_path / "mounted")
    _make(save, "iter_0000002")
    os.makedirs(mounted)
    ran = _in_a_mount_namespace(
        "import argparse, subprocess\n"
        "from megatron.training.save_directory import check_save_target\n"
        f"subprocess.run(['mount', '--bind', {save!r}, {mounted!r}], check=True)\n"
        f"args = argparse.Namespace(save={save!r}, load={mounted!r}, finetune=False, "
        "pretrained_checkpoint=None)\n"
        "check_save_target(args)\n"
        "print('resumes', flush=True)\n"
    )
    assert (ran.returncode, ran.stdout) == (0, "resumes\n"), ran.stderr


FLAGS = (
    "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-2 --mock-data "
    "--vocab-size 32 --num-workers 0 --distributed-backend gloo"
).split()


def test_a_run_holds_the_lock_from_start_to_end_and_releases_it_after_an_error(
    world_of_one, tmp_path
):
    root = str(tmp_path / "save")
    holders: list[int] = []
    failing = itertools.count()

    def forward_step(data_iterator, model, fail: bool = False):
        holders.append(_read_lock(root)["pid"])
        if fail and next(failing) == 1:
            raise RuntimeError("forward failed")
        return pretrain_gpt.forward_step(data_iterator, model)

    def run(flags: list[str], step) -> None:
        pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            step,
            argv=[*FLAGS, *flags],
        )

    run(["--save", root, "--exit-interval", "1"], forward_step)
    assert holders and set(holders) == {os.getpid()}
    assert sorted(os.listdir(root)) == ["iter_0000001", TRACKER_FILENAME]
    holders.clear()
    with pytest.raises(RuntimeError, match="forward failed"):
        run(["--save", root, "--load", root], lambda *a: forward_step(*a, fail=True))
    assert holders == [os.getpid()] * 2
    assert sorted(os.listdir(root)) == ["iter_0000001", TRACKER_FILENAME]


@pytest.mark.parametrize("exit_signal_handler", [False, True])
def test_sigterm_ends_a_run_releasing_its_lock(exit_signal_handler, tmp_path):
    """pretrain_gpt.py in a world of one, sent SIGTERM during training: it ends through
    SystemExit, releasing its lock; with --exit-signal-handler, whose handler then owns SIGTERM,
    it saves, stops and releases it as it always did. Before: killed, its lock left."""
    root = str(tmp_path / "save")
    flags = [*FLAGS, "--train-iters", "100000", "--log-interval", "1", "--save", root]
    if exit_signal_handler:
        flags.append("--exit-signal-handler")
    repository = os.path.dirname(os.path.abspath(pretrain_gpt.__file__))
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    output = []
    with start_program(
        "pretrain_gpt.py",
        flags,
        cwd=repository,
        env={**environment, "OMP_NUM_THREADS": "1"},
        stderr_to_stdout=True,
    ) as run:
        for line in run.stdout:  # until the first iteration's log line
            output.append(line)
            if " iteration " in line:
                break
        run.send_signal(signal.SIGTERM)
        output.append(run.communicate(timeout=300)[0])
    if exit_signal_handler:
        assert run.returncode == 0, "".join(output)
        assert TRACKER_FILENAME in os.listdir(root)
    else:
        assert run.returncode == 128 + signal.SIGTERM, "".join(output)
    assert LOCK_FILENAME not in os.listdir(root), "".join(output)


def test_a_failing_teardown_step_skips_none_of_the_others(world_of_one, tmp_path):
    """Releasing --save failing still stops the loaders and destroys the process group (a later
    `pretrain()` in this process needs it gone). Before: it skipped both."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    loader = LoaderIterator(torch.utils.data.DataLoader(range(4)))
    save_directory = contextlib.ExitStack()
    save_directory.callback(_raise, OSError("release failed"))
    with pytest.raises(OSError, match="release failed"):
        _teardown((None, loader), True, save_directory)
    assert not dist.is_initialized()
    assert list(loader) == []


def _raise(error: Exception) -> None:
    raise error
