"""The lock that lets one job at a time write into a `--save` directory.

A save removes what interrupted saves left in its directory (`remove_leftovers`); a second job
saving there would have its save in progress removed, and the two would replace each other's
checkpoints and tracker. So a training run holds `DIR/save.lock` from its start to its end
(`pretrain()`), and every save and conversion into `DIR` holds it too: it takes the lock, or,
where its process holds it already (a save during a run), counts one more use of that hold,
which the outermost use releases. A second job is refused, naming the holder.

The lock file is created atomically (a hard link to a complete file, which fails if one
exists; NFS can answer a retried link "exists" although the link was made, which the link
count of the linked file tells) and holds the holder's identity: host, boot id, PID namespace,
pid, start time, its jobs (torchrun's run id with its restart count, Slurm's job id with its
requeue count) and a token of its own. While the process holds it:

- a background thread refreshes the file's modification time (its heartbeat) every
  `HEARTBEAT_S` seconds. A file gone (deleted by hand, or put aside a moment by a job checking
  whether it is stale) is created again naming this process; one that cannot be read or
  refreshed (NFS's ESTALE or EIO) is tried again at the next beat. Only a file that names
  another holder stops the heartbeat: the lock was taken over, and this job's next save fails.
- SIGTERM, where the program left it its default action (killing the process), raises
  `SystemExit` in the main thread instead (exit status 143), so the hold ends as on an error. A
  handler the program set before keeps the signal; one it sets meanwhile takes it until it puts
  ours back (`--exit-signal-handler`'s, for the training loop: the run saves and ends normally).

The hold removes the file when it ends: normally, on an error, and on SIGTERM as above. A
holder killed by SIGKILL or losing its node leaves it, and so does one ended by SIGTERM while
its main thread is blocked in C code (a collective waiting for a dead rank) until SIGKILL
follows. The next job takes a lock over, with a warning, when

- its holder was a process of this host, boot and PID namespace (all three recorded, and the
  same as this process's) that no longer exists, or whose pid this process has;
- its holder was an earlier attempt of this job: it names this job's torchrun run id (other
  than torchrun's default, "none") or Slurm job id with a lower restart count, and no other
  Slurm job. torchrun and Slurm's requeue stop every process of an attempt, on every host,
  before they start the next. torchrun's run id must be unique to the job (as torchrun
  requires); Slurm's always is;
- its heartbeat is older than `STALE_AFTER_S` (ten missed beats). This compares the file's time
  with this host's clock: the hosts' clocks must agree to within a minute or so, as NTP keeps
  them.

Every other lock is live until its heartbeat is that old: its holder's process exists; or its
pid cannot be tested here (another host, another container (PID namespace) or boot of this
host, a platform without a boot id or PID namespace, here or there); or its file cannot be read
(one being written).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import threading
import time
import types
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

_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
_PID_NAMESPACE_FILE = "/proc/self/ns/pid"


@contextlib.contextmanager
def hold_save_lock(root: str) -> Iterator[None]:
    """Holds the lock of the directory `root` (created if needed) for the block: takes it, or
    counts one more use of this process's hold of it (a save during a run). The outermost use
    releases it; while it is held, a heartbeat keeps it fresh and SIGTERM ends the process
    through `SystemExit` (the module's docstring says when).

    Raises:
        CheckpointError: another live job holds it, or took this process's hold of it over
            (the message names it and the fixes).
    """
    os.makedirs(root, exist_ok=True)
    key = os.path.realpath(root)
    with _holds_lock:
        hold = _holds.get(key)
        if hold is None:
            hold = _holds[key] = _Hold(os.path.join(root, LOCK_FILENAME))
            _end_on_sigterm()
        else:
            hold.check_kept()
        hold.uses += 1
    try:
        yield
    finally:
        with _holds_lock:
            hold.uses -= 1
            if hold.uses == 0:
                del _holds[key]
                hold.release()
                if not _holds:
                    _default_on_sigterm()


class _Hold:
    """This process's hold of the lock file `path`: taken on creation, kept fresh by a
    heartbeat until `release()`."""

    def __init__(self, path: str):
        self.path = path
        self.uses = 0
        text = json.dumps(_identity())
        _take(path, text)
        self._heartbeat = _Heartbeat(path, text)
        self._heartbeat.start()

    def check_kept(self) -> None:
        """Checks that the lock file names no other holder (the lock was taken over from this
        process, frozen past `STALE_AFTER_S`); one gone or unreadable a moment is still this
        process's (its heartbeat creates it again).

        Raises:
            CheckpointError: it names another holder.
        """
        try:
            holder, age = _read(self.path)
        except OSError:
            return
        if holder is not None and not _is_mine(holder):
            raise CheckpointError(
                f"this job's lock {self.path} was taken over by a job that found it stale. "
                + _in_use_message(self.path, holder, age)
            )

    def release(self) -> None:
        self._heartbeat.stop()
        _release(self.path)


_holds: dict[str, _Hold] = {}
"""The locks this process holds, by their directory's real path. Whether a hold nests is
decided here, never from the file: one that names this process is no proof that a hold of it
is open (see `_take`)."""
_holds_lock = threading.Lock()


def _end_on_sigterm() -> None:
    """Makes SIGTERM raise `SystemExit` while this process holds a lock, where it still has its
    default action (a handler of the program's own stays) and this is the main thread (the only
    one that may set handlers)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _raise_system_exit)


def _default_on_sigterm() -> None:
    """Gives SIGTERM its default action back, unless a handler was set over ours since."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is _raise_system_exit
    ):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _raise_system_exit(signum: int, frame: types.FrameType | None) -> None:
    if not _holds:  # set again after the last hold by a handler restoring its predecessor
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise SystemExit(128 + signum)  # the shell's exit status of a process a signal ended


def _identity() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "pid_namespace": _pid_namespace(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "jobs": _jobs(),
        "token": _PROCESS_TOKEN,
    }


def _boot_id() -> str | None:
    """This boot of the host's kernel (a host name can be shared: fixed container host names);
    None where the platform does not tell it."""
    try:
        with open(_BOOT_ID_FILE) as file:
            return file.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> int | None:
    """The PID namespace whose pids `os.getpid()` and `os.kill()` use (containers sharing the
    host's network, hence its host name, have their own); None where the platform has none."""
    try:
        return os.stat(_PID_NAMESPACE_FILE).st_ino
    except OSError:
        return None


def _jobs() -> dict[str, tuple[str, int]]:
    """This process's jobs: {"torchrun": (run id, restart count), "slurm": (job id, requeue
    count)}, each where its launcher set it. torchrun's default run id, "none", which unrelated
    jobs share, is no job."""
    jobs = {}
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        jobs["torchrun"] = (run_id, _count("TORCHELASTIC_RESTART_COUNT"))
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id:
        jobs["slurm"] = (job_id, _count("SLURM_RESTART_COUNT"))
    return jobs


def _count(variable: str) -> int:
    value = os.environ.get(variable, "0")
    return int(value) if value.isdigit() else 0


def _recorded_jobs(holder: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """The jobs the lock file of `holder` names (as `_jobs()`), those well formed."""
    jobs = holder.get("jobs")
    if not isinstance(jobs, dict):
        return {}
    return {
        kind: (job[0], job[1])
        for kind, job in jobs.items()
        if isinstance(job, list)
        and len(job) == 2
        and isinstance(job[0], str)
        and isinstance(job[1], int)
    }


def _is_mine(holder: dict[str, Any] | None) -> bool:
    return (
        holder is not None
        and holder.get("token") == _PROCESS_TOKEN
        and holder.get("pid") == os.getpid()
    )


def _read(path: str) -> tuple[dict[str, Any] | None, float]:
    """The holder named in the lock file (None if it cannot be read or is not what a lock
    writes), and the age of its heartbeat in seconds.

    Raises:
        FileNotFoundError: there is no lock file.
        OSError: its time cannot be read.
    """
    age = time.time() - os.stat(path).st_mtime
    try:
        with open(path) as file:
            holder = json.load(file)
    except (OSError, ValueError):  # gone meanwhile, or not a lock's JSON: judged by its age
        return None, age
    return (holder if isinstance(holder, dict) else None), age


def _create(path: str, text: str) -> bool:
    """Creates the lock file holding `text`, unless one exists (then False)."""
    temporary = f"{path}.{_PROCESS_TOKEN}.tmp"
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    try:
        os.link(temporary, path)  # atomic, and never over an existing file, NFS included
        return True
    except FileExistsError:
        # NFS retries a link whose reply was lost, and the retry finds the file the first
        # made: then the temporary file has two links.
        return os.stat(temporary).st_nlink == 2
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


def _take(path: str, text: str) -> None:
    """Takes the lock `path`, writing `text` (this process's identity) into it, over a stale
    holder's. A lock file naming this process, which holds none of `path` (`_holds`), is its
    own: a link NFS reported failed although it was made, or one whose removal failed.

    Raises:
        CheckpointError: a live holder has it.
    """
    for _ in range(_TAKE_ATTEMPTS):
        if _create(path, text):
            return
        try:
            holder, age = _read(path)
        except FileNotFoundError:
            continue  # released meanwhile
        if _is_mine(holder):
            return
        reason = _stale_reason(holder or {}, age)
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
    pid = holder.get("pid")
    if _in_this_pid_space(holder) and isinstance(pid, int):
        if pid == os.getpid():
            return "this process has its pid, so it ended"
        if not _process_exists(pid):
            return "its process is gone"
    earlier = _earlier_attempt(_recorded_jobs(holder), _jobs())
    if earlier is not None:
        return earlier
    if age > STALE_AFTER_S:
        return f"its last heartbeat is {age:.0f} s old"
    return None


def _in_this_pid_space(holder: dict[str, Any]) -> bool:
    """Whether the holder's pid means the process it would here: the same host, boot and PID
    namespace, all known."""
    boot, namespace = _boot_id(), _pid_namespace()
    return (
        boot is not None
        and namespace is not None
        and holder.get("host") == socket.gethostname()
        and holder.get("boot") == boot
        and holder.get("pid_namespace") == namespace
    )


def _earlier_attempt(
    theirs: dict[str, tuple[str, int]], mine: dict[str, tuple[str, int]]
) -> str | None:
    """Why the holder of the jobs `theirs` was an earlier attempt of this process's jobs
    `mine`; None if it was not."""
    if "slurm" in theirs and "slurm" in mine and theirs["slurm"][0] != mine["slurm"][0]:
        return None  # another Slurm job, whatever torchrun run id the two were given
    for kind, (job_id, attempt) in mine.items():
        if kind in theirs and theirs[kind][0] == job_id and theirs[kind][1] < attempt:
            return (
                f"it is of an earlier attempt of this job ({kind} {job_id}, attempt "
                f"{theirs[kind][1]}; this is attempt {attempt})"
            )
    return None


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale(path: str, holder: dict[str, Any] | None) -> None:
    """Removes the lock file if it still names `holder`. Renamed aside first, so that of two
    jobs taking over at once, the second cannot remove the first's new lock: it puts it back
    (the first's heartbeat creates it again if it misses it meanwhile)."""
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
    """Removes the lock file if it names this process. Never raises (the job is ending, and a
    lock file left behind ages into a stale one): warns where the file names another holder,
    cannot be read or cannot be removed."""
    try:
        holder = _read(path)[0]
    except OSError as error:
        holder, problem = None, f"it cannot be read: {error}"
    else:
        problem = None if _is_mine(holder) else f"it names {_describe(holder)}"
    if problem is None:
        try:
            os.unlink(path)
            return
        except OSError as error:
            problem = f"removing it failed: {error}"
    logger.warning(f"> {path} was not removed ({problem}); left as it is")


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unreadable lock file"
    jobs = ", ".join(
        f"{kind} {job_id} attempt {attempt}"
        for kind, (job_id, attempt) in _recorded_jobs(holder).items()
    )
    return (
        f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"
        + (f", job {jobs}" if jobs else "")
    )


def _in_use_message(path: str, holder: dict[str, Any] | None, age: float) -> str:
    root = os.path.dirname(path)
    return (
        f"--save {root} is in use by another job ({_describe(holder)}; its last heartbeat "
        f"{age:.0f} s ago): two jobs saving into one directory remove each other's saves in "
        f"progress and replace each other's checkpoints. Pass another --save directory, or "
        f"wait for that job to end. If it has ended (or {root} is a copy of its directory), "
        f"delete {path}; a lock without a heartbeat for {STALE_AFTER_S:.0f} s is taken over."
    )


class _Heartbeat:
    """Every `HEARTBEAT_S` seconds, refreshes the modification time of the lock file `path`,
    or creates it again holding `text` (this process's identity) where it is gone: a job
    taking over removes only a stale lock, and one created again has a fresh heartbeat, so the
    next job to read it sees it live. A file that cannot be read or refreshed is tried again at
    the next beat (a warning when the trouble starts, one when it ends); a file naming another
    holder stops it. A daemon thread: it never keeps the process alive."""

    def __init__(self, path: str, text: str):
        self._path = path
        self._text = text
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="save-lock-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        troubled = False
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                other = self._beat()
            except OSError as error:  # NFS's ESTALE or EIO, a file being written
                if not troubled:
                    logger.warning(
                        f"> refreshing {self._path} failed ({error}); trying again at each beat"
                    )
                troubled = True
                continue
            if other is not None:
                logger.warning(
                    f"> {self._path} was taken over ({_describe(other)}): this job's next save "
                    "will fail"
                )
                return
            if troubled:
                logger.warning(f"> refreshing {self._path} works again")
                troubled = False

    def _beat(self) -> dict[str, Any] | None:
        """Refreshes the lock file, or creates it again where it is gone; returns the holder it
        names instead of this process, if any.

        Raises:
            OSError: it cannot be read, created or refreshed.
        """
        try:
            holder = _read(self._path)[0]
        except FileNotFoundError:
            if _create(self._path, self._text):
                logger.warning(f"> {self._path} was gone; created it again")
                return None
            holder = _read(self._path)[0]  # another job's, created meanwhile
        if holder is None:
            raise OSError("it cannot be read as a lock file")
        if not _is_mine(holder):
            return holder
        os.utime(self._path)
        return None
