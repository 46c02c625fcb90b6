"""`warm_context()`: a multiprocessing context whose processes start with torch and Megatron
imported.

Its processes are forked from one single-threaded forkserver that imported them once, instead of
each importing them anew (5-8 s per process on CI's two cores, every rank pool and every program
a test runs). Forked from the server, not from the test process, they inherit none of its threads
or state: each starts as a new interpreter would, its modules already loaded.

On a machine with CUDA the processes are spawned instead: there, importing Megatron's models
leaves a process (threads running, CUDA's devices counted) whose forks torch refuses CUDA.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context

import torch

PRELOAD = ["torch", "torch.distributed.tensor", "megatron.training", "megatron.core.models.gpt"]
"""What the server imports before it forks (names importable from any directory)."""


def warm_context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server preloading `PRELOAD` (it starts at the first process
    started through it); the spawn context where CUDA is available (module docstring)."""
    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
