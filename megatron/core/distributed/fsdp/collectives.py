"""The one place Megatron-FSDP issues collectives from.

Every all-gather, reduce-scatter and all-reduce of the engine goes through `Collectives`, so the
policy of where and how they run lives here: which reduction op averages (NCCL has `AVG`, gloo
does not), and skipping communication on single-rank groups. On CPU (gloo) every call is
synchronous; the GPU streams and events that let them overlap compute attach here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Collectives:
    """Issues the engine's collectives; outputs are preallocated (`out=` style)."""

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """Concatenates every rank's `input` (in group-rank order) into `output`."""
        if group.size() == 1:
            output.copy_(input)
            return
        _all_gather_single(output, input, group=group)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        average: bool,
    ) -> None:
        """Reduces `input` over `group` and leaves this rank's 1/N slice of it in `output`."""
        if group.size() == 1:
            output.copy_(input)
            return
        _reduce_scatter_single(output, input, op=self._op(group, average), group=group)
        self._finish_average(output, group, average)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, *, average: bool) -> None:
        """Reduces `tensor` over `group` in place."""
        if group.size() == 1:
            return
        dist.all_reduce(tensor, op=self._op(group, average), group=group)
        self._finish_average(tensor, group, average)

    @staticmethod
    def _op(group: dist.ProcessGroup, average: bool) -> dist.ReduceOp:
        if average and _has_avg(group):
            return dist.ReduceOp.AVG
        return dist.ReduceOp.SUM

    @staticmethod
    def _finish_average(tensor: torch.Tensor, group: dist.ProcessGroup, average: bool) -> None:
        if average and not _has_avg(group):
            tensor.div_(group.size())


# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _has_avg(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == "nccl"
