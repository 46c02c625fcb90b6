"""Blockwise FP8 casts on CUDA, one pass each (the quantisers of `megatron.core.fp8.blockwise`).

`cast_1x128` reads each 128 x 128 tile of an activation or output gradient once and writes,
from it, the row-major FP8 copy with one scale per 1x128 block of each row, and the transposed
copy (the weight gradient's operand) with one scale per 128 rows of each column, both scales in
the layouts the blockwise GEMM takes. `cast_128x128` writes a weight's FP8 bytes and one scale
per 128 x 128 tile. Neither needs a pass before the cast: each block's absolute maximum is
taken from the tile in registers.

The results are those of the torch ops of `blockwise.py` bit for bit: the absolute maximum
skips NaNs, the scale is current scaling's (`kernels._scale_from`, a correctly rounded
division) with its mantissa bits cleared, its inverse is exact (a power of 2 made from the
negated exponent: no division, which could flush the subnormal 2^-127), and values are
`fp8(clamp(x * scale, -max, max))` with the product in fp32.

Triton ships with PyTorch's CUDA builds; without it, or off CUDA, the torch ops run.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.quantize import round_up
from megatron.core.fp8.recipe import fp8_max
from megatron.core.fusions.triton_launch import TritonLaunch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds
    triton = None

BLOCK = 128
_WARPS = 8
"""A 128 x 128 fp32 tile is 64 registers a thread over 8 warps."""


def cast_1x128(
    x: torch.Tensor, dtype: torch.dtype, *, rowwise: bool, transpose: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`x` cast to FP8 in 1x128 blocks, in one pass.

    Args:
        x: `[rows, cols]` on CUDA (`kernels.kernels_available`).
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
        rowwise: make the row-major copy and its scales.
        transpose: make the transposed copy, `[cols, round_up(rows, 128)]` with zero columns
            beyond `rows`, and its scales.

    Returns:
        (the row-major copy, its `scale_inv` `[rows, ceil(cols / 128)]` column-major, the
        transposed copy, its `scale_inv` `[cols, round_up(rows, 128) / 128]` column-major),
        None for a copy not asked for.
    """
    rows, cols = x.shape
    x = x.contiguous()
    # Plain integer arithmetic, as `kernels.cast_to_fp8`: `triton.cdiv` costs host time.
    padded_rows, col_blocks = round_up(rows, BLOCK), -(-cols // BLOCK)
    device = x.device
    data = scales = transposed = transposed_scales = None
    if rowwise:
        data = torch.empty(rows, cols, dtype=dtype, device=device)
        scales = torch.empty(col_blocks, rows, dtype=torch.float32, device=device)
    if transpose:
        transposed = torch.empty(cols, padded_rows, dtype=dtype, device=device)
        transposed_scales = torch.empty(
            padded_rows // BLOCK, cols, dtype=torch.float32, device=device
        )
    if x.numel():
        unused = x  # a pointer argument whose flag is off: never written
        _launch_1x128(
            (padded_rows // BLOCK, col_blocks),
            x,
            data if rowwise else unused,
            scales if rowwise else unused,
            transposed if transpose else unused,
            transposed_scales if transpose else unused,
            rows,
            cols,
            padded_rows,
            fp8_max(dtype),
            ROWWISE=rowwise,
            TRANSPOSE=transpose,
            E4M3=dtype == torch.float8_e4m3fn,
            BLOCK=BLOCK,
        )
    if transpose:
        transposed_scales = transposed_scales.t()
    return data, None if scales is None else scales.t(), transposed, transposed_scales


def cast_128x128(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` cast to FP8 in 128x128 blocks, in one pass.

    Args:
        x: `[rows, cols]` on CUDA (`kernels.kernels_available`).
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.

    Returns:
        (the FP8 copy, row-major; its `scale_inv` `[ceil(rows / 128), ceil(cols / 128)]`, the
        view of a row-major tensor whose rows are padded with zeros to a multiple of 4).
    """
    rows, cols = x.shape
    x = x.contiguous()
    row_blocks, col_blocks = -(-rows // BLOCK), -(-cols // BLOCK)
    data = torch.empty(rows, cols, dtype=dtype, device=x.device)
    padded_blocks = round_up(col_blocks, 4)
    scales = torch.zeros(row_blocks, padded_blocks, dtype=torch.float32, device=x.device)
    if x.numel():
        _launch_128x128(
            (row_blocks, col_blocks),
            x,
            data,
            scales,
            rows,
            cols,
            padded_blocks,
            fp8_max(dtype),
            E4M3=dtype == torch.float8_e4m3fn,
            BLOCK=BLOCK,
        )
    return data, scales[:, :col_blocks]


if triton is not None:
    from megatron.core.fp8.kernels import _scale_from, _to_fp8

    @triton.jit
    def _power_of_2_scale(amax, limit):
        """`_scale_from(amax, limit)` with its mantissa bits cleared."""
        bits = _scale_from(amax, limit).to(tl.int32, bitcast=True) & 0x7F800000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _power_of_2_inverse(scale):
        """`1 / scale` for a power of 2 at most 2^127: the negated exponent (2^-127, the
        inverse of 2^127, is subnormal)."""
        exponent = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
        bits = tl.where(exponent < 254, (254 - exponent) << 23, 0x00400000)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _magnitude(values):
        """`|values|` with NaNs as 0 (the absolute maximum skips them)."""
        magnitude = tl.abs(values)
        return tl.where(magnitude == magnitude, magnitude, 0.0)

    @triton.jit
    def _scaled(values, scale, limit):
        return tl.clamp(values * scale, -limit, limit, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _cast_1x128_kernel(
        x_ptr,
        out_ptr,
        scale_inv_ptr,
        out_t_ptr,
        scale_inv_t_ptr,
        rows,
        cols,
        padded_rows,
        limit,
        ROWWISE: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        E4M3: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (i, j) casts rows i*BLOCK.. and columns j*BLOCK..; 64-bit offsets, as tensors
        # of 2**31 elements and more exist.
        row_block, col_block = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        if ROWWISE:
            row = row_block * BLOCK + offsets[:, None]
            col = col_block * BLOCK + offsets[None, :]
            inside = (row < rows) & (col < cols)
            values = tl.load(x_ptr + row * cols + col, mask=inside, other=0.0).to(tl.float32)
            scale = _power_of_2_scale(tl.max(_magnitude(values), axis=1), limit)
            scaled = _scaled(values, scale[:, None], limit)
            tl.store(out_ptr + row * cols + col, _to_fp8(scaled, E4M3), mask=inside)
            # The scales `[col_blocks, rows]` row-major: `[rows, col_blocks]` column-major.
            row_of_block = row_block * BLOCK + offsets
            tl.store(
                scale_inv_ptr + col_block * rows + row_of_block,
                _power_of_2_inverse(scale),
                mask=row_of_block < rows,
            )
        if TRANSPOSE:
            # The tile again, indexed in the transposed order (from L2: it was just read), so
            # that each row of the register tile is a column of `x`, and the store to the
            # transposed copy is coalesced. Rows beyond `rows` load as 0: their bytes are zero.
            col_t = col_block * BLOCK + offsets[:, None]
            row_t = row_block * BLOCK + offsets[None, :]
            inside_t = (row_t < rows) & (col_t < cols)
            values_t = tl.load(x_ptr + row_t * cols + col_t, mask=inside_t, other=0.0)
            values_t = values_t.to(tl.float32)
            scale_t = _power_of_2_scale(tl.max(_magnitude(values_t), axis=1), limit)
            scaled_t = _scaled(values_t, scale_t[:, None], limit)
            tl.store(
                out_t_ptr + col_t * padded_rows + row_t,
                _to_fp8(scaled_t, E4M3),
                mask=col_t < cols,
            )
            col_of_block = col_block * BLOCK + offsets
            tl.store(
                scale_inv_t_ptr + row_block * cols + col_of_block,
                _power_of_2_inverse(scale_t),
                mask=col_of_block < cols,
            )

    @triton.jit
    def _cast_128x128_kernel(
        x_ptr,
        out_ptr,
        scale_inv_ptr,
        rows,
        cols,
        scale_row_stride,
        limit,
        E4M3: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row_block, col_block = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        row = row_block * BLOCK + tl.arange(0, BLOCK)[:, None]
        col = col_block * BLOCK + tl.arange(0, BLOCK)[None, :]
        inside = (row < rows) & (col < cols)
        values = tl.load(x_ptr + row * cols + col, mask=inside, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(_magnitude(values), axis=1), axis=0)
        scale = _power_of_2_scale(amax, limit)
        tl.store(
            out_ptr + row * cols + col,
            _to_fp8(_scaled(values, scale, limit), E4M3),
            mask=inside,
        )
        tl.store(
            scale_inv_ptr + row_block * scale_row_stride + col_block, _power_of_2_inverse(scale)
        )

    _launch_1x128 = TritonLaunch(_cast_1x128_kernel, num_warps=_WARPS)
    _launch_128x128 = TritonLaunch(_cast_128x128_kernel, num_warps=_WARPS)
