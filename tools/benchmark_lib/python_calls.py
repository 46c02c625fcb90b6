"""Counts the Python-level calls of one training step: a host-time measure that does not move
with the host's speed.

Where a step is bound by the host, its time is the calls the interpreter makes (of Python
functions, and of C functions from Python, each an aten op dispatch at most) and the work
behind them. Timings of such steps drift with the machine's load by tens of percent; the count
of calls is the same in every run of the same code, so a change that removes calls shows at
once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType


def count_python_calls(step: Callable[[], object], skip: frozenset[CodeType] = frozenset()) -> int:
    """The Python function calls and the calls of C functions from Python of one call of
    `step` (after warm-up calls made its caches), but those made inside a function whose code
    is in `skip` (work that stands in for a kernel on another device)."""
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        if event not in ("call", "c_call"):
            return
        if skip:
            caller = frame
            while caller is not None:
                if caller.f_code in skip:
                    return
                caller = caller.f_back
        calls += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls
