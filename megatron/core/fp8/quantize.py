"""Quantisation to FP8 with one scale per tensor.

`quantize` is the one entry point of the linear layers. On CUDA it runs the fused kernels of
`kernels.py` (one pass that casts, records the absolute maximum and writes the transposed copy),
elsewhere the reference quantisers here, written in torch ops: the results are the same bit for
bit. The absolute maximum skips NaNs (Transformer Engine's `fmaxf`); the cast keeps them NaN.

Conventions (Transformer Engine's): `q = fp8(clamp(x * scale, -max, max))`, dequantised as
`q * scale_inv` with `scale_inv = 1 / scale`. The product is taken in fp32 (`x.float() * scale`:
a bf16 tensor times a 0-d fp32 tensor would stay bf16), and the clamp comes before the cast
because casts differ in saturation: CUDA torch 2.11 turns an E4M3 overflow into NaN, CPU torch
2.13 saturates it.
"""

from __future__ import annotations

import torch

from megatron.core.fp8 import kernels
from megatron.core.fp8.recipe import fp8_max
from megatron.core.fp8.tensor import Fp8Tensor

FLT_MAX = torch.finfo(torch.float32).max

GEMM_ALIGNMENT = 16
"""Hopper's FP8 GEMMs need the contraction dimension and the output width in multiples of 16."""


def round_up(size: int, multiple: int = GEMM_ALIGNMENT) -> int:
    """`size` rounded up to a multiple of `multiple`."""
    return -(-size // multiple) * multiple


def compute_scale(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """The current-scaling scale `max_value / amax` (Transformer Engine's
    `compute_scale_from_amax`, no epsilon, no power-of-2 rounding): 1 where `amax` is 0, inf or
    NaN, and the largest fp32 where the quotient overflows.

    Args:
        amax: the absolute maximum, fp32 (any shape: one scale per element).
        max_value: the FP8 dtype's largest value (`fp8_max`).
    """
    # A true fp32 division, as the CUDA kernels' `__fdiv_rn` (`max_value / amax` with a Python
    # number on the left multiplies by the reciprocal instead, rounding twice).
    scale = torch.full_like(amax, max_value) / amax
    scale = torch.where(torch.isinf(scale), FLT_MAX, scale)
    return torch.where((amax == 0) | ~torch.isfinite(amax), 1.0, scale)


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """`max |x|` as a 0-d fp32 tensor, NaNs skipped (Transformer Engine's `fmaxf`: one NaN does
    not make the scale, or a delayed history, non-finite); 0 for an empty tensor."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return _magnitudes(x).amax().float()


def _magnitudes(x: torch.Tensor) -> torch.Tensor:
    """`|x|` with NaNs as 0 (infinities kept): what every amax here is the maximum of."""
    return x.abs().nan_to_num(nan=0.0, posinf=float("inf"))


def record_amax(x: torch.Tensor, amax_out: torch.Tensor) -> None:
    """Max-es `max |x|` (NaNs skipped, as `amax_of`) into `amax_out`, fp32 with one element, or
    `k` elements for `x` in `k` equal consecutive segments of its elements (each expert of
    stacked expert weights `[k, out, in]`), segment `i` into `amax_out[i]`: on CUDA in one
    kernel."""
    segments = amax_out.numel()
    if not segments or x.numel() % segments:
        raise ValueError(
            f"record_amax: {x.numel()} elements do not split into {segments} equal segments, "
            "one per amax slot."
        )
    if kernels.amax_kernel_available(x, amax_out):
        kernels.record_amax(x, amax_out)
    elif x.numel():
        amaxes = _magnitudes(x.reshape(segments, -1)).amax(1).float()
        torch.maximum(amax_out, amaxes.view_as(amax_out), out=amax_out)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`fp8(clamp(x * scale, -max, max))` of `dtype`, the product in fp32."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp_(-limit, limit).to(dtype)


def transpose_padded(data: torch.Tensor) -> torch.Tensor:
    """`data` (FP8, `[rows, cols]`) transposed into a new row-major `[cols, round_up(rows)]`
    tensor whose columns beyond `rows` are zero: the operand of a GEMM that contracts over the
    rows (a weight gradient contracts over tokens, which need not be a multiple of 16)."""
    rows, cols = data.shape
    padded = torch.empty(cols, round_up(rows), dtype=data.dtype, device=data.device)
    if padded.shape[1] > rows:
        padded.view(torch.uint8)[:, rows:].zero_()  # FP8 zero is the zero byte
    padded[:, :rows].copy_(data.t())
    return padded


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    transpose: bool = False,
    rounding: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> Fp8Tensor:
    """`x` (2-D) quantised to `dtype` with one scale.

    Args:
        x: `[rows, cols]`, any floating dtype.
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
        scale: the scale to cast with (delayed scaling's); None: current scaling, from `x`'s
            own absolute maximum (`compute_scale`).
        amax_out: a one-element fp32 tensor that `max |x|` is max-ed into (delayed scaling's
            record of this pass); None: nothing recorded.
        transpose: also make the zero-padded transposed copy (`Fp8Tensor.transposed`).
        rounding: quantise `x.to(rounding)` (bf16 or fp16), without making that copy on CUDA.
        out: where the FP8 values go (`[rows, cols]` of `dtype`, contiguous); None: new.

    Returns:
        The FP8 tensor; its `scale_inv` is a new tensor (a later change of the scale `scale`
        views leaves it as it was).
    """
    if kernels.kernels_available(x) and (out is None or out.is_contiguous()):
        data, scale_inv, transposed = kernels.cast_to_fp8(
            x, dtype, scale, amax_out, transpose=transpose, rounding=rounding, out=out
        )
        return Fp8Tensor(data, scale_inv, transposed)
    return _quantize_reference(x, dtype, scale, amax_out, transpose, rounding=rounding, out=out)


def _quantize_reference(
    x: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    amax_out: torch.Tensor | None,
    transpose: bool,
    rounding: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> Fp8Tensor:
    """`quantize` in torch ops (off CUDA, and the reference of the CUDA kernels' bytes)."""
    if rounding is not None:
        x = x.to(rounding)
    amax = amax_of(x) if scale is None or amax_out is not None else None
    if scale is None:
        scale = compute_scale(amax, fp8_max(dtype))
    if amax_out is not None:
        torch.maximum(amax_out, amax, out=amax_out)
    data = cast_to_fp8(x, scale, dtype)
    transposed = transpose_padded(data) if transpose else None
    if out is not None:
        data = out.copy_(data)
    return Fp8Tensor(data, scale.reciprocal(), transposed)
