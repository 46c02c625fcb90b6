"""The lock that lets one job at a time write into a `--save` directory.

A save removes what interrupted saves left in its directory (`remove_leftovers`); a second job
saving there would have its save in progress removed, and the two would replace each other's
checkpoints and tracker. So a training run holds `DIR/save.lock` from its start to its end
(`pretrain()`), and every save and conversion into `DIR` holds it too (for itself alone, when no
run of its process holds it). A second job is refused, naming the holder.

The lock file is created atomically (a hard link to a complete file, which fails if one exists)
and holds the holder's identity: host, pid, start time, job (torchrun's run id or Slurm's job
id, with the attempt), and a token of its own. The holder refreshes the file's modification
time every `HEARTBEAT_S` seconds from a background thread, and removes the file when it ends,
on an error too. A holder killed outright leaves the file; a lock is stale, and the next job
takes it over with a warning, when

- the holder was a process on this host that no longer exists (or whose pid this process has);
- the holder was an earlier attempt of this job: torchrun (and Slurm's requeue) stops every
  process of an attempt before it starts the next, on any host;
- its heartbeat is older than `STALE_AFTER_S` (ten missed beats): a holder on another host that
  died, or one frozen. This compares the file's time with this host's clock: the hosts' clocks
  must agree to within a minute or so, as NTP keeps them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from megatron.training.checkpoint_layout import CheckpointError
from megatron.training.utils import logger

LOCK_FILENAME = "save.lock"
HEARTBEAT_S = 30.0
"""How often the holder refreshes the lock file's modification time."""
STALE_AFTER_S = 10 * HEARTBEAT_S
"""A lock whose heartbeat is older than this is stale, whichever host holds it."""

_PROCESS_TOKEN = uuid.uuid4().hex
"""Tells this process from an earlier one of the same host and pid (a restarted container)."""

_TAKE_ATTEMPTS = 5


@contextlib.contextmanager
def hold_save_lock(root: str) -> Iterator[None]:
    """Holds the lock of the directory `root` (created if needed) for the block: takes it, or
    does nothing where this process holds it already (a save during a run).

    Raises:
        CheckpointError: another live job holds it (the message names it and the fixes).
    """
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK_FILENAME)
    if not _take(path):
        yield
        return
    heartbeat = _Heartbeat(path)
    heartbeat.start()
    try:
        yield
    finally:
        heartbeat.stop()
        _release(path)


def _identity() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "job": _job_attempt(),
        "token": _PROCESS_TOKEN,
    }


def _job_attempt() -> list[str] | None:
    """[job id, attempt] of this process's job: torchrun's run id and restart count (unless the
    run id is its default, "none", which unrelated jobs share), else Slurm's job id and
    requeue count; None outside both."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return [f"torchrun {run_id}", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")]
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id:
        return [f"slurm {job_id}", os.environ.get("SLURM_RESTART_COUNT", "0")]
    return None


def _is_mine(holder: dict[str, Any]) -> bool:
    return holder.get("token") == _PROCESS_TOKEN and holder.get("pid") == os.getpid()


def _read(path: str) -> tuple[dict[str, Any], float]:
    """The holder named in the lock file (empty if the file is not what a lock writes), and the
    age of its heartbeat in seconds.

    Raises:
        FileNotFoundError: there is no lock file.
    """
    age = time.time() - os.stat(path).st_mtime
    try:
        with open(path) as file:
            holder = json.load(file)
    except (OSError, ValueError):  # gone meanwhile, or not a lock's JSON: judged by its age
        holder = {}
    return (holder if isinstance(holder, dict) else {}), age


def _create(path: str) -> bool:
    """Creates the lock file naming this process, unless one exists (then False)."""
    text = json.dumps(_identity())
    temporary = f"{path}.{_PROCESS_TOKEN}.tmp"
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    try:
        os.link(temporary, path)  # atomic, and never over an existing file, NFS included
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links: a reader may see it empty a moment
        return _create_exclusively(path, text)
    finally:
        os.unlink(temporary)


def _create_exclusively(path: str, text: str) -> bool:
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    return True


def _take(path: str) -> bool:
    """Takes the lock `path`, over a stale holder's; False where this process holds it.

    Raises:
        CheckpointError: a live holder has it.
    """
    for _ in range(_TAKE_ATTEMPTS):
        if _create(path):
            return True
        try:
            holder, age = _read(path)
        except FileNotFoundError:
            continue  # released meanwhile
        if _is_mine(holder):
            return False
        reason = _stale_reason(holder, age)
        if reason is None:
            raise CheckpointError(_in_use_message(path, holder, age))
        logger.warning(f"> taking over {path} from {_describe(holder)}: {reason}")
        _remove_stale(path, holder)
    raise CheckpointError(
        f"{path} was created again each time this job removed it; another job is starting "
        "in this directory. Pass another --save directory."
    )


def _stale_reason(holder: dict[str, Any], age: float) -> str | None:
    """Why the lock of `holder`, whose heartbeat is `age` seconds old, is stale; None if its
    holder may be alive."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        if holder["pid"] == os.getpid():
            return "this process has its pid, so it ended"
        if not _process_exists(holder["pid"]):
            return "its process is gone"
    job, mine = holder.get("job"), _job_attempt()
    if job and mine and job[0] == mine[0] and job[1] != mine[1]:
        return f"it is of an earlier attempt of this job ({job[0]}, attempt {job[1]})"
    if age > STALE_AFTER_S:
        return f"its last heartbeat is {age:.0f} s old"
    return None


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale(path: str, holder: dict[str, Any]) -> None:
    """Removes the lock file if it still names `holder`. Renamed aside first, so that of two
    jobs taking over at once, the second cannot remove the first's new lock: it puts it back."""
    aside = f"{path}.{_PROCESS_TOKEN}.stale"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        if _read(aside)[0] != holder:
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
    finally:
        os.unlink(aside)


def _release(path: str) -> None:
    holder = _read(path)[0] if os.path.exists(path) else None
    if holder is not None and _is_mine(holder):
        os.unlink(path)
    else:
        now = "it is gone" if holder is None else f"it names {_describe(holder)}"
        logger.warning(f"> {path} no longer names this process ({now}); left as it is")


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unreadable lock file"
    job = f", job {holder['job'][0]} attempt {holder['job'][1]}" if holder.get("job") else ""
    return (
        f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}{job}"
    )


def _in_use_message(path: str, holder: dict[str, Any], age: float) -> str:
    root = os.path.dirname(path)
    return (
        f"--save {root} is in use by another job ({_describe(holder)}; its last heartbeat "
        f"{age:.0f} s ago): two jobs saving into one directory remove each other's saves in "
        f"progress and replace each other's checkpoints. Pass another --save directory, or "
        f"wait for that job to end. If it has ended (or {root} is a copy of its directory), "
        f"delete {path}; a lock without a heartbeat for {STALE_AFTER_S:.0f} s is taken over."
    )


class _Heartbeat:
    """Refreshes the lock file's modification time every `HEARTBEAT_S` seconds while this
    process holds it (a daemon thread: it never keeps the process alive)."""

    def __init__(self, path: str):
        self._path = path
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="save-lock-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                holder = _read(self._path)[0] if os.path.exists(self._path) else {}
                if not _is_mine(holder):
                    logger.warning(
                        f"> {self._path} was taken over ({_describe(holder)}): this job's "
                        "next save will fail"
                    )
                    return
                os.utime(self._path)
            except OSError as error:  # a filesystem hiccup: the next beat tries again
                logger.warning(f"> refreshing {self._path} failed: {error}")
