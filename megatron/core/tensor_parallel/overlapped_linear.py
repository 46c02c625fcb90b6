"""The GEMM of a column-parallel layer fused with its tensor-parallel communication, so that the
communication of backward overlaps its GEMMs (Megatron-core's
`LinearWithGradAccumulationAndAsyncCommunication`).

Forward: under sequence parallelism the input's sequence is all-gathered and projected; else the
(replicated) input is projected as it is. Only this rank's part of the input is kept for backward,
so the gathered [s, b, h] input of every column-parallel layer does not stay alive between
forward and backward: backward gathers it again, while it computes the input's gradient. The input
gradient's reduce-scatter (sequence parallel) or all-reduce (replicated input) then runs while the
weight gradient is computed.

The same arithmetic as `gather_from_sequence_parallel_region` / `copy_to_tensor_model_parallel_
region` followed by `F.linear`: only the order and the overlap of the collectives differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.grad_accumulation import linear, weight_grad
from megatron.core.tensor_parallel.mappings import gather_first_async, reduce_scatter_first_async

if TYPE_CHECKING:
    from megatron.core.fp8.linear import Fp8LinearSlots


class _ColumnParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        sequence_parallel: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(input_, weight)
        # The parameter itself, for gradient-accumulation fusion (a checkpoint's recomputation
        # saves another tensor object).
        ctx.weight = weight
        ctx.has_bias = bias is not None
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        total = input_
        if sequence_parallel:
            total, gathering = gather_first_async(input_, group)
            gathering.wait()
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input_, weight = ctx.saved_tensors
        group = ctx.group
        total, gathering = input_, None
        if ctx.sequence_parallel:
            total, gathering = gather_first_async(input_, group)
        grad_input = reducing = None
        if ctx.needs_input_grad[0]:
            grad_total = grad_output.matmul(weight)
            if ctx.sequence_parallel:
                if gathering is not None:
                    gathering.wait()
                    gathering = None
                grad_input, reducing = reduce_scatter_first_async(grad_total, group)
            else:
                grad_input = grad_total
                reducing = dist.all_reduce(grad_input, group=group, async_op=True)
        if gathering is not None:
            gathering.wait()
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad(grad_output, total, ctx.weight, ctx.next_functions[1][0])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        if reducing is not None:
            reducing.wait()
        return grad_input, grad_weight, grad_bias, None, None


def column_parallel_linear(
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    sequence_parallel: bool,
    fp8: Fp8LinearSlots | None = None,
    *,
    fusion: bool = True,
) -> torch.Tensor:
    """`F.linear` of a column-parallel weight shard, with the tp communication around it.

    Args:
        input_: [s, b, h]; this rank's [s/T, b, h] under sequence parallelism.
        weight: This rank's [out/T, h] rows.
        bias: This rank's [out/T] bias, or None.
        group: The tp group (None or one rank: a plain `F.linear`).
        sequence_parallel: The input is split along the sequence (all-gathered here; its
            gradient reduce-scattered), else replicated (its gradient all-reduced).
        fp8: The layer's FP8 settings: the same communication around FP8 GEMMs
            (`megatron.core.fp8.linear`); None: high precision.
        fusion: whether the weight gradient may fuse into a registered `main_grad` on one
            rank (`grad_accumulation.linear`).

    Returns:
        [s, b, out/T] (the whole sequence).
    """
    if group is None or group.size() == 1:
        return linear(input_, weight, bias, fp8, fusion=fusion)
    if fp8 is not None:
        return fp8.column_parallel_linear(input_, weight, bias, group, sequence_parallel)
    return _ColumnParallelLinear.apply(input_, weight, bias, group, sequence_parallel)
