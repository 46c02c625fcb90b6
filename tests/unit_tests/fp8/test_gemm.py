"""`fp8_mm`: equal, bit for bit, to the plain-torch reference on CPU, and refusing on every
device what Hopper's FP8 GEMM refuses (so that CPU tests catch layout bugs)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.gemm import fp8_mm
from megatron.core.fp8.quantize import quantize
from megatron.core.fp8.tensor import Fp8Tensor
from tests.unit_tests.fp8.reference import E4M3, E5M2, dq, exact_cpu_scaled_mm


def _operands(m=40, k=64, n=48, a_dtype=E4M3, b_dtype=E4M3):
    a = quantize(torch.randn(m, k), a_dtype)
    w = quantize(torch.randn(n, k), b_dtype)  # row-major [n, k]: w.t() is column-major
    return a, w.t()


@exact_cpu_scaled_mm
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_equals_the_dequantised_fp32_product(out_dtype, dtypes):
    a, b = _operands(a_dtype=dtypes[0], b_dtype=dtypes[1])
    expected = (dq(a.data, a.scale_inv) @ dq(b.data, b.scale_inv)).to(out_dtype)
    assert torch.equal(fp8_mm(a, b, out_dtype=out_dtype), expected)


@exact_cpu_scaled_mm
def test_bias_is_added_before_rounding_and_out_is_written():
    a, b = _operands()
    bias = torch.randn(48).bfloat16()
    product = dq(a.data, a.scale_inv) @ dq(b.data, b.scale_inv)
    assert torch.equal(
        fp8_mm(a, b, out_dtype=torch.bfloat16, bias=bias), (product + bias.float()).bfloat16()
    )
    out = torch.full((40, 48), float("nan"))
    assert fp8_mm(a, b, out_dtype=torch.float32, out=out) is out
    assert torch.equal(out, product)


def test_an_empty_sum_is_zero_or_the_bias():
    """A weight gradient over a batch of no tokens: `[n, 0] @ [0, k]`, whose operands (the
    transposed copies of empty tensors) have no row-major layout to check."""
    grad_t = quantize(torch.randn(0, 48), E5M2, transpose=True).transposed_operand()
    input_t = quantize(torch.randn(0, 64), E4M3, transpose=True).transposed_operand()
    assert grad_t.data.shape == (48, 0)
    product = fp8_mm(grad_t, input_t.t(), out_dtype=torch.float32)
    assert torch.equal(product, torch.zeros(48, 64))
    out = torch.full((48, 64), float("nan"))
    assert fp8_mm(grad_t, input_t.t(), out_dtype=torch.float32, out=out) is out
    assert torch.equal(out, torch.zeros(48, 64))
    bias = torch.randn(64).bfloat16()
    with_bias = fp8_mm(grad_t, input_t.t(), out_dtype=torch.bfloat16, bias=bias)
    assert torch.equal(with_bias, bias.expand(48, 64))


def test_refuses_what_hopper_refuses():
    a, b = _operands()
    with pytest.raises(ValueError, match="operand b must be column-major"):
        fp8_mm(a, Fp8Tensor(b.data.contiguous(), b.scale_inv), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="operand a must be row-major"):
        fp8_mm(Fp8Tensor(a.data.t().contiguous().t(), a.scale_inv), b, out_dtype=torch.float32)
    odd_a, odd_b = _operands(k=24)
    with pytest.raises(ValueError, match=r"contraction dimension \(24\) must be a multiple of 16"):
        fp8_mm(odd_a, odd_b, out_dtype=torch.float32)
    narrow_a, narrow_b = _operands(n=40)
    with pytest.raises(ValueError, match=r"output width \(40\) must be a multiple of 16"):
        fp8_mm(narrow_a, narrow_b, out_dtype=torch.float32)
    e5_a, e5_b = _operands(a_dtype=E5M2, b_dtype=E5M2)
    with pytest.raises(ValueError, match="two E5M2 operands"):
        fp8_mm(e5_a, e5_b, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="one fp32 element"):
        fp8_mm(a, Fp8Tensor(b.data, torch.ones(48)), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="a bias needs a bf16 or fp16 output"):
        fp8_mm(a, b, out_dtype=torch.float32, bias=torch.zeros(48))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        fp8_mm(a, b, out_dtype=torch.float32, out=torch.empty(48, 40).t())
