"""`microbatch()`: tells Megatron-FSDP where a backward sits in gradient accumulation; and the
other root-level controls (`set_profiler_labels`, `accumulation_memory`, `unit_memory`; the
lookups they use, `fsdp_roots` and `fsdp_contexts`, are `roots.py`'s).

    for i, batch in enumerate(batches):
        with microbatch(model, is_last=i == len(batches) - 1):
            loss_fn(model(batch)).backward()
    optimizer.step()

Reductions that only need to happen once per step (the all-reduce or reduce-scatter of `no_shard`
/ `optim`, the outer reduction of hybrid sharding) run at the end of the last microbatch's
backward. Outside the helper every backward is treated as the last, so code that never uses it
is correct, only slower. Refreshing the compute weights needs no help: the engine sees by itself
whether the main weights changed.

Two options of the root's `OverlapPolicy` trade memory for traffic across the microbatches of a
step (both off by default, the leanest in memory; `accumulation_memory` says what they hold):
`keep_unsharded_params` gathers each ZeRO-3 unit once per step instead of twice per microbatch,
`accumulate_unsharded_grads` reduce-scatters each ZeRO-2/3 unit's gradients once per step
instead of once per microbatch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron.core.distributed.fsdp.roots import fsdp_contexts


@contextlib.contextmanager
def microbatch(
    module: torch.nn.Module, *, is_last: bool, is_first: bool | None = None
) -> Iterator[None]:
    """Scopes one microbatch's forward and backward; restores the previous state on exit.

    Args:
        module: the model, or any module containing Megatron-FSDP units.
        is_last: the step's last microbatch (its backward runs the deferred reductions).
        is_first: accepted so that loops written for earlier releases run unchanged; it has no
            effect (the engine tells by itself when compute weights must be refreshed).
    """
    with contextlib.ExitStack() as stack:
        for context in fsdp_contexts(module):
            stack.enter_context(context.microbatch_state(is_last))
        yield


def set_profiler_labels(module: torch.nn.Module, enabled: bool = True) -> None:
    """Turns on (or off) the profiler ranges of every unit under `module`: one per unit and
    phase, named like "MFSDP decoder.layers.3 forward all-gather" (`profiling.py`)."""
    for context in fsdp_contexts(module):
        context.labels.enabled = enabled


def accumulation_memory(module: torch.nn.Module) -> dict[str, int]:
    """The most each gradient-accumulation option of `OverlapPolicy` holds, in bytes on this
    rank, whether it is on or not.

    - "keep_unsharded_params": the whole compute weights of every unit whose weights are sharded
      (ZeRO-3), all at once from a step's first microbatch to its last backward (without it:
      `max_unsharded_units` units and the root at a time);
    - "accumulate_unsharded_grads": the whole gradients, in the main-grads dtype, of every
      trainable group whose gradients are sharded (ZeRO-2/3), from the first microbatch's
      backward to the last microbatch's reduce-scatter (without it: their 1/N shards).

    Raises:
        ValueError: there is no Megatron-FSDP unit under `module`.
    """
    weights = grads = 0
    for context in fsdp_contexts(module):
        for unit in context.units():
            for group in unit.groups:
                plan, layout = group.plan, group.weights.layout
                if plan.transient_unsharded:
                    weights += layout.numel * plan.held_itemsize
                if plan.requires_grad and plan.shards_grads:
                    numel = sum(shape.numel() for shape in layout.shapes)
                    grads += numel * plan.precision.main_grads.itemsize
    return {"keep_unsharded_params": weights, "accumulate_unsharded_grads": grads}


def unit_memory(module: torch.nn.Module) -> dict[str, int]:
    """The most one unit other than a root holds whole, in bytes on this rank (what units of
    several layers, `suggested_communication_unit_size`, raise):

    - "weights": its compute weights while gathered (ZeRO-3), up to `max_unsharded_units`
      units' at once;
    - "grads": its gradients in the reduction dtype while reduce-scattered (ZeRO-2/3), the unit
      whose backward runs and the one reduced before it at once.

    Raises:
        ValueError: there is no Megatron-FSDP unit under `module`.
    """
    weights = grads = 0
    for context in fsdp_contexts(module):
        for unit in context.units():
            if unit.position == 0:
                continue
            unit_weights = unit_grads = 0
            for group in unit.groups:
                plan, numel = group.plan, group.weights.layout.numel
                if plan.transient_unsharded:
                    unit_weights += numel * plan.held_itemsize
                if plan.requires_grad and plan.shards_grads:
                    unit_grads += numel * plan.precision.grad_comm.itemsize
            weights, grads = max(weights, unit_weights), max(grads, unit_grads)
    return {"weights": weights, "grads": grads}
