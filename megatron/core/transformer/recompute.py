"""Activation checkpointing that tells modules when they run a second time.

Non-reentrant `torch.utils.checkpoint` runs a checkpointed function twice with autograd on: in
forward, and again in backward to rebuild what it did not store. Work with side effects that
must happen once per forward (the MoE router's metrics and expert-bias token counts) asks
`is_recomputing()` and skips them in the second run.

The checkpoint replays the default generator itself; the tensor-parallel RNG tracker's states
(forked by dropout inside tensor-parallel regions) are replayed here too, so recomputed dropout
masks match the forward's at any tensor-parallel size, and so are the FP8 delayed-scaling scales
the forward cast with (`megatron.core.fp8.scaling`), so recomputed FP8 casts match the forward's.

`recompute_keeping` stores the outputs of chosen operators and recomputes the rest (PyTorch's
selective activation checkpoint): multi-latent attention keeps the attention kernel's outputs and
recomputes the projections that made its inputs, so neither those inputs nor the kernel's work
are paid for twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from megatron.core.fp8.scaling import scale_replay_contexts
from megatron.core.tensor_parallel.random import rng_tracker_replay_contexts
from megatron.core.utils import FreshContext, outside_compiled_graphs

_recompute_depth = 0
"""Checkpointed functions being recomputed now; a module global rather than thread-local, since
autograd runs CUDA backward (and with it the recomputation) on its own threads."""


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


def is_recomputing() -> bool:
    """Whether a `recompute()` checkpoint is running its function again in backward."""
    return _recompute_depth > 0


@contextlib.contextmanager
def _recompute_context(*replays: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for replay in replays:
            stack.enter_context(replay)
        with _recomputing():
            yield


@contextlib.contextmanager
def _forward_context(*forwards: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for forward in forwards:
            stack.enter_context(forward)
        yield


def _checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    forward_rng, replay_rng = rng_tracker_replay_contexts()
    forward_scales, replay_scales = scale_replay_contexts()
    return (
        _forward_context(forward_rng, forward_scales),
        FreshContext(lambda: _recompute_context(replay_rng, replay_scales)),
    )


def recompute(function: Callable, *args: Any) -> Any:
    """`function(*args)` under a non-reentrant checkpoint whose backward recomputation runs with
    `is_recomputing()` True. The RNG states (the default generator's and the tensor-parallel
    tracker's) are replayed, so dropout masks match.

    Inside code that `torch.compile` traces (`compile_layers`), the checkpointed function runs
    outside the compiled graph, by PyTorch's kernels in forward and recomputation alike:
    `torch.compile` refuses the checkpoint's contexts (the RNG tracker's replay), and a
    recomputation must run the forward's kernels to rebuild what it saved."""
    if torch.compiler.is_compiling():
        return _recompute_outside_graph(function, *args)
    return _checkpoint(function, *args)


def recompute_keeping(
    kept: Collection[torch._ops.OpOverload], function: Callable, *args: Any
) -> Any:
    """`recompute(function, *args)`, except that the outputs of the operators `kept` (aten
    overloads, e.g. an attention kernel) are stored in forward and handed back, not computed
    again, when the backward recomputes the rest (PyTorch's selective activation checkpoint).
    Empty `kept`: `recompute` itself."""
    if not kept:
        return recompute(function, *args)
    if torch.compiler.is_compiling():
        return _recompute_keeping_outside_graph(kept, function, *args)
    return _checkpoint_keeping(kept, function, *args)


def _checkpoint(function: Callable, *args: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False, context_fn=_checkpoint_contexts)


def _checkpoint_keeping(
    kept: Collection[torch._ops.OpOverload], function: Callable, *args: Any
) -> Any:
    def policy(ctx: Any, op: torch._ops.OpOverload, *op_args: Any, **op_kwargs: Any):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    def contexts() -> tuple[contextlib.AbstractContextManager, ...]:
        forward, recomputation = _checkpoint_contexts()
        keep_forward, keep_recomputation = create_selective_checkpoint_contexts(policy)
        return (
            _forward_context(forward, keep_forward),
            FreshContext(lambda: _forward_context(recomputation, keep_recomputation)),
        )

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts)


_recompute_outside_graph = outside_compiled_graphs(_checkpoint)
_recompute_keeping_outside_graph = outside_compiled_graphs(_checkpoint_keeping)
