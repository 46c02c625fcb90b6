"""Differentiable communication at the borders of tensor-parallel (tp) and sequence-parallel
regions, with Megatron-core's names.

Each function takes the tp group explicitly; a group of None or of size 1 makes it the identity
(forward and backward), so the same layer code runs with and without tensor parallelism.

- tp regions split the hidden (last) dimension: `copy_to_...` (forward identity, backward
  all-reduce), `reduce_from_...` (forward all-reduce, backward identity), `scatter_to_...` /
  `gather_from_tensor_model_parallel_region` (split / all-gather the last dimension).
- sequence-parallel regions split the sequence (first) dimension: `scatter_to_...` /
  `gather_from_sequence_parallel_region` and `reduce_scatter_to_sequence_parallel_region`.
- `grad_sum_over_tp(param, group)`: a replicated parameter used on sequence-split activations
  gets a partial gradient on each tp rank; routing it through this sums the gradient over tp
  in backward, so no engine needs to know about sequence parallelism.

Works with gloo (CPU) and NCCL: both implement the tensor all-gather / reduce-scatter used here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import divide, group_rank, group_size
from megatron.core.utils import all_gather_single, reduce_scatter_single

# The helpers below run only for groups of more than one rank: the public functions return
# their input unchanged otherwise, so a T = 1 model's autograd graph is a plain one.


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over `group`, into a new tensor: autograd may hand the same gradient tensor to
    several consumers, so it is never reduced in place."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = group_size(group)
    width = divide(x.shape[-1], size)
    return x.narrow(-1, group_rank(group) * width, width).contiguous()


def gather_first_async(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Starts the all-gather of `x` along dim 0 over `group`; the output is valid once the
    returned work is waited for."""
    out = x.new_empty((x.shape[0] * group_size(group), *x.shape[1:]))
    return out, all_gather_single(out, x.contiguous(), group=group, async_op=True)


def _gather_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out, work = gather_first_async(x, group)
    work.wait()
    return out


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # Gathering moves the last dim to the front, where the collective concatenates.
    gathered = _gather_first(x.movedim(-1, 0), group)
    return gathered.movedim(0, -1).contiguous()


def _split_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = group_size(group)
    rows = _rows_per_rank(x, size)
    return x.narrow(0, group_rank(group) * rows, rows).contiguous()


def reduce_scatter_first_async(
    x: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, dist.Work]:
    """Starts the sum over `group` of `x`, scattered along dim 0; the output is valid once the
    returned work is waited for."""
    out = x.new_empty((_rows_per_rank(x, group_size(group)), *x.shape[1:]))
    return out, reduce_scatter_single(out, x.contiguous(), group=group, async_op=True)


def _reduce_scatter_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out, work = reduce_scatter_first_async(x, group)
    work.wait()
    return out


def _rows_per_rank(x: torch.Tensor, size: int) -> int:
    if x.shape[0] % size != 0:
        raise ValueError(
            f"the first (sequence) dimension, {x.shape[0]}, is not divisible by the "
            f"tensor-parallel size {size}; sequence parallelism needs a sequence length that is "
            "a multiple of tensor_model_parallel_size."
        )
    return x.shape[0] // size


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Identity; backward all-reduces the gradient over tp."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce over tp; backward passes the gradient through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keeps this rank's part of the last dimension; backward all-gathers it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gathers the last dimension; backward keeps this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keeps this rank's part of the first dimension; backward all-gathers it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_first(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gathers the first dimension; backward reduce-scatters (the consumer is a tp region,
    whose ranks each hold a partial gradient) or only splits (the consumer is replicated)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        group: dist.ProcessGroup | None,
        tensor_parallel_output_grad: bool,
    ) -> torch.Tensor:
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatters (sums) the first dimension; backward all-gathers it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_first(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Enters a tp region: identity forward; the gradient is summed over `group`."""
    if group_size(group) == 1:
        return input_
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Leaves a tp region: sums the partial results over `group`; gradient passes through."""
    if group_size(group) == 1:
        return input_
    return _ReduceFromModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Keeps this rank's equal part of the last dimension; gradient all-gathered back."""
    if group_size(group) == 1:
        return input_
    return _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Concatenates the last dimension over `group` in rank order; gradient split back."""
    if group_size(group) == 1:
        return input_
    return _GatherFromModelParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Keeps this rank's equal part of the first (sequence) dimension; gradient all-gathered."""
    if group_size(group) == 1:
        return input_
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    group: dist.ProcessGroup | None,
    tensor_parallel_output_grad: bool = True,
) -> torch.Tensor:
    """Concatenates the first (sequence) dimension over `group` in rank order.

    Args:
        input_: This rank's part of the sequence, [s/T, ...].
        group: The tp group.
        tensor_parallel_output_grad: True when the gathered tensor feeds a tp region (each
            rank's gradient is partial: backward reduce-scatters); False when what consumes it
            is replicated over tp (backward keeps this rank's part of the gradient).

    Returns:
        The whole sequence, [s, ...].
    """
    if group_size(group) == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Sums partial results over `group` and keeps this rank's part of the first dimension;
    the gradient is all-gathered back."""
    if group_size(group) == 1:
        return input_
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)


def grad_sum_over_tp(param: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`param` itself in forward; in backward its gradient is summed over `group`.

    For a parameter replicated over tp but applied to sequence-split activations (norms,
    row-parallel biases, the router under sequence parallelism): each rank's gradient covers
    its part of the sequence only, and the sum is the gradient of the whole sequence.
    """
    if group_size(group) == 1:
        return param
    return _CopyToModelParallelRegion.apply(param, group)
