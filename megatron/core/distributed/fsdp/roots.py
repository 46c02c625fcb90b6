"""Finding Megatron-FSDP's pieces in a module: its roots (`fsdp_roots`), their contexts
(`fsdp_contexts`), the parameter groups of its units (`parameter_groups`) and their main weights'
local shards (`local_main_weights`); and `FsdpRoots`, the engine interface of a module sharded
with `fully_shard()` but not wrapped in `FullyShardedDataParallel`.

The lookups of `microbatch.py`, `optimizer.py`, the adapter and the Megatron optimizer go
through these; `FsdpModule` walks its own units.
"""

from __future__ import annotations

import torch

from megatron.core.distributed.fsdp.context import FsdpContext
from megatron.core.distributed.fsdp.fsdp_module import FsdpModule
from megatron.core.distributed.fsdp.param_group import FsdpParameterGroup
from megatron.core.distributed.fsdp.weights import step_amaxes
from megatron.core.fusions.fused_adam import StepAmaxes


def fsdp_roots(module: torch.nn.Module) -> list[FsdpModule]:
    """The outermost Megatron-FSDP units in `module` (depth first; `module` need not be one)."""
    roots: list[FsdpModule] = []
    stack = [module]
    while stack:
        current = stack.pop()
        if isinstance(current, FsdpModule):
            roots.append(current)
        else:
            stack.extend(reversed(list(current.children())))
    return roots


def fsdp_contexts(module: torch.nn.Module) -> list[FsdpContext]:
    """The context of every root under `module`, created now if needed (no duplicates).

    Raises:
        ValueError: there is no Megatron-FSDP unit under `module`.
    """
    roots = fsdp_roots(module)
    if not roots:
        raise ValueError(
            f"No Megatron-FSDP unit in {type(module).__name__}: call fully_shard() (or wrap the "
            "model with FullyShardedDataParallel) first."
        )
    contexts: list[FsdpContext] = []
    for root in roots:
        context = root.fsdp_unit.lazy_init()
        if all(context is not c for c in contexts):
            contexts.append(context)
    return contexts


def parameter_groups(module: torch.nn.Module) -> list[FsdpParameterGroup]:
    """Every parameter group of every Megatron-FSDP unit in `module` (a unit of several
    modules once)."""
    units = dict.fromkeys(m.fsdp_unit for m in module.modules() if isinstance(m, FsdpModule))
    return [group for unit in units for group in unit.groups]


def local_main_weights(module: torch.nn.Module) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Each DTensor main weight of `module`'s Megatron-FSDP units -> its local shard, the
    tensor to give an optimizer that should step without DTensor dispatch."""
    return {
        param: local
        for group in parameter_groups(module)
        for param, local in zip(group.main_weights, group.local_main_weights)
    }


class FsdpRoots:
    """The engine interface (`megatron.core.distributed.engine.DataParallelEngine`) of a module
    with `fully_shard()` units that no `FullyShardedDataParallel` wraps, so an optimizer treats
    it as it treats the wrapper.

    Args:
        module: the module (itself a root, or holding roots).

    Raises:
        ValueError: there is no Megatron-FSDP unit under `module`.
    """

    keeps_main_weights = True
    """The units' DTensor main weights are the module's parameters (an optimizer keeps no
    masters)."""

    def __init__(self, module: torch.nn.Module):
        if not fsdp_roots(module):
            raise ValueError(
                f"No Megatron-FSDP unit in {type(module).__name__}: call fully_shard() on it first."
            )
        self.module = module

    def finish_grad_sync(self) -> None:
        """Runs the reductions still deferred (`microbatch(is_last=False)`); idempotent."""
        # Looked up at each call, as `microbatch()` does: the contexts are made by the first
        # forward (or the first lookup), not when the optimizer is built.
        for context in fsdp_contexts(self.module):
            context.finalize_grads()

    def global_view(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as it is: the main weights and their gradients are global DTensors."""
        return tensor

    def local_main_weights(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each main weight -> its local shard (`local_main_weights(module)`)."""
        return local_main_weights(self.module)

    def prepare_step_amaxes(self) -> StepAmaxes | None:
        """The amaxes of the units' FP8 compute weights for the optimizer step about to write
        the main weights to record (`FullyShardedDataParallel.prepare_step_amaxes`)."""
        return step_amaxes([group.weights for group in parameter_groups(self.module)])
