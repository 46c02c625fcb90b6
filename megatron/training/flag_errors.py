"""How bad flags end a multi-rank job: one message, printed by rank 0, and exit code 2.

torchrun stops the whole job when the first rank exits, so a rank that found a bad flag before
rank 0 had printed it would end the job with no message at all. Every rank but 0 therefore waits
up to `FLAG_ERROR_GRACE_S` before it exits (rank 0's exit ends the wait); a rank still running
after the wait found an error rank 0 did not (a data path its node cannot see), and prints it,
naming itself. This holds for argparse's errors (`FlagParser`: an unknown or malformed flag) and for
`InvalidFlagsError`, which validation raises, ended by `report_flag_errors`. Validation reports
every independent error of a command line in that one message (`FlagErrors`, collected by
`FlagErrorCollector`), so that one launch shows all that is to fix.

Some flags are refused only once the process group exists: a checkpoint saved with another
schedule or model, a `--save` directory that holds another run's checkpoints
(`reported_as_flag_errors`). Rank 0 prints the message, posts it in the process group's store and
exits with code 2; every other rank that raised exits with code 2 as soon as rank 0's message is
there, printing its own only if rank 0 posted another one or none within `FLAG_ERROR_GRACE_S` (a
rank that alone found the error: a directory its node cannot see). The store, not a collective:
ranks that raised nothing have gone on to their next collective, which a barrier of the raising
ranks would be matched with.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

import torch.distributed as dist

FLAG_ERROR_GRACE_S = 60.0
"""How long a rank other than 0 waits for rank 0 to print a flag error and end the job."""


class InvalidFlagsError(ValueError):
    """The flags are bad: raised, with the same message on every rank, before any process group
    exists (the message names the flag and the fix)."""


class FlagErrors(ValueError):
    """Several independent flag errors, reported together so that a user fixes them all after one
    launch: the message of a single error is that error's own; of several, a count and then one
    line each.

    Attributes:
        messages: Each error's message, in the order found.
    """

    def __init__(self, messages: list[str]) -> None:
        self.messages = list(messages)
        if len(self.messages) == 1:
            super().__init__(self.messages[0])
        else:
            lines = "\n".join(f"  - {message}" for message in self.messages)
            super().__init__(f"{len(self.messages)} flag errors:\n{lines}")


class FlagErrorCollector:
    """Runs checks that raise `ValueError`, keeping every message instead of stopping at the
    first, and raises them together (`raise_errors`).

    A check named with `name` can be a prerequisite of later ones (`needs`): a check whose
    prerequisite failed (or was skipped) is skipped too, since it reads values that are bad or
    were never derived, and would report the same problem again, or a misleading one.
    """

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._failed: set[str] = set()

    def check(
        self,
        function: Callable[..., object],
        *args: object,
        name: str | None = None,
        needs: tuple[str, ...] = (),
    ) -> None:
        """Calls `function(*args)`, keeping the message of a `ValueError` it raises (each of a
        `FlagErrors`); skips it if any check it `needs` failed or was skipped."""
        if self._failed.intersection(needs):
            self._failed.add(name or function.__name__)
            return
        try:
            function(*args)
        except FlagErrors as errors:
            self._fail(name, function, errors.messages)
        except ValueError as error:
            self._fail(name, function, [str(error)])

    def _fail(self, name: str | None, function: Callable[..., object], found: list[str]) -> None:
        self._failed.add(name or function.__name__)
        self.messages.extend(m for m in found if m not in self.messages)

    def raise_errors(self) -> None:
        """Raises the messages kept so far as one `FlagErrors`; does nothing if there are none.

        Raises:
            FlagErrors: one or more checks failed.
        """
        if self.messages:
            raise FlagErrors(self.messages)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _is_another_rank() -> bool:
    return _rank() != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _print_error(message: str, rank: int | None = None) -> None:
    """argparse's format: `error: message` (rank 0), or naming the rank that prints it."""
    where = "" if rank is None else f" (rank {rank})"
    print(f"error{where}: {message}", file=sys.stderr, flush=True)


def _exit_after_rank_0(message: str) -> NoReturn:
    time.sleep(FLAG_ERROR_GRACE_S)
    _print_error(message, _rank())
    sys.exit(2)


_in_entry_point = False
"""Whether `report_flag_errors` is active: only a script's entry point waits for rank 0 (library
code and tests that parse flags on several ranks get argparse's own exit at once)."""


class FlagParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors, under `report_flag_errors`, rank 0 alone prints
    at once (module docstring)."""

    def error(self, message: str) -> NoReturn:
        if _in_entry_point and _is_another_rank():
            _exit_after_rank_0(message)
        super().error(message)


@contextlib.contextmanager
def report_flag_errors() -> Iterator[None]:
    """For a script's entry point: an `InvalidFlagsError` ends the job with exit code 2
    (argparse's) and its message printed once, by rank 0, instead of a traceback from every
    rank (module docstring)."""
    global _in_entry_point
    _in_entry_point = True
    try:
        yield
    except InvalidFlagsError as error:
        if _is_another_rank():
            _exit_after_rank_0(str(error))
        _print_error(str(error))
        sys.exit(2)
    finally:
        _in_entry_point = False


_reports = itertools.count()
"""Numbers the `reported_as_flag_errors` blocks of this process: every rank enters the same
blocks in the same order, so the number names one block's store key on every rank."""


@contextlib.contextmanager
def reported_as_flag_errors(*errors: type[Exception]) -> Iterator[None]:
    """Around a step that every rank of the default process group runs, and whose `errors` name
    bad flags (checks of a checkpoint or a `--save` directory against the flags): under
    `report_flag_errors` such an error ends the job as a bad flag does, its message printed
    once by rank 0 and exit code 2 on every rank that raised, without a traceback (module
    docstring); elsewhere (a library call, a test) it propagates unchanged.

    Raises:
        SystemExit: code 2, under `report_flag_errors`, once the message is printed.
    """
    key = f"megatron/flag_error/{next(_reports)}"
    try:
        yield
    except errors as error:
        if not _in_entry_point:
            raise
        message = str(error)
        store = _default_store()
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            _print_error(message)
            if store is not None:
                store.set(key, message)
        elif store is None or _posted(store, key, FLAG_ERROR_GRACE_S) != message:
            _print_error(message, rank)  # rank 0 did not fail so: this rank tells why
        raise SystemExit(2) from error


def _default_store() -> dist.Store | None:
    """The default process group's store; None without a group of several ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()


def _posted(store: dist.Store, key: str, timeout_s: float) -> str | None:
    """What rank 0 posted under `key` within `timeout_s` (polled: `Store.wait`'s timeout logs
    warnings); None if nothing, or if the store is gone (rank 0's process hosted it)."""
    deadline = time.monotonic() + timeout_s
    try:
        while not store.check([key]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return store.get(key).decode()
    except RuntimeError:  # torch's store errors (DistError) among them
        return None
