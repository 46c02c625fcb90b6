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
one program per column block. Each program finds its rows from the lengths itself (a prefix sum
of a few hundred bytes), so a call costs the host one or two launches and an allocation: laid out
by PyTorch's ops, the pieces took a dozen launches, about 0.5 ms of host time per expert bias's
gradient on an H200 host. Off CUDA, without Triton, or while `torch.compile` traces,
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
        segment = torch.searchsorted(torch.cumsum(lengths, 0), row, right=True)
        sums = x.new_zeros(count + 1, *x.shape[1:]).index_add_(0, segment, x)
        return sums[:count].to(dtype)
    rows = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # -1 fails for zero rows
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    width = rows.shape[1]
    out = torch.empty(count, width, dtype=dtype, device=x.device)
    if not out.numel():
        return out.view(count, *x.shape[1:])
    weights = row_weights if row_weights is not None else rows
    segments = segments_block(count)
    col_blocks = -(-width // _BLOCK_COLS)
    tile = dict(BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS, SEGMENTS=segments)
    if rows.shape[0] <= _PIECE_ROWS:
        _launch_segment_sum(
            (count, col_blocks), rows, lengths, weights, out, rows.stride(0), width, count,
            ROW_WEIGHTS=row_weights is not None, UNIT=1, **tile,
        )  # fmt: skip
    else:
        # Two passes, so that a long segment (an expert that got most tokens) does not leave
        # one program per column block summing it alone: pieces of at most _PIECE_ROWS rows of
        # a segment each, in fp32, then each segment's pieces, in order. Each segment has
        # ceil(length / _PIECE_ROWS) pieces, so there are at most rows / _PIECE_ROWS + segments
        # of them; the programs past the last real piece sum no rows.
        capacity = -(-rows.shape[0] // _PIECE_ROWS) + count
        partial = torch.empty(capacity, width, dtype=torch.float32, device=x.device)
        _launch_piece_sum(
            (capacity, col_blocks), rows, lengths, weights, partial, rows.stride(0), width,
            count, ROW_WEIGHTS=row_weights is not None, PIECE=_PIECE_ROWS, **tile,
        )  # fmt: skip
        _launch_segment_sum(
            (count, col_blocks), partial, lengths, partial, out, width, width, count,
            ROW_WEIGHTS=False, UNIT=_PIECE_ROWS, **tile,
        )  # fmt: skip
    return out.view(count, *x.shape[1:])


def segments_block(count: int) -> int:
    """The size of the vector of `count` segment lengths that a kernel reads (`segment_of_row`):
    a power of two, at least 16 (one compiled kernel for every layer of few experts)."""
    return max(16, 1 << (count - 1).bit_length())


if triton is not None:

    @triton.jit
    def _units(lengths_ptr, count, UNIT: tl.constexpr, SEGMENTS: tl.constexpr):
        """The segments' lengths (`SEGMENTS` entries, zeros past `count`), each cut into
        ceil(length / UNIT) units, and where each segment's units end when laid end to end.
        Every program reads them on the device: a few hundred bytes, where the host would
        launch kernels of their own to derive them."""
        index = tl.arange(0, SEGMENTS)
        lengths = tl.load(lengths_ptr + index, mask=index < count, other=0)
        units = (lengths + UNIT - 1) // UNIT
        return index, lengths, units, tl.cumsum(units, axis=0)

    @triton.jit
    def segment_of_row(lengths_ptr, count, row, SEGMENTS: tl.constexpr):
        """The segment that row `row` belongs to (`count` for rows after the segments), read
        from the `count` lengths on the device (`segments_block(count)` is `SEGMENTS`)."""
        _, _, _, row_ends = _units(lengths_ptr, count, 1, SEGMENTS)
        return tl.sum((row_ends <= row).to(tl.int32), axis=0)

    @triton.jit
    def _entry(values, index, segment):
        """`values[segment]` (0 past the vector)."""
        return tl.sum(tl.where(index == segment, values, 0), axis=0)

    @triton.jit
    def _sum_rows(
        x_ptr, weights_ptr, out_ptr, start, end, col, row_stride, width,
        ROW_WEIGHTS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):  # fmt: skip
        """Stores at `out_ptr` the sum of columns `col` over rows [start, end) (each times its
        weight with ROW_WEIGHTS), BLOCK_ROWS rows at a time, in fp32."""
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
        tl.store(out_ptr + col, acc.to(out_ptr.dtype.element_ty), mask=col < width)

    @triton.jit
    def _segment_sum_kernel(
        x_ptr, lengths_ptr, weights_ptr, out_ptr, row_stride, width, count,
        ROW_WEIGHTS: tl.constexpr, UNIT: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr, SEGMENTS: tl.constexpr,
    ):  # fmt: skip
        """Program (segment, block): the sum of columns [block * BLOCK_COLS, ...) over the
        segment's rows of `x`, each segment being ceil(length / UNIT) rows (UNIT 1: the
        segments themselves; the pieces' size: the first pass's partial sums)."""
        segment = tl.program_id(0)
        col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        index, _, units, unit_ends = _units(lengths_ptr, count, UNIT, SEGMENTS)
        end = _entry(unit_ends, index, segment)
        start = end - _entry(units, index, segment)
        _sum_rows(
            x_ptr, weights_ptr, out_ptr + segment.to(tl.int64) * width, start, end, col,
            row_stride, width, ROW_WEIGHTS, BLOCK_ROWS, BLOCK_COLS,
        )  # fmt: skip

    @triton.jit
    def _piece_sum_kernel(
        x_ptr, lengths_ptr, weights_ptr, out_ptr, row_stride, width, count,
        ROW_WEIGHTS: tl.constexpr, PIECE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr, SEGMENTS: tl.constexpr,
    ):  # fmt: skip
        """Program (piece, block): piece k of a segment is its rows [k * PIECE, (k + 1) *
        PIECE), the pieces of all segments in order; past the last one, no rows (zeros)."""
        piece = tl.program_id(0)
        col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        index, lengths, pieces, piece_ends = _units(lengths_ptr, count, PIECE, SEGMENTS)
        segment = tl.sum((piece_ends <= piece).to(tl.int32), axis=0)  # count past the last
        first_piece = _entry(piece_ends - pieces, index, segment)
        length = _entry(lengths, index, segment)
        first_row = _entry(tl.cumsum(lengths, axis=0) - lengths, index, segment)
        start = first_row + (piece - first_piece) * PIECE
        end = tl.minimum(start + PIECE, first_row + length)
        end = tl.where(segment < count, end, start)
        _sum_rows(
            x_ptr, weights_ptr, out_ptr + piece.to(tl.int64) * width, start, end, col,
            row_stride, width, ROW_WEIGHTS, BLOCK_ROWS, BLOCK_COLS,
        )  # fmt: skip

    _launch_segment_sum = TritonLaunch(_segment_sum_kernel, num_warps=_WARPS)
    _launch_piece_sum = TritonLaunch(_piece_sum_kernel, num_warps=_WARPS)
