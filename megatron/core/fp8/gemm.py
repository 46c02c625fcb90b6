"""`fp8_mm`: the FP8 GEMM (`torch._scaled_mm`), with Hopper's rules checked on every device.

cuBLASLt's FP8 GEMMs on Hopper take the first operand row-major and the second column-major, a
contraction dimension and an output width in multiples of 16, and never two E5M2 operands.
`torch._scaled_mm` on CPU runs any layout, size and dtype pair, so a layout bug would pass every
CPU test and fail on the first GPU: `fp8_mm` refuses on every device what Hopper refuses. On CPU
(torch 2.13) the result equals `((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)`
bit for bit, which the tests rely on.

Blockwise operands (`BlockFp8Tensor`: a 1x128 first operand times a 128x128 or a transposed
1x128 second, as the linear layers of the blockwise recipe multiply) take torch's
blockwise-scaled GEMM, `torch.nn.functional.scaled_mm` with its DeepSeek recipes (torch 2.11
checks): on compute capability 9.0 only (cuBLASLt 12.9 or newer), E4M3 operands only, no fast
accumulation, the 1x128 scales column-major and the 128x128 ones K-block-major with their
K-blocks padded to a multiple of 4 (16 bytes). This module runs it where the contraction
dimension and the output width are multiples of 128 and the rows a multiple of 16; everywhere
else (CPU, other GPUs, other shapes) the same arithmetic runs as a dequantised fp32 matmul (each
block times its scale: exact, powers of 2), said once per reason in a warning.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from megatron.core.fp8.quantize import GEMM_ALIGNMENT, round_up
from megatron.core.fp8.tensor import BlockFp8Tensor, Fp8Tensor

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_BLOCK = 128
_ROW, _COLUMN, _SQUARE = (1, _BLOCK), (_BLOCK, 1), (_BLOCK, _BLOCK)
_BLOCK_PAIRS = ((_ROW, _SQUARE), (_ROW, _COLUMN))
"""The blockwise operand pairs: 1x128 times 128x128 (forward, input gradient) and 1x128 times
the transposed view of 1x128 (weight gradient)."""
_scaled_mm, _ScalingType = getattr(F, "scaled_mm", None), getattr(F, "ScalingType", None)
"""torch's scaled GEMM with explicit scaling recipes, and its recipes (torch 2.10 and newer)."""
_reported: set[str] = set()
"""The reasons the blockwise GEMM ran dequantised that were said already."""


def fp8_mm(
    a: Fp8Tensor | BlockFp8Tensor,
    b: Fp8Tensor | BlockFp8Tensor,
    *,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`a.dequantize() @ b.dequantize() (+ bias)` in `out_dtype`.

    Args:
        a: `[M, K]`, row-major: an `Fp8Tensor`, or a `BlockFp8Tensor` of 1x128 blocks.
        b: `[K, N]`, column-major (the transposed view of a row-major `[N, K]` tensor): an
            `Fp8Tensor`, or a `BlockFp8Tensor` of 128x128 blocks or of 128x1 ones (a 1x128
            tensor's transposed view).
        out_dtype: bf16, fp16 or fp32.
        fast_accum: Hopper's fast FP8 accumulation (upstream uses it for the forward GEMM
            only); ignored off Hopper; refused with blockwise operands.
        bias: `[N]` in `out_dtype` (bf16 or fp16 only, as cuBLASLt), added before rounding.
        out: an `[M, N]` contiguous tensor of `out_dtype` written in place (its old values
            are not read); None: a new tensor.

    Returns:
        `[M, N]` (`out` when given).

    Raises:
        ValueError: an operand or argument Hopper's FP8 GEMM refuses.
    """
    blockwise = isinstance(a, BlockFp8Tensor)
    if blockwise != isinstance(b, BlockFp8Tensor):
        raise ValueError(
            f"fp8_mm: operands {type(a).__name__} and {type(b).__name__} are scaled "
            "differently; multiply two Fp8Tensors or two BlockFp8Tensors."
        )
    m, k, n = _check_operands(a, b)
    if blockwise:
        _check_blocks(a, b, fast_accum)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_mm: out_dtype {out_dtype} is not one of {_OUT_DTYPES}.")
    if bias is not None and (out_dtype == torch.float32 or bias.dtype != out_dtype):
        raise ValueError(
            f"fp8_mm: a bias needs a bf16 or fp16 output of its own dtype, got bias "
            f"{bias.dtype} with out_dtype {out_dtype}; add it after the GEMM."
        )
    if out is not None and (
        out.shape != (m, n) or out.dtype != out_dtype or not out.is_contiguous()
    ):
        raise ValueError(
            f"fp8_mm: out must be a contiguous {[m, n]} tensor of {out_dtype}, got "
            f"{list(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()})."
        )
    if k == 0:
        # An empty sum (a weight gradient over no tokens): zero, or the bias.
        product = torch.zeros(m, n, dtype=out_dtype, device=a.data.device)
        if bias is not None:
            product += bias
        return product if out is None else out.copy_(product)
    if blockwise:
        product = _block_mm(a, b, out_dtype, bias)
        return product if out is None else out.copy_(product)
    kwargs = dict(bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum)
    if out is None:
        return torch._scaled_mm(a.data, b.data, a.scale_inv, b.scale_inv, **kwargs)
    return torch._scaled_mm(a.data, b.data, a.scale_inv, b.scale_inv, out=out, **kwargs)


def _check_operands(
    a: Fp8Tensor | BlockFp8Tensor, b: Fp8Tensor | BlockFp8Tensor
) -> tuple[int, int, int]:
    """Hopper's rules for the operands (module docstring); returns `(m, k, n)`. Each tensor
    attribute is read once: this runs at every GEMM."""
    a_data, b_data = a.data, b.data
    a_dtype, b_dtype = a_data.dtype, b_data.dtype
    a_shape, b_shape = a_data.shape, b_data.shape
    for name, operand, dtype, shape in (("a", a, a_dtype, a_shape), ("b", b, b_dtype, b_shape)):
        if len(shape) != 2 or dtype not in _FP8_DTYPES:
            raise ValueError(
                f"fp8_mm: operand {name} must be a 2-D FP8 tensor, got {len(shape)}-D {dtype}."
            )
        scale = operand.scale_inv
        if isinstance(operand, Fp8Tensor) and (scale.dtype != torch.float32 or scale.numel() != 1):
            raise ValueError(
                f"fp8_mm: operand {name}'s scale_inv must be one fp32 element (a tensor-wise "
                f"scale), got {list(scale.shape)} {scale.dtype}."
            )
    if a_dtype == b_dtype == torch.float8_e5m2:
        raise ValueError("fp8_mm: two E5M2 operands are refused by Hopper's FP8 GEMM.")
    (m, k), (k_b, n) = a_shape, b_shape
    if k != k_b:
        raise ValueError(f"fp8_mm: shapes [{m}, {k}] and [{k_b}, {n}] do not chain.")
    for what, size in (("contraction dimension", k), ("output width", n)):
        if size % GEMM_ALIGNMENT:
            raise ValueError(
                f"fp8_mm: the {what} ({size}) must be a multiple of {GEMM_ALIGNMENT} for "
                "Hopper's FP8 GEMM."
            )
    if k == 0:
        return m, k, n  # nothing to multiply (a batch of no tokens): no layout to check
    # Rows of a and columns of b contiguous, each starting at a multiple of 16 bytes.
    a_stride, b_stride = a_data.stride(), b_data.stride()
    if m > 1 and (a_stride[1] != 1 or a_stride[0] % GEMM_ALIGNMENT):
        raise ValueError(
            f"fp8_mm: operand a must be row-major with 16-byte aligned rows (strides "
            f"{a_stride}); Hopper's FP8 GEMM multiplies a row-major matrix by a "
            "column-major one."
        )
    if b_stride[0] != 1 or b_stride[1] % GEMM_ALIGNMENT:
        raise ValueError(
            f"fp8_mm: operand b must be column-major with 16-byte aligned columns (strides "
            f"{b_stride}: the transposed view of a row-major tensor); Hopper's FP8 GEMM "
            "multiplies a row-major matrix by a column-major one."
        )
    return m, k, n


def _check_blocks(a: BlockFp8Tensor, b: BlockFp8Tensor, fast_accum: bool) -> None:
    if (a.block, b.block) not in _BLOCK_PAIRS:
        raise ValueError(
            f"fp8_mm: blockwise operands with {a.block} and {b.block} blocks; the blockwise GEMM "
            "multiplies a (1, 128)-blocked first operand by a (128, 128) or a (128, 1) one."
        )
    if a.data.dtype != torch.float8_e4m3fn or b.data.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"fp8_mm: blockwise operands of {a.data.dtype} and {b.data.dtype}; torch's "
            "blockwise-scaled GEMM multiplies E4M3 operands only."
        )
    if fast_accum:
        raise ValueError(
            "fp8_mm: blockwise GEMMs accumulate without fast accumulation (torch refuses it, "
            "and Transformer Engine's blockwise recipe requires split accumulation)."
        )
    for name, operand in (("a", a), ("b", b)):
        rows, cols = operand.data.shape
        blocks = (-(-rows // operand.block[0]), -(-cols // operand.block[1]))
        scale = operand.scale_inv
        if scale.dtype != torch.float32 or tuple(scale.shape) != blocks:
            raise ValueError(
                f"fp8_mm: operand {name}'s scale_inv must be fp32 {list(blocks)} (one per "
                f"{operand.block} block of {[rows, cols]}), got {list(scale.shape)} "
                f"{scale.dtype}."
            )


def _block_mm(
    a: BlockFp8Tensor, b: BlockFp8Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """The blockwise GEMM, by torch's kernel or dequantised (module docstring)."""
    refusal = _block_kernel_refusal(a, b)
    if refusal is None:
        scales = block_scaled_mm_scales(a, b)
        return _scaled_mm(
            a.data, b.data, *scales, bias=bias, output_dtype=out_dtype, use_fast_accum=False
        )
    reason, text = refusal
    if reason not in _reported:
        _reported.add(reason)
        warnings.warn(
            f"FP8 blockwise GEMMs run as dequantised fp32 matmuls here: {text}.", stacklevel=2
        )
    product = a.dequantize() @ b.dequantize()
    if bias is not None:
        product = product + bias.float()
    return product.to(out_dtype)


def _block_kernel_refusal(a: BlockFp8Tensor, b: BlockFp8Tensor) -> tuple[str, str] | None:
    """Why torch's blockwise-scaled GEMM cannot multiply `a` by `b` here, as (a reason, in
    words), or None where it can."""
    device = a.data.device
    if device.type != "cuda":
        return "device", f"torch has no blockwise-scaled GEMM on {device.type}"
    if _scaled_mm is None:
        return "torch", f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return "gpu", (
            f"torch's blockwise-scaled GEMM runs on compute capability 9.0 (Hopper) only, and "
            f"this GPU has {major}.{minor}"
        )
    (m, k), n = a.data.shape, b.data.shape[1]
    if k % _BLOCK or n % _BLOCK or m % GEMM_ALIGNMENT:
        return "shape", (
            f"the kernel needs the contraction dimension and the output width in multiples "
            f"of {_BLOCK} and the rows in multiples of {GEMM_ALIGNMENT}, and [{m}, {k}] x "
            f"[{k}, {n}] (the first such GEMM) has not"
        )
    return None


def block_scaled_mm_scales(a: BlockFp8Tensor, b: BlockFp8Tensor) -> tuple:
    """`(scale_a, recipe_a, scale_b, recipe_b)` of `torch.nn.functional.scaled_mm` multiplying
    `a.data` by `b.data`: the scales in the layouts its DeepSeek recipes take."""
    scale_a, recipe_a = _column_major(a.scale_inv), _ScalingType.BlockWise1x128
    if b.block == _SQUARE:
        return scale_a, recipe_a, _square_scales(b.scale_inv), _ScalingType.BlockWise128x128
    return scale_a, recipe_a, _column_major(b.scale_inv.t()), _ScalingType.BlockWise1x128


def _column_major(scale: torch.Tensor) -> torch.Tensor:
    """`scale` (`[rows, blocks]`) with strides `(1, rows)`, as torch's 1x128 recipe takes it:
    itself where it has them (the quantisers lay 1x128 scales out so)."""
    rows, blocks = scale.shape
    if scale.stride(0) == 1 and (blocks == 1 or scale.stride(1) == rows):
        return scale
    return scale.t().contiguous().t()


def _square_scales(scale: torch.Tensor) -> torch.Tensor:
    """The 128x128 scales of a second operand (`[K-blocks, N-blocks]`) as torch's recipe takes
    them: `[round_up(K-blocks, 4), N-blocks]` with strides `(1, round_up(K-blocks, 4))`. The
    transposed view of a weight's scales has those strides already (`blockwise.py` pads them):
    the padded tensor is viewed whole."""
    k_blocks, n_blocks = scale.shape
    padded = round_up(k_blocks, 4)
    if scale.stride() == (1, padded):
        return scale.as_strided((padded, n_blocks), (1, padded))
    whole = scale.new_zeros(n_blocks, padded)
    whole[:, :k_blocks] = scale.t()
    return whole.t()
