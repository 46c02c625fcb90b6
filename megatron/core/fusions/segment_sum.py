"""Sums of consecutive row segments, `torch.segment_reduce(x, "sum", lengths=lengths)`, without a
host read: the gradient of a table whose rows were repeated (an MoE expert's bias, repeated over
its tokens' rows).

`repeat_interleave`'s own backward (`index_add`) adds every row into its table row with atomic
adds on CUDA, in the rows' dtype and in no fixed order; many rows meet in few table rows, so the
adds contend (0.6 ms per MoE expert bias of the MoE benchmark's layers on an H100).
`torch.segment_reduce` sums each segment in order, but on CUDA reads the lengths on the host,
which breaks CUDA-graph capture and the dropless MoE layers' promise of no host synchronisation.
The Triton kernel here sums each segment's rows in a fixed order in fp32, reading the lengths on
the device; inputs of more than 256 rows are summed in pieces of at most 256 rows of a segment
first, then each segment's pieces, so that an expert given most rows does not leave its sum to
one program per column block. Off CUDA, without Triton, or while `torch.compile` traces,
`index_add` runs, as `repeat_interleave`'s backward.
"""

from __future__ import annotations

import math

import torch

from megatron.core.fusions.triton_launch import TritonLaunch, launches_on

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds
    triton = None

_PIECE_ROWS = 256
"""Rows one program sums at most in the first of two passes (inputs of more rows)."""
_BLOCK_ROWS = 32
_BLOCK_COLS = 64
_WARPS = 2
"""The tile and warps: the fastest of tiles of 8 to 64 rows and 64 to 512 columns with 2, 4 or 8
warps on an H100 (Triton 3.6) for one pass over the MoE benchmark's fc1 bias gradient with
balanced experts (16,384 bf16 rows of 11,264 in 9 segments: 142 us, 2.6 TB/s, against 271 us for
32 x 128 with 4 warps and 1,449 us for `index_add`); within 40% of the best for its fc2 bias
(width 2,048: 82 us against 60)."""


def segment_sum(
    x: torch.Tensor,
    lengths: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The sums of `x`'s consecutive row segments (each row times its weight where given).

    Args:
        x: [rows, ...], floating.
        lengths: [segments] int64 row counts on `x`'s device, summing to at most `rows` (not
            checked: that would read them on the host); the rows after them are not summed.
        row_weights: one factor per row, or None.
        dtype: the sums' dtype; None: `x`'s.

    Returns:
        [segments, ...]; by the kernel summed in fp32 and rounded once (the products too).
    """
    count = lengths.shape[0]
    dtype = x.dtype if dtype is None else dtype
    if row_weights is not None:
        row_weights = row_weights.reshape(-1).contiguous()  # the kernel reads them in a row
    if not launches_on(x):
        if row_weights is not None:
            x = (x * row_weights.view(-1, *[1] * (x.dim() - 1))).to(x.dtype)
        # The rows after the segments go to an extra sum, dropped.
        row = torch.arange(x.shape[0], device=x.device)
        segment_of_row = torch.searchsorted(torch.cumsum(lengths, 0), row, right=True)
        sums = x.new_zeros(count + 1, *x.shape[1:]).index_add_(0, segment_of_row, x)
        return sums[:count].to(dtype)
    rows = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # -1 fails for zero rows
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    if rows.shape[0] <= _PIECE_ROWS or count == 0:
        out = _sum_segments(rows, lengths, row_weights, dtype)
    else:
        # Two passes, so that a long segment (an expert that got most tokens) does not leave
        # one program per column block summing it alone: pieces of at most _PIECE_ROWS rows of
        # a segment each, in fp32, then each segment's pieces, in order.
        pieces, per_segment = _pieces(lengths, rows.shape[0])
        partial = _sum_segments(rows, pieces, row_weights, torch.float32)
        out = _sum_segments(partial, per_segment, None, dtype)
    return out.view(count, *x.shape[1:])


def _pieces(lengths: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The segments cut into consecutive pieces of at most `_PIECE_ROWS` rows, on the device:
    `(piece lengths [P], pieces per segment [segments])`, P fixed by `num_rows` (pieces past
    the last real one have length 0)."""
    per_segment = (lengths + _PIECE_ROWS - 1) // _PIECE_ROWS
    ends = torch.cumsum(per_segment, 0)
    capacity = -(-num_rows // _PIECE_ROWS) + lengths.shape[0]
    piece = torch.arange(capacity, device=lengths.device)
    segment = torch.searchsorted(ends, piece, right=True).clamp_(max=lengths.shape[0] - 1)
    rank_in_segment = piece - (ends - per_segment)[segment]
    left = lengths[segment] - rank_in_segment * _PIECE_ROWS
    return left.clamp_(min=0, max=_PIECE_ROWS), per_segment


def _sum_segments(
    rows: torch.Tensor,
    lengths: torch.Tensor,
    row_weights: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One launch: each segment of `rows` (2-D, unit column stride) summed by the programs of
    its column blocks, into a new [segments, width] tensor of `dtype`."""
    count, width = lengths.shape[0], rows.shape[1]
    out = torch.empty(count, width, dtype=dtype, device=rows.device)
    if out.numel():
        starts = torch.cumsum(lengths, 0) - lengths
        _launch_segment_sum(
            (count, -(-width // _BLOCK_COLS)),
            rows, starts, lengths, row_weights if row_weights is not None else rows, out,
            rows.stride(0), width,
            ROW_WEIGHTS=row_weights is not None, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS,
        )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _segment_sum_kernel(
        x_ptr, starts_ptr, lengths_ptr, weights_ptr, out_ptr, row_stride, width,
        ROW_WEIGHTS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):  # fmt: skip
        """Program (segment, block): the sum of columns [block * BLOCK_COLS, ...) over the
        segment's rows (each times its weight with ROW_WEIGHTS), BLOCK_ROWS rows at a time."""
        segment = tl.program_id(0)
        col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        start = tl.load(starts_ptr + segment)
        end = start + tl.load(lengths_ptr + segment)
        acc = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
        for first in range(start, end, BLOCK_ROWS):
            row = first + tl.arange(0, BLOCK_ROWS)
            inside = (row < end)[:, None] & (col < width)[None, :]
            offsets = row.to(tl.int64)[:, None] * row_stride + col[None, :]
            tile = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            if ROW_WEIGHTS:
                weight = tl.load(weights_ptr + row, mask=row < end, other=0.0)
                tile = tile * weight.to(tl.float32)[:, None]
            acc += tl.sum(tile, axis=0)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + segment.to(tl.int64) * width + col, acc.to(dtype), mask=col < width)

    _launch_segment_sum = TritonLaunch(_segment_sum_kernel, num_warps=_WARPS)
