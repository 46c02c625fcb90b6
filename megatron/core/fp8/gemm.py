"""`fp8_mm`: the FP8 GEMM (`torch._scaled_mm`), with Hopper's rules checked on every device.

cuBLASLt's FP8 GEMMs on Hopper take the first operand row-major and the second column-major, a
contraction dimension and an output width in multiples of 16, and never two E5M2 operands.
`torch._scaled_mm` on CPU runs any layout, size and dtype pair, so a layout bug would pass every
CPU test and fail on the first GPU: `fp8_mm` refuses on every device what Hopper refuses. On CPU
(torch 2.13) the result equals `((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)`
bit for bit, which the tests rely on.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.quantize import GEMM_ALIGNMENT
from megatron.core.fp8.tensor import Fp8Tensor

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_mm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    *,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(a.data * a.scale_inv) @ (b.data * b.scale_inv) (+ bias)` in `out_dtype`.

    Args:
        a: `[M, K]`, row-major.
        b: `[K, N]`, column-major (the transposed view of a row-major `[N, K]` tensor).
        out_dtype: bf16, fp16 or fp32.
        fast_accum: Hopper's fast FP8 accumulation (upstream uses it for the forward GEMM
            only); ignored off Hopper.
        bias: `[N]` in `out_dtype` (bf16 or fp16 only, as cuBLASLt), added before rounding.
        out: an `[M, N]` contiguous tensor of `out_dtype` written in place (its old values
            are not read); None: a new tensor.

    Returns:
        `[M, N]` (`out` when given).

    Raises:
        ValueError: an operand or argument Hopper's FP8 GEMM refuses.
    """
    _check_operands(a, b)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_mm: out_dtype {out_dtype} is not one of {_OUT_DTYPES}.")
    if bias is not None and (out_dtype == torch.float32 or bias.dtype != out_dtype):
        raise ValueError(
            f"fp8_mm: a bias needs a bf16 or fp16 output of its own dtype, got bias "
            f"{bias.dtype} with out_dtype {out_dtype}; add it after the GEMM."
        )
    shape = (a.data.shape[0], b.data.shape[1])
    kwargs = dict(bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum)
    if out is None:
        return torch._scaled_mm(a.data, b.data, a.scale_inv, b.scale_inv, **kwargs)
    if out.shape != shape or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(
            f"fp8_mm: out must be a contiguous {list(shape)} tensor of {out_dtype}, got "
            f"{list(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()})."
        )
    return torch._scaled_mm(a.data, b.data, a.scale_inv, b.scale_inv, out=out, **kwargs)


def _check_operands(a: Fp8Tensor, b: Fp8Tensor) -> None:
    for name, operand in (("a", a), ("b", b)):
        data = operand.data
        if data.dim() != 2 or data.dtype not in _FP8_DTYPES:
            raise ValueError(
                f"fp8_mm: operand {name} must be a 2-D FP8 tensor, got {data.dim()}-D {data.dtype}."
            )
        scale = operand.scale_inv
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(
                f"fp8_mm: operand {name}'s scale_inv must be one fp32 element (a tensor-wise "
                f"scale), got {list(scale.shape)} {scale.dtype}."
            )
    if a.data.dtype == b.data.dtype == torch.float8_e5m2:
        raise ValueError("fp8_mm: two E5M2 operands are refused by Hopper's FP8 GEMM.")
    (m, k), (k_b, n) = a.data.shape, b.data.shape
    if k != k_b:
        raise ValueError(f"fp8_mm: shapes [{m}, {k}] and [{k_b}, {n}] do not chain.")
    for what, size in (("contraction dimension", k), ("output width", n)):
        if size % GEMM_ALIGNMENT:
            raise ValueError(
                f"fp8_mm: the {what} ({size}) must be a multiple of {GEMM_ALIGNMENT} for "
                "Hopper's FP8 GEMM."
            )
    # Rows of a and columns of b contiguous, each starting at a multiple of 16 bytes.
    if m > 1 and (a.data.stride(1) != 1 or a.data.stride(0) % GEMM_ALIGNMENT):
        raise ValueError(
            f"fp8_mm: operand a must be row-major with 16-byte aligned rows (strides "
            f"{a.data.stride()}); Hopper's FP8 GEMM multiplies a row-major matrix by a "
            "column-major one."
        )
    if b.data.stride(0) != 1 or b.data.stride(1) % GEMM_ALIGNMENT:
        raise ValueError(
            f"fp8_mm: operand b must be column-major with 16-byte aligned columns (strides "
            f"{b.data.stride()}: the transposed view of a row-major tensor); Hopper's FP8 GEMM "
            "multiplies a row-major matrix by a column-major one."
        )
