"""`FsdpParameterGroup`: the parameters of one FSDP unit that share dtype, trainability and
expert-ness: their plan (`plan.py`), weights (`weights.py`) and gradients (`gradients.py`).

Gradient memory lives from a step's first reduction to `zero_grad()`, so it is not held during
the forward, where activations peak. Where the main weights are the same dtype and layout as the
compute weights they share storage, and refreshing them is a no-op.
"""

from __future__ import annotations

import torch

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import ShardLayout
from megatron.core.distributed.fsdp.distributed_index import ShardGroups
from megatron.core.distributed.fsdp.gradients import GradState, GroupGrads
from megatron.core.distributed.fsdp.mixed_precision import ResolvedPrecision
from megatron.core.distributed.fsdp.plan import GroupPlan
from megatron.core.distributed.fsdp.strategy import ShardingPolicy
from megatron.core.distributed.fsdp.weights import GroupWeights, ParamSlot

__all__ = ["FsdpParameterGroup", "ParamSlot"]


class FsdpParameterGroup:
    """The parameters of one unit with the same (dtype, requires_grad, is_expert, FP8 gather).

    Args:
        shapes: each parameter's shape.
        slots: where each parameter is registered.
        model_dtype: dtype of the compute weights (the dtype the module was built in).
        requires_grad: whether the parameters train.
        fp8_gather: the compute weights are FP8 (`fp8_gather.py`).
        keep_fp8_transposes: FP8 compute weights keep their transposes until the next refresh.
        groups: the process groups to shard and communicate over.
        strategy: what to shard.
        precision: the resolved dtypes.
        comm: the collectives issuer.
        device: where buffers live.

    Attributes:
        plan: what the group keeps and does.
        weights: the unsharded and sharded main weights.
        grads: the gradients (None for a frozen group).
    """

    def __init__(
        self,
        shapes: list[torch.Size],
        slots: list[ParamSlot],
        *,
        model_dtype: torch.dtype,
        requires_grad: bool,
        fp8_gather: bool = False,
        keep_fp8_transposes: bool = False,
        groups: ShardGroups,
        strategy: ShardingPolicy,
        precision: ResolvedPrecision,
        comm: Collectives,
        device: torch.device,
    ):
        self.plan = GroupPlan.make(
            strategy,
            precision,
            groups,
            model_dtype=model_dtype,
            requires_grad=requires_grad,
            fp8_gather=fp8_gather,
            keep_fp8_transposes=keep_fp8_transposes,
        )
        layout = ShardLayout(shapes, self.plan.num_shards)
        self.weights = GroupWeights(self.plan, layout, slots, groups, comm, device)
        self.grads = GroupGrads(self.plan, self.weights, comm) if requires_grad else None

    def bind(self, comm: Collectives) -> None:
        """Makes the group issue its collectives through `comm` (the root context's)."""
        self.weights.comm = comm
        if self.grads is not None:
            self.grads.comm = comm

    @property
    def requires_grad(self) -> bool:
        return self.plan.requires_grad

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def main_weights(self) -> list[torch.nn.Parameter]:
        """The DTensor main weights (what `module.parameters()` returns between forwards)."""
        return self.weights.main_weights

    @property
    def local_main_weights(self) -> list[torch.Tensor]:
        """The local shard of each DTensor main weight."""
        return self.weights.local_main_weights

    @property
    def has_transient_weights(self) -> bool:
        """Whether the whole compute weights are gathered for each use and freed after."""
        return self.plan.transient_unsharded

    def load_full_tensor(self, index: int, full: torch.Tensor) -> None:
        """Writes parameter `index` from its whole value (see `GroupWeights.load_full_tensor`)."""
        self.weights.load_full_tensor(index, full)

    # Introspection.

    @property
    def holds_unsharded(self) -> bool:
        """Whether the whole compute weights are in memory now."""
        return self.weights.holds_unsharded

    @property
    def holds_grads(self) -> bool:
        """Whether gradient memory is held (from a step's first reduction to `zero_grad`)."""
        return self.grads is not None and self.grads.holds_memory

    @property
    def grad_state(self) -> GradState | None:
        """Where the gradients are in their lifecycle (None: a frozen group)."""
        return None if self.grads is None else self.grads.state
