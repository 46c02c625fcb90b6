"""The blockwise recipe's quantisation and GEMM on CPU: block scales against Transformer Engine's
rule written out (powers of 2; amaxes of 0, inf and NaN; NaN and inf values; partial blocks;
the zero-padded transposed copy), the scale layouts against torch's own checks of its
blockwise GEMM (on meta tensors), the GEMM's refusals, and its dequantised fp32 product."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fp8 import gemm
from megatron.core.fp8.blockwise import (
    ROW_BLOCK,
    SQUARE_BLOCK,
    power_of_2_scale,
    quantize_1x128,
    quantize_1x128_transposed,
    quantize_128x128,
)
from megatron.core.fp8.gemm import block_scaled_mm_scales, fp8_mm
from megatron.core.fp8.quantize import quantize
from megatron.core.fp8.tensor import BlockFp8Tensor
from megatron.core.fp8.weights import Fp8Weight
from tests.unit_tests.fp8.reference import (
    E4M3,
    E5M2,
    block_dq,
    block_q,
    block_scale,
    padded_tokens_t,
)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def _column_major(scale: torch.Tensor) -> bool:
    """Whether `scale` lies column-major (a dimension of size 1 has any stride)."""
    return scale.stride(0) == 1 and (scale.shape[1] == 1 or scale.stride(1) == scale.shape[0])


def _wide(shape: tuple[int, int], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values over seven decades of magnitude: blocks with very different scales."""
    generator = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-3, 4, shape, generator=generator)
    return (torch.randn(shape, generator=generator) * 10.0**exponent).to(dtype)


@pytest.mark.parametrize("dtype, max_value", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_block_scales_are_the_power_of_2_at_or_below_the_quotient(dtype, max_value):
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-45, max_value, 3.0, 1e30])
    scale = power_of_2_scale(amax, max_value)
    assert scale.tolist() == [block_scale(value, dtype) for value in amax.tolist()]
    # 448 / 2 = 224 rounds down to 128 (57344 / 2 to 16384); 0, inf and NaN give 1; an overflowing
    # quotient gives 2^127.
    assert scale[:6].tolist() == [2.0 ** (7 if dtype == E4M3 else 14), 1.0, 1.0, 1.0, 2.0**127, 1.0]


@pytest.mark.parametrize("shape", [(1, 16), (37, 200), (130, 384)], ids=str)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_1x128_casts_are_the_block_formula(shape, source, dtype):
    """The row-major copy in 1x128 blocks, and the transposed copy quantised again in 1x128
    blocks along the rows, padded with zero columns to 128 rows; the scales column-major."""
    rows, cols = shape
    x = _wide(shape, seed=rows * cols, dtype=source)
    out = quantize_1x128(x, dtype, transpose=True)
    data, scale_inv = block_q(x, dtype, ROW_BLOCK)
    assert out.block == ROW_BLOCK
    assert torch.equal(_bytes(out.data), _bytes(data))
    assert torch.equal(out.scale_inv, scale_inv) and _column_major(out.scale_inv)
    transposed, transposed_scale_inv = block_q(padded_tokens_t(x), dtype, ROW_BLOCK)
    padded_rows = -(-rows // 128) * 128
    assert out.transposed.shape == (cols, padded_rows)
    assert torch.equal(_bytes(out.transposed), _bytes(transposed))
    assert torch.equal(out.transposed_scale_inv, transposed_scale_inv)
    assert _column_major(out.transposed_scale_inv)
    alone = quantize_1x128_transposed(x, dtype)
    assert torch.equal(_bytes(alone.data), _bytes(transposed))
    assert torch.equal(alone.scale_inv, transposed_scale_inv)
    assert not _bytes(out.transposed)[:, rows:].any()  # the padding is zero


def test_128x128_casts_are_the_block_formula_with_padded_scale_rows():
    w = _wide((144, 272), seed=3, dtype=torch.bfloat16)
    out = quantize_128x128(w, E4M3)
    data, scale_inv = block_q(w, E4M3, SQUARE_BLOCK)
    assert out.block == SQUARE_BLOCK
    assert torch.equal(_bytes(out.data), _bytes(data))
    assert torch.equal(out.scale_inv, scale_inv)
    assert out.scale_inv.shape == (2, 3) and out.scale_inv.stride() == (4, 1)


def test_zero_nan_infinite_and_tiny_blocks():
    """A block of zeros scales by 1; a NaN is skipped by its block's amax and stays NaN; an
    infinity makes its block's scale 1 and saturates; a block too small for an fp32 quotient
    scales by 2^127 (inverse: the subnormal 2^-127). As the per-tensor casts do."""
    x = _wide((2, 256), seed=5)
    x[0, :128] = 0.0
    x[0, 133] = float("nan")
    x[1, 3], x[1, 9] = float("inf"), float("-inf")
    x[1, 128:] = torch.linspace(-1e-38, 1e-38, 128)
    out = quantize_1x128(x, E4M3)
    finite_amax = x[0, 128:].nan_to_num(nan=0.0).abs().max().item()
    expected_scale_inv = [[1.0, 1 / block_scale(finite_amax, E4M3)], [1.0, 2.0**-127]]
    assert out.scale_inv.tolist() == expected_scale_inv
    values = out.data.float()
    assert not _bytes(out.data[0, :128]).any()
    assert torch.isnan(values[0, 133]) and torch.isnan(values).sum() == 1
    assert values[1, 3] == 448 and values[1, 9] == -448
    data, scale_inv = block_q(x, E4M3, ROW_BLOCK)
    assert torch.equal(out.scale_inv, scale_inv)
    finite = ~torch.isnan(values)
    assert torch.equal(_bytes(out.data)[finite], _bytes(data)[finite])
    # The per-tensor cast treats NaN the same way: skipped by the amax, kept in the values.
    assert torch.isnan(quantize(x, E4M3).data.float()[0, 133])


def test_partial_blocks_are_scaled_as_zero_padded():
    x = _wide((3, 200), seed=7, dtype=torch.bfloat16)
    out = quantize_1x128(x, E4M3, transpose=True)
    padded = quantize_1x128(F.pad(x, (0, 56)), E4M3, transpose=True)
    assert torch.equal(_bytes(out.data), _bytes(padded.data[:, :200]))
    assert torch.equal(out.scale_inv, padded.scale_inv)
    assert torch.equal(_bytes(out.transposed), _bytes(padded.transposed[:200]))
    assert torch.equal(out.dequantize(), block_dq(*block_q(x, E4M3, ROW_BLOCK), ROW_BLOCK))


def _linear_operands(
    tokens: int = 256, out_features: int = 256, in_features: int = 384, device: str = "cpu"
):
    """The blockwise operands of a linear layer's three GEMMs: (fprop, dgrad, wgrad) pairs,
    quantised on `device` (on CUDA by the Triton casts; `test_blockwise_cuda.py`)."""

    def wide(shape: tuple[int, int], seed: int) -> torch.Tensor:
        return _wide(shape, seed, torch.bfloat16).to(device)

    x = quantize_1x128(wide((tokens, in_features), 1), E4M3, transpose=True)
    grad = quantize_1x128(wide((tokens, out_features), 2), E4M3, transpose=True)
    weight = Fp8Weight.quantized(wide((out_features, in_features), 3), blockwise=True)
    return {
        "fprop": (x, weight.fprop_operand()),
        "dgrad": (grad, weight.dgrad_operand()),
        "wgrad": (grad.transposed_operand(), x.transposed_operand().t()),
    }


@pytest.mark.skipif(not hasattr(F, "scaled_mm"), reason="torch.nn.functional.scaled_mm needed")
@pytest.mark.parametrize("name", ["fprop", "dgrad", "wgrad"])
def test_the_scales_are_laid_out_as_torchs_blockwise_gemm_takes_them(name):
    """torch's checks of its blockwise GEMM (`scaled_mm`'s meta function, the CUDA kernel's
    rules) accept the operands and scales each GEMM passes: the 128x128 scales padded to 4
    K-blocks (3 here), the 1x128 ones column-major. A wrong layout is refused."""
    a, b = _linear_operands()[name]
    scale_a, recipe_a, scale_b, recipe_b = block_scaled_mm_scales(a, b)

    def meta(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("meta")

    out = F.scaled_mm(
        meta(a.data), meta(b.data), meta(scale_a), recipe_a, meta(scale_b), recipe_b,
        output_dtype=torch.bfloat16,
    )  # fmt: skip
    assert out.shape == (a.data.shape[0], b.data.shape[1])
    with pytest.raises(RuntimeError, match="blockwise scaling"):
        F.scaled_mm(
            meta(a.data), meta(b.data), meta(scale_a.contiguous()), recipe_a, meta(scale_b),
            recipe_b, output_dtype=torch.bfloat16,
        )  # fmt: skip


def test_the_cpu_gemm_is_the_dequantised_product_and_says_so_once(monkeypatch):
    monkeypatch.setattr(gemm, "_reported", set())
    x, w = _linear_operands(tokens=40, out_features=144, in_features=208)["fprop"]
    bias = torch.randn(144).bfloat16()
    product = x.dequantize() @ w.dequantize()
    with pytest.warns(UserWarning, match="dequantised fp32 matmuls here: torch has no "):
        y = fp8_mm(x, w, out_dtype=torch.bfloat16, bias=bias)
    assert torch.equal(y, (product + bias.float()).bfloat16())
    out = torch.full((40, 144), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert fp8_mm(x, w, out_dtype=torch.float32, out=out) is out
    assert torch.equal(out, product)


def test_refuses_what_torchs_blockwise_gemm_refuses():
    x, w = _linear_operands(tokens=32, out_features=128, in_features=128)["fprop"]
    tensorwise = quantize(torch.randn(128, 128), E4M3)
    with pytest.raises(ValueError, match="BlockFp8Tensor and Fp8Tensor are scaled differently"):
        fp8_mm(x, tensorwise.t(), out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\(128, 128\) and \(128, 128\) blocks"):
        fp8_mm(w.t(), w, out_dtype=torch.float32)
    e5m2 = quantize_1x128(torch.randn(32, 128), E5M2)
    with pytest.raises(ValueError, match="multiplies E4M3 operands only"):
        fp8_mm(e5m2, w, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="without fast accumulation"):
        fp8_mm(x, w, out_dtype=torch.bfloat16, fast_accum=True)
    with pytest.raises(ValueError, match=r"operand b's scale_inv must be fp32 \[1, 1\]"):
        fp8_mm(x, w._replace(scale_inv=torch.ones(2, 1)), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="operand b must be column-major"):
        fp8_mm(
            x, BlockFp8Tensor(w.data.contiguous(), w.scale_inv, w.block), out_dtype=torch.float32
        )
