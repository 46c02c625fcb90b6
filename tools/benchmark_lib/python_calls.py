"""Counts the Python-level calls of one training step: a measure of host work that does not
move with the host's speed.

Where a step is bound by the host, its time is the calls the interpreter makes and the work
behind them. Timings of such steps drift with the machine's load by tens of percent; the count
of calls is the same in every run of the same code and inputs. It counts each call of a Python
function and each call of a C function made from Python code (an aten op's dispatch, a
`list.append`); not the calls a C function makes (those of `map`, say), nor attribute reads. So
it tells where the interpreter's work goes, not what each call costs: a loop rewritten as one
`map` drops in the count far more than in time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType

import torch


def count_python_calls(step: Callable[[], object], skip: frozenset[CodeType] = frozenset()) -> int:
    """The Python function calls and the calls of C functions from Python of one call of
    `step` (after warm-up calls made its caches), but those made inside a function whose code
    is in `skip` (work that stands in for a kernel on another device). The backward runs on
    the calling thread (on CUDA autograd runs it on a thread of its own, which the count would
    not see)."""
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

    with torch.autograd.set_multithreading_enabled(False):
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
    return calls
