"""Blockwise quantisation to FP8: DeepSeek-V3's block scaling, Transformer Engine's
`Float8BlockScaling` recipe with its defaults (`--fp8-recipe blockwise`).

- Activations and output gradients have one scale per 1x128 block: 128 consecutive elements of
  a row, along the contraction dimension of the GEMM that uses them (`quantize_1x128`). The
  weight-gradient GEMM contracts over the tokens instead, so its copy is the tensor transposed
  and quantised again from the high-precision values, in 1x128 blocks along the tokens (the
  transposed bytes of the first copy would have 128x1 blocks; Transformer Engine does the same).
- Weights have one scale per 128x128 block (`quantize_128x128`); their transpose has the same
  blocks, so the input-gradient GEMM transposes the bytes and the scales.

A block's scale is Transformer Engine's default for the recipe: `compute_scale` of the block's
absolute maximum (`fp8_max / amax`, 1 for an amax of 0, inf or NaN, the largest fp32 where the
quotient overflows) rounded down to a power of 2 (its mantissa bits cleared: TE's
`force_pow_2_scales`, no epsilon). The scale never exceeds `fp8_max / amax`, so only infinities
saturate, and dequantising multiplies by a power of 2, exactly. As in the per-tensor casts
(`quantize.py`), the amax skips NaNs and values are cast as `fp8(clamp(x * scale, -max, max))`
with the product in fp32: a NaN stays NaN, an infinity becomes +-max. No scale is reduced over
ranks: each is local to its block.

A dimension that is not a multiple of 128 ends in a partial block, scaled as if zero-padded (a
zero changes no amax); the transposed copy is padded with zero columns to a multiple of 128
tokens, so the weight-gradient GEMM contracts over whole blocks.

The scales are laid out as torch's blockwise GEMM takes them (`gemm.py`), so that it copies
none:

- 1x128 `[rows, cols]`: `scale_inv` `[rows, ceil(cols / 128)]` column-major (strides
  `(1, rows)`), and so is the transposed copy's;
- 128x128 `[rows, cols]`: `[ceil(rows / 128), ceil(cols / 128)]` row-major, the view of a
  tensor whose rows are padded to a multiple of 4 scales (16 bytes).

On CUDA each cast is one Triton kernel (`block_kernels.py`); elsewhere the torch ops here run,
and the two agree bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fp8 import block_kernels, kernels
from megatron.core.fp8.quantize import cast_to_fp8, compute_scale, round_up
from megatron.core.fp8.recipe import fp8_max
from megatron.core.fp8.tensor import BlockFp8Tensor

BLOCK = 128
ROW_BLOCK = (1, BLOCK)
"""Activations' and output gradients' blocks."""
SQUARE_BLOCK = (BLOCK, BLOCK)
"""Weights' blocks."""

_EXPONENT_BITS = 0x7F800000
"""An fp32's exponent bits: a positive fp32 with only these kept is the power of 2 at or below
it."""


def power_of_2_scale(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """`compute_scale(amax, max_value)` rounded down to a power of 2 (Transformer Engine's
    `compute_scale_from_amax` with `force_pow_2_scales`): one scale per element of `amax`."""
    scale = compute_scale(amax, max_value)
    return (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`max |x|` of each block of `x` (`[rows, cols]`), fp32 `[ceil(rows / block[0]),
    ceil(cols / block[1])]`; NaNs skipped, partial blocks zero-padded."""
    padded = _padded(x, block)
    rows, cols = padded.shape
    magnitude = padded.abs().nan_to_num(nan=0.0, posinf=float("inf"))
    blocks = magnitude.view(rows // block[0], block[0], cols // block[1], block[1])
    return blocks.amax(dim=(1, 3)).float()


def quantize_1x128(
    x: torch.Tensor, dtype: torch.dtype, *, transpose: bool = False
) -> BlockFp8Tensor:
    """`x` (2-D) in FP8 with one scale per 1x128 block, and its transposed copy when asked
    (module docstring).

    Args:
        x: `[rows, cols]`, any floating dtype.
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
        transpose: also make `transposed` (`quantize_1x128_transposed`'s tensor).
    """
    if kernels.kernels_available(x):
        data, scale_inv, transposed, transposed_scale_inv = block_kernels.cast_1x128(
            x, dtype, rowwise=True, transpose=transpose
        )
        return BlockFp8Tensor(data, scale_inv, ROW_BLOCK, transposed, transposed_scale_inv)
    data, scale_inv = _quantize_reference(x, dtype, ROW_BLOCK)
    quantized = BlockFp8Tensor(data, row_block_layout(scale_inv), ROW_BLOCK)
    if not transpose:
        return quantized
    transposed = _quantize_transposed_reference(x, dtype)
    return quantized._replace(transposed=transposed.data, transposed_scale_inv=transposed.scale_inv)


def quantize_1x128_transposed(x: torch.Tensor, dtype: torch.dtype) -> BlockFp8Tensor:
    """`x` (`[rows, cols]`) transposed and quantised in 1x128 blocks along the rows: `[cols,
    round_up(rows, 128)]`, zero beyond `rows` (the copy the weight-gradient GEMM contracts over
    the tokens with), without the row-major copy."""
    if kernels.kernels_available(x):
        _, _, transposed, scale_inv = block_kernels.cast_1x128(
            x, dtype, rowwise=False, transpose=True
        )
        return BlockFp8Tensor(transposed, scale_inv, ROW_BLOCK)
    return _quantize_transposed_reference(x, dtype)


def quantize_128x128(x: torch.Tensor, dtype: torch.dtype) -> BlockFp8Tensor:
    """`x` (2-D, a weight) in FP8 with one scale per 128x128 block (module docstring)."""
    if kernels.kernels_available(x):
        data, scale_inv = block_kernels.cast_128x128(x, dtype)
        return BlockFp8Tensor(data, scale_inv, SQUARE_BLOCK)
    data, scale_inv = _quantize_reference(x, dtype, SQUARE_BLOCK)
    return BlockFp8Tensor(data, square_block_layout(scale_inv), SQUARE_BLOCK)


def row_block_layout(scale: torch.Tensor) -> torch.Tensor:
    """The values of `scale` (2-D) column-major: the layout of 1x128 scales."""
    return scale.t().contiguous().t()


def square_block_layout(scale: torch.Tensor) -> torch.Tensor:
    """The values of `scale` (`[rows, cols]`) as the view of a row-major `[rows, round_up(cols,
    4)]` tensor, zero beyond `cols`: the layout of 128x128 scales."""
    rows, cols = scale.shape
    padded = scale.new_zeros(rows, round_up(cols, 4))
    padded[:, :cols] = scale
    return padded[:, :cols]


def _padded(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`x` with zero rows and columns up to whole blocks, contiguous."""
    rows, cols = x.shape
    pad_rows, pad_cols = round_up(rows, block[0]) - rows, round_up(cols, block[1]) - cols
    return F.pad(x, (0, pad_cols, 0, pad_rows)).contiguous()


def _quantize_reference(
    x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the FP8 values of `x`, contiguous, `x`'s shape; their block scales' inverses,
    contiguous)."""
    rows, cols = x.shape
    scale = power_of_2_scale(block_amax(x, block), fp8_max(dtype))
    padded = _padded(x, block)
    blocks = padded.view(scale.shape[0], block[0], scale.shape[1], block[1])
    data = cast_to_fp8(blocks, scale[:, None, :, None], dtype).view(padded.shape)
    return data[:rows, :cols].contiguous(), scale.reciprocal()


def _quantize_transposed_reference(x: torch.Tensor, dtype: torch.dtype) -> BlockFp8Tensor:
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, round_up(rows, BLOCK) - rows))
    data, scale_inv = _quantize_reference(padded.t(), dtype, ROW_BLOCK)
    return BlockFp8Tensor(data, row_block_layout(scale_inv), ROW_BLOCK)
