"""The one place Megatron-FSDP issues collectives from.

Every all-gather, reduce-scatter and all-reduce of the engine goes through `Collectives`, so the
policy of how they run lives here: which reduction op averages (NCCL has `AVG`, gloo and NCCL's
symmetric kernels do not), skipping communication on single-rank groups, and where staging
buffers come from (the caching allocator, or NCCL symmetric memory with `use_symm_mem`). The
calls are synchronous on the current stream; `FsdpContext` picks that stream (the all-gather or
reduce-scatter stream on GPU), so the same code runs on CPU and GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.symmetric_memory import SymmetricStaging


class Collectives:
    """Issues the engine's collectives; outputs are preallocated (`out=` style).

    Args:
        symmetric: persistent NCCL symmetric-memory staging buffers (`use_symm_mem`), or None
            for staging from the caching allocator.
    """

    def __init__(self, symmetric: SymmetricStaging | None = None):
        self.symmetric = symmetric

    def staging(
        self,
        role: str,
        group: dist.ProcessGroup,
        dtype: torch.dtype,
        numel: int,
        device: torch.device,
    ) -> torch.Tensor:
        """An uninitialised buffer of `numel` elements for the `role` collective over `group`
        (`symmetric_memory.ALL_GATHER` output or `REDUCE_SCATTER` input)."""
        if self.symmetric is not None and group.size() > 1:
            return self.symmetric.buffer(role, group, dtype, numel)
        return torch.empty(numel, dtype=dtype, device=device)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """Concatenates every rank's `input` (in group-rank order) into `output`, in
        `output`'s dtype.

        Always in place: `input` is first copied (and cast) into this rank's slot of `output`,
        so a cast needs no buffer of its own, and a symmetric `output` has its input inside the
        registered window as NCCL's symmetric kernels require.
        """
        if group.size() == 1:
            output.copy_(input)
            return
        own = output.view(group.size(), -1)[group.rank()]
        own.copy_(input)
        _all_gather_single(output, own, group=group)

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
        symmetric = self._is_symmetric(input)
        op = self._op(group, average, symmetric)
        if symmetric:
            own = input.view(group.size(), -1)[group.rank()]
            _reduce_scatter_single(own, input, op=op, group=group)
            output.copy_(own)
        else:
            _reduce_scatter_single(output, input, op=op, group=group)
        _finish_average(output, op, group, average)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, *, average: bool) -> None:
        """Reduces `tensor` over `group` in place."""
        if group.size() == 1:
            return
        op = self._op(group, average, symmetric=False)
        dist.all_reduce(tensor, op=op, group=group)
        _finish_average(tensor, op, group, average)

    def _is_symmetric(self, tensor: torch.Tensor) -> bool:
        return self.symmetric is not None and self.symmetric.owns(tensor)

    @staticmethod
    def _op(group: dist.ProcessGroup, average: bool, symmetric: bool) -> dist.ReduceOp:
        if average and not symmetric and dist.get_backend(group) == "nccl":
            return dist.ReduceOp.AVG
        return dist.ReduceOp.SUM


# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _finish_average(
    tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup, average: bool
) -> None:
    """Divides a SUM into the average where `op` could not average itself."""
    if average and op != dist.ReduceOp.AVG:
        tensor.div_(group.size())
