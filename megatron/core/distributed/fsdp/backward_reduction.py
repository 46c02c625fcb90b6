"""`BackwardReduction`: how one backward's gradients reach a group's `main_grad`.

Where gradients are sharded (ZeRO-2/3) each backward reduce-scatters them over the shard group
into this rank's shard of `main_grad` (`GradState.ACCUMULATING`); elsewhere they are added to
the whole local sums, which finalising reduces once (`StepReduction`). Either way the step's
first reduction overwrites `main_grad` and later ones add to it.
"""

from __future__ import annotations

import torch

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import DBuffer, ShardLayout, copy_chunks_in
from megatron.core.distributed.fsdp.distributed_index import ShardGroups


class BackwardReduction:
    """Moves whole gradients into one group's `main_grad`.

    Args:
        main_grad: the accumulation buffer (sharded when gradients are).
        layout: the gradients' layout over the shard group.
        groups: the process groups to reduce over.
        device: where the transient shards live.
    """

    def __init__(
        self, main_grad: DBuffer, layout: ShardLayout, groups: ShardGroups, device: torch.device
    ):
        self._main_grad = main_grad
        self._layout = layout
        self._groups = groups
        self._device = device
        if main_grad.sharded:
            # Each tensor's chunk in this rank's gradient shard: the outputs of its
            # reduce-scatter (views of persistent storage: made once).
            self._chunks = list(main_grad.shard.split(layout.chunk_numels))

    def reduce_scatter(self, sends: list[torch.Tensor], fresh: bool, comm: Collectives) -> None:
        """Reduces `sends` (each whole gradient, padded to N chunks, `SendBuffer.inputs`) into
        this rank's shard of `main_grad`, overwritten where `fresh`, else added to: straight
        into it when it starts afresh in its dtype, else through a transient shard that is
        copied (cast) or added, or over one rank by adding `sends` themselves (which it
        averages in place). `main_grad` is allocated already."""
        main_grad, layout = self._main_grad, self._layout
        groups = self._groups
        if not fresh and groups.shard.size() == 1:
            # Over one rank `sends` are the reduction: added to `main_grad` without a copy.
            comm.reduce_scatter_tensors(
                self._chunks,
                sends,
                groups.shard,
                average=groups.average_grads,
                divisor=groups.grad_divisor,
                accumulate=True,
            )
            return
        comm_dtype = sends[0].dtype
        direct = fresh and comm_dtype == main_grad.dtype
        out = (
            main_grad.shard
            if direct
            else torch.empty(layout.shard_numel, dtype=comm_dtype, device=self._device)
        )
        outputs = self._chunks if direct else out.split(layout.chunk_numels)
        comm.reduce_scatter_tensors(
            outputs,
            sends,
            groups.shard,
            average=groups.average_grads,
            divisor=groups.grad_divisor,
        )
        if direct:
            return
        if fresh:
            main_grad.shard.copy_(out)
        else:
            main_grad.shard.add_(out)

    def average_direct(self) -> None:
        """Averages the gradients that went straight into `main_grad` over a shard group of one
        rank (`GroupPlan.direct_grads`) where the skipped reduction would have: expert
        gradients, averaged over more ranks than their group's. With the reduction's kernel,
        `torch._foreach_div_` (CUDA's `Tensor.div_` by a scalar multiplies by its reciprocal,
        which rounds otherwise)."""
        groups = self._groups
        divisor = groups.grad_divisor or groups.shard.size()
        if groups.average_grads and divisor != 1:
            torch._foreach_div_(self._chunks, divisor)

    def add_locally(self, grads: list[torch.Tensor], fresh: bool) -> None:
        """Copies `grads` (one whole gradient per parameter) into the whole `main_grad` where
        `fresh`, else adds them to it. `main_grad` is allocated already."""
        main_grad = self._main_grad
        if fresh:
            copy_chunks_in(grads, main_grad.full, self._layout)
        else:
            local = torch.empty_like(main_grad.full)
            copy_chunks_in(grads, local, self._layout)
            main_grad.full.add_(local)
