"""`warm_context()`: a multiprocessing context whose processes start with torch and Megatron
imported.

Its processes are forked from one single-threaded forkserver that imported them once, instead of
each importing them anew (5-8 s per process on CI's two cores, every rank pool and every program
a test runs). Forked from the server, not from the test process, they inherit none of its threads
or state: each starts as a new interpreter would, its modules already loaded.

The server must not ask CUDA anything (torch refuses CUDA in a process forked after that), so
neither may importing `PRELOAD`: `test_utils` checks Megatron's imports.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context

PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.tensor.debug",
    "torch._dynamo",
    "megatron.training",
    "megatron.core.models.gpt",
]
"""What the server imports before it forks (names importable from any directory). Megatron
imports no dynamo (`test_utils`), but a process meets it at its first DTensor (under
`torch._disable_dynamo`) or compiled layer, 1-2 s on CI; the harness imports
`torch.distributed.tensor.debug` after every test."""


def warm_context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server preloading `PRELOAD` (it starts at the first process
    started through it)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
