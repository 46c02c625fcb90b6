"""`StepReduction`: the reductions a group's gradients wait for until the end of the step.

What runs is chosen once, in the group's plan (`InnerReduction`, `OuterReduction`):

| plan                      | over the shard group (inner)          | over the replicas (outer)    |
|---------------------------|---------------------------------------|------------------------------|
| ZeRO-2/3                  | done already, in each backward        |                              |
| ZeRO-1                    | the local sums, reduce-scattered      |                              |
| no sharding               | the local sums, all-reduced           |                              |
| HSDP (any inner)          |                                       | all-reduced                  |
| HFSDP (ZeRO-3 inside)     |                                       | this shard, reduce-scattered |

Each reduction runs in the reduction dtype (`ResolvedPrecision.grad_comm`) on the current
stream, averaging or summing as `ShardGroups.average_grads` says.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import DBuffer, ShardLayout, copy_chunks_in
from megatron.core.distributed.fsdp.distributed_index import ShardGroups
from megatron.core.distributed.fsdp.plan import GroupPlan, InnerReduction, OuterReduction


class StepReduction:
    """The once-per-step reductions of one group's accumulated gradients.

    Args:
        plan: the group's plan (which reductions run, in which dtype).
        layout: the gradients' layout over the shard group.
        outer_layout: HFSDP: the layout of this replica's shard over the replicas.
        groups: the process groups to reduce over.
        device: where the staging tensors live.
    """

    def __init__(
        self,
        plan: GroupPlan,
        layout: ShardLayout,
        outer_layout: ShardLayout | None,
        groups: ShardGroups,
        device: torch.device,
    ):
        self._inner = plan.inner_reduction
        self._outer = plan.outer_reduction
        self._dtype = plan.precision.grad_comm
        self._layout = layout
        self._outer_layout = outer_layout
        self._groups = groups
        self._device = device

    def run(self, main_grad: DBuffer, comm: Collectives) -> torch.Tensor:
        """Reduces the step's gradients accumulated in `main_grad`; returns what the optimizer
        gets of them on this rank (in `main_grad` itself where no reduction needs another
        tensor)."""
        groups = self._groups
        if self._inner is InnerReduction.DONE:
            reduced = main_grad.shard
        elif self._inner is InnerReduction.REDUCE_SCATTER:
            reduced = torch.empty(self._layout.shard_numel, dtype=self._dtype, device=self._device)
            comm.reduce_scatter(
                reduced,
                main_grad.full.to(self._dtype),
                groups.shard,
                average=groups.average_grads,
                divisor=groups.grad_divisor,
            )
        else:
            self._all_reduce(main_grad.full, groups.shard, groups.grad_divisor, comm)
            reduced = main_grad.full
        if self._outer is OuterReduction.REDUCE_SCATTER:
            reduced = self._reduce_scatter_outer(main_grad, comm)
        elif self._outer is OuterReduction.ALL_REDUCE:
            self._all_reduce(reduced, groups.outer, groups.outer_size, comm)
        return reduced

    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, divisor: int, comm: Collectives
    ) -> None:
        """All-reduces `tensor` in place, through a copy in the reduction dtype where it has
        another."""
        staging = tensor.to(self._dtype)
        comm.all_reduce(staging, group, average=self._groups.average_grads, divisor=divisor)
        if staging is not tensor:
            tensor.copy_(staging)

    def _reduce_scatter_outer(self, main_grad: DBuffer, comm: Collectives) -> torch.Tensor:
        """HFSDP: this replica's inner gradient shard reduce-scattered over the replicas."""
        layout = self._outer_layout
        staging = torch.empty(layout.numel, dtype=self._dtype, device=self._device)
        copy_chunks_in(main_grad.local_views(), staging, layout)
        out = torch.empty(layout.shard_numel, dtype=self._dtype, device=self._device)
        comm.reduce_scatter(out, staging, self._groups.outer, average=self._groups.average_grads)
        return out
