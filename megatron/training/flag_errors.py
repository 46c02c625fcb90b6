"""How bad flags end a multi-rank job: one message, printed by rank 0, and exit code 2.

torchrun stops the whole job when the first rank exits, so a rank that found a bad flag before
rank 0 had printed it would end the job with no message at all. Every rank but 0 therefore waits
up to `FLAG_ERROR_GRACE_S` before it exits (rank 0's exit ends the wait); a rank still running
after the wait found an error rank 0 did not (a data path its node cannot see), and prints it,
naming itself. This holds for argparse's errors (`FlagParser`: an unknown or malformed flag) and for
`InvalidFlagsError`, which validation raises, ended by `report_flag_errors`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import NoReturn

FLAG_ERROR_GRACE_S = 60.0
"""How long a rank other than 0 waits for rank 0 to print a flag error and end the job."""


class InvalidFlagsError(ValueError):
    """The flags are bad: raised, with the same message on every rank, before any process group
    exists (the message names the flag and the fix)."""


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _is_another_rank() -> bool:
    return _rank() != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _exit_after_rank_0(message: str) -> NoReturn:
    time.sleep(FLAG_ERROR_GRACE_S)
    print(f"error (rank {_rank()}): {message}", file=sys.stderr, flush=True)
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
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        _in_entry_point = False
