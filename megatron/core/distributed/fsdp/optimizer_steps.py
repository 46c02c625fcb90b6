"""Counts optimizer steps over Megatron-FSDP main weights, for every `torch.optim.Optimizer`.

Fused and foreach optimizer kernels write the main weights without bumping their version
counters, so the weights' main version (`weights.py`) also counts the steps of every optimizer
that holds them. The count comes from torch's public global step hook, registered once: it
needs no cooperation from the optimizer (no `fully_shard_optimizer`), and costs an unrelated
optimizer one dictionary lookup per step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from megatron.core.distributed.fsdp.weights import GroupWeights

_weights_of = WeakIdKeyDictionary()
"""Main weight (DTensor or local shard) -> weakref of its `GroupWeights`."""

_stepped: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, list[weakref.ref]]] = (
    weakref.WeakKeyDictionary()
)
"""Optimizer -> (its number of parameters when looked up, the groups whose weights it holds)."""

_hook: Any = None


def track(weights: GroupWeights) -> None:
    """Counts, from now on, every optimizer step over `weights`' main weights."""
    global _hook
    ref = weakref.ref(weights)
    for tensor in (*weights.main_weights, *weights.local_main_weights):
        _weights_of[tensor] = ref
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_after_step)


def _after_step(optimizer: torch.optim.Optimizer, *unused: Any) -> None:
    num_params = sum(len(group["params"]) for group in optimizer.param_groups)
    entry = _stepped.get(optimizer)
    if entry is None or entry[0] != num_params:  # new, or `add_param_group` since
        held: dict[int, weakref.ref] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                ref = _weights_of.get(param)
                if ref is not None:
                    held[id(ref)] = ref
        entry = (num_params, list(held.values()))
        _stepped[optimizer] = entry
    for ref in entry[1]:
        weights = ref()
        if weights is not None:
            weights.untracked_writes += 1
