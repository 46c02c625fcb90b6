"""Differentiable communication at the borders of tensor-parallel (tp) and sequence-parallel
regions, with Megatron-core's names.

Each function takes the tp group explicitly; a group of None or of size 1 makes it the identity
(forward and backward), so the same layer code runs with and without tensor parallelism.

- tp regions split the hidden (last) dimension: `copy_to_...` (forward identity, backward
  all-reduce), `reduce_from_...` (forward all-reduce, backward identity), `scatter_to_...` /
  `gather_from_tensor_model_parallel_region` (split / all-gather the last dimension).
- sequence-parallel regions split the sequence (first) dimension: `scatter_to_...` /
  `gather_from_sequence_parallel_region` and `reduce_scatter_to_sequence_parallel_region`.
  These two also take the part of each rank when the parts differ in size
  (`output_split_sizes` / `input_split_sizes`, as in Megatron-core): the MoE all-to-all
  dispatcher gathers and reduce-scatters the tokens it received over the expert tensor-parallel
  group that way.
- `grad_sum_over_tp(param, group)`: a replicated parameter used on sequence-split activations
  gets a partial gradient on each tp rank; routing it through this sums the gradient over tp
  in backward, so no engine needs to know about sequence parallelism.

Works with gloo (CPU) and NCCL: both implement the tensor all-gather / reduce-scatter used for
equal parts; parts of different sizes travel by point-to-point sends (gathered) and
`all_to_all_single` (reduce-scattered), which both implement too.
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


def _gather_first(
    x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int] | None = None
) -> torch.Tensor:
    """All-gather of `x` along dim 0 over `group`: equal parts, or `sizes[r]` rows from rank r."""
    if sizes is None:
        out, work = gather_first_async(x, group)
        work.wait()
        return out
    out = x.new_empty((sum(sizes), *x.shape[1:]))
    parts = out.split(list(sizes))
    me = group_rank(group)
    x = x.contiguous()
    # gloo all-gathers equal parts only, and an all-to-all would need a copy of `x` per rank: `x`
    # itself is sent to every peer, and the peers' parts are received in place.
    ops = []
    for rank, part in enumerate(parts):
        if rank == me:
            continue
        peer = dist.get_global_rank(group, rank)
        # Both ends know the sizes, so both skip the same empty transfers.
        if x.numel():
            ops.append(dist.P2POp(dist.isend, x, peer, group))
        if part.numel():
            ops.append(dist.P2POp(dist.irecv, part, peer, group))
    parts[me].copy_(x)
    # Only when every part is empty has a rank nothing to exchange (then none has).
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return out


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # Gathering moves the last dim to the front, where the collective concatenates.
    gathered = _gather_first(x.movedim(-1, 0), group)
    return gathered.movedim(0, -1).contiguous()


def _split_first(
    x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int] | None = None
) -> torch.Tensor:
    start, rows = _part_first(x, group, sizes)
    return x.narrow(0, start, rows).contiguous()


def all_to_all_first(
    x: torch.Tensor, group: dist.ProcessGroup, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """`all_to_all_single` of `x` along dim 0 over `group` (not differentiable):
    `input_splits[r]` rows go to rank r, `output_splits[r]` rows come from it."""
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def reduce_scatter_first_async(
    x: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, dist.Work]:
    """Starts the sum over `group` of `x`, scattered along dim 0; the output is valid once the
    returned work is waited for."""
    out = x.new_empty((_rows_per_rank(x, group_size(group)), *x.shape[1:]))
    return out, reduce_scatter_single(out, x.contiguous(), group=group, async_op=True)


def _reduce_scatter_first(
    x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int] | None = None
) -> torch.Tensor:
    """Sum over `group` of `x`, scattered along dim 0: equal parts, or `sizes[r]` rows to rank
    r, those summed in fp32 (or `x`'s wider type) and returned in `x`'s dtype."""
    if sizes is None:
        out, work = reduce_scatter_first_async(x, group)
        work.wait()
        return out
    # Every rank receives the addends of its part and sums them itself: a reduce-scatter would
    # sum bf16 expert outputs in bf16. The sum widens each addend as it reads it (no fp32 copy).
    ranks, mine = group_size(group), sizes[group_rank(group)]
    addends = all_to_all_first(x, group, [mine] * ranks, list(sizes))
    wide = torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else x.dtype
    return addends.view(ranks, mine, *x.shape[1:]).sum(dim=0, dtype=wide).to(x.dtype)


def _rows_per_rank(x: torch.Tensor, size: int) -> int:
    if x.shape[0] % size != 0:
        raise ValueError(
            f"the first (sequence) dimension, {x.shape[0]}, is not divisible by the "
            f"tensor-parallel size {size}; sequence parallelism needs a sequence length that is "
            "a multiple of tensor_model_parallel_size."
        )
    return x.shape[0] // size


def _part_first(
    x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int] | None
) -> tuple[int, int]:
    """`(first row, rows)` of this rank's part of `x`'s dim 0: equal parts, or `sizes`."""
    rank = group_rank(group)
    if sizes is None:
        rows = _rows_per_rank(x, group_size(group))
        return rank * rows, rows
    return sum(sizes[:rank]), sizes[rank]


def _check_split_sizes(
    name: str, sizes: list[int], group: dist.ProcessGroup | None, rows: int, whole: bool
) -> None:
    """Raises ValueError unless `sizes` holds one part per rank of `group` matching `rows`, the
    input's first dimension: the sum of the parts when `whole`, else this rank's part."""
    ranks, rank = group_size(group), group_rank(group)
    if len(sizes) != ranks or min(sizes) < 0:
        raise ValueError(
            f"{name}={list(sizes)} must hold one row count (>= 0) per rank of the group, which "
            f"has {ranks}; pass the parts' sizes in rank order, the same list on every rank."
        )
    expected, what = (sum(sizes), f"sum({name})") if whole else (sizes[rank], f"{name}[{rank}]")
    if rows != expected:
        raise ValueError(
            f"the input has {rows} rows along dim 0 but {what} is {expected}; pass the sizes of "
            "the parts the ranks hold, the same list on every rank."
        )


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
    """All-gathers the first dimension (equal parts, or `sizes[r]` rows from rank r); backward
    reduce-scatters the same parts (the consumer is a tp region, whose ranks each hold a
    partial gradient) or only splits (the consumer is replicated)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        group: dist.ProcessGroup | None,
        tensor_parallel_output_grad: bool,
        sizes: list[int] | None,
    ) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first(x, group, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad, ctx.group, ctx.sizes), None, None, None
        return _split_first(grad, ctx.group, ctx.sizes), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatters (sums) the first dimension (equal parts, or `sizes[r]` rows to rank r);
    backward all-gathers the same parts."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, group: dist.ProcessGroup | None, sizes: list[int] | None
    ) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_first(x, group, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_first(grad, ctx.group, ctx.sizes), None, None


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
    output_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Concatenates the first (sequence) dimension over `group` in rank order.

    Args:
        input_: This rank's part of the sequence, [s/T, ...] (`output_split_sizes[rank]` rows
            when given).
        group: The tp group.
        tensor_parallel_output_grad: True when the gathered tensor feeds a tp region (each
            rank's gradient is partial: backward reduce-scatters, summing the parts of different
            sizes in fp32); False when what consumes it is replicated over tp (backward keeps
            this rank's part of the gradient).
        output_split_sizes: The rows of every rank's part, in rank order, the same list on
            every rank; None: the parts are equal.

    Returns:
        The whole sequence, [s, ...] (`sum(output_split_sizes)` rows when given).

    Raises:
        ValueError: `output_split_sizes` has not one entry per rank, or not `input_`'s rows at
            this rank's.
    """
    if output_split_sizes is not None:
        _check_split_sizes(
            "output_split_sizes", output_split_sizes, group, input_.shape[0], whole=False
        )
    if group_size(group) == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(
        input_, group, tensor_parallel_output_grad, output_split_sizes
    )


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group: dist.ProcessGroup | None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Sums partial results over `group` and keeps this rank's part of the first dimension;
    the gradient is all-gathered back.

    Args:
        input_: This rank's addend of the whole, [s, ...].
        group: The tp group.
        input_split_sizes: The rows of every rank's part, in rank order (summing to s), the
            same list on every rank; None: equal parts. With sizes the sum is taken in fp32 (or
            `input_`'s wider type), whatever `input_`'s dtype.

    Returns:
        This rank's part of the sum, [s/T, ...] (`input_split_sizes[rank]` rows when given), in
        `input_`'s dtype.

    Raises:
        ValueError: `input_split_sizes` has not one entry per rank, or does not sum to
            `input_`'s rows.
    """
    if input_split_sizes is not None:
        _check_split_sizes(
            "input_split_sizes", input_split_sizes, group, input_.shape[0], whole=True
        )
    if group_size(group) == 1:
        return input_
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group, input_split_sizes)


def grad_sum_over_tp(param: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`param` itself in forward; in backward its gradient is summed over `group`.

    For a parameter replicated over tp but applied to sequence-split activations (norms,
    row-parallel biases, the router under sequence parallelism): each rank's gradient covers
    its part of the sequence only, and the sum is the gradient of the whole sequence.
    """
    if group_size(group) == 1:
        return param
    return _CopyToModelParallelRegion.apply(param, group)
