"""The blockwise recipe on CUDA: the Triton casts (`block_kernels.py`) give the torch-op casts'
bytes and scales bit for bit, in the same layouts; on Hopper, torch's blockwise GEMM
(`torch.nn.functional.scaled_mm`) computes what the dequantised fp32 product of the same
operands computes, within the rounding of a GEMM that sums in another order (a wrong scale,
layout or block would be off by far more), and a linear layer in FP8 computes the plain-torch
reference's GEMMs."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron.core.fp8 import block_kernels, blockwise, gemm
from megatron.core.fp8.gemm import fp8_mm
from megatron.core.fp8.tensor import BlockFp8Tensor
from tests.unit_tests.fp8 import test_blockwise, test_blockwise_training

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
SHAPES = [(1, 16), (37, 200), (130, 384), (1000, 1024), (4096, 1408)]

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="torch's blockwise-scaled GEMM runs on compute capability 9.0 only",
)


def _input(shape, dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    # Seven decades of magnitude: blocks with very different scales.
    exponent = torch.randint(-3, 4, shape, device="cuda", generator=generator)
    return (torch.randn(shape, device="cuda", generator=generator) * 10.0**exponent).to(dtype)


def _bytes(tensor):
    return tensor.view(torch.uint8)


def _assert_same_cast(actual: BlockFp8Tensor, expected: BlockFp8Tensor) -> None:
    """Equal bytes (NaNs in the same places: their sign bits may differ), scales and layouts."""
    nan = expected.data.float().isnan()
    assert torch.equal(actual.data.float().isnan(), nan)
    assert torch.equal(_bytes(actual.data)[~nan], _bytes(expected.data)[~nan])
    assert torch.equal(actual.scale_inv, expected.scale_inv)
    assert actual.scale_inv.stride() == expected.scale_inv.stride() or 1 in actual.scale_inv.shape
    assert actual.block == expected.block


def _torch_ops_1x128(x, dtype):
    """The torch-op casts of `blockwise.py`, run on the GPU: (row-major, transposed)."""
    data, scale_inv = blockwise._quantize_reference(x, dtype, blockwise.ROW_BLOCK)
    rowwise = BlockFp8Tensor(data, blockwise.row_block_layout(scale_inv), blockwise.ROW_BLOCK)
    return rowwise, blockwise._quantize_transposed_reference(x, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_1x128_cast_is_the_torch_ops_bit_for_bit(fmt, shape, source):
    dtype = FORMATS[fmt]
    x = _input(shape, source, seed=shape[0] * shape[1])
    data, scale_inv, transposed, transposed_scale_inv = block_kernels.cast_1x128(
        x, dtype, rowwise=True, transpose=True
    )
    expected, expected_t = _torch_ops_1x128(x, dtype)
    _assert_same_cast(BlockFp8Tensor(data, scale_inv, blockwise.ROW_BLOCK), expected)
    _assert_same_cast(
        BlockFp8Tensor(transposed, transposed_scale_inv, blockwise.ROW_BLOCK), expected_t
    )
    alone = blockwise.quantize_1x128_transposed(x, dtype)  # the kernel without the row copy
    _assert_same_cast(alone, expected_t)


def test_zero_nan_infinite_and_tiny_blocks_cast_as_the_torch_ops():
    """A block of zeros, NaNs and infinities, and a block whose quotient overflows fp32 (scale
    2^127, inverse the subnormal 2^-127), in both directions."""
    x = _input((256, 384), torch.bfloat16, seed=9)
    x[:128, :128] = 0.0
    x[5, 130], x[200, 7] = float("nan"), float("nan")
    x[3, 300], x[150, 260] = float("inf"), float("-inf")
    # Normal fp32 values whose quotient 448 / amax overflows (amax below 1.3e-36).
    tiny = torch.rand(128, 128, device="cuda") + 1.0
    x[128:, 128:256] = tiny * torch.where(torch.rand_like(tiny) < 0.5, -5e-37, 5e-37)
    data, scale_inv, transposed, transposed_scale_inv = block_kernels.cast_1x128(
        x, E4M3, rowwise=True, transpose=True
    )
    expected, expected_t = _torch_ops_1x128(x, E4M3)
    _assert_same_cast(BlockFp8Tensor(data, scale_inv, blockwise.ROW_BLOCK), expected)
    _assert_same_cast(
        BlockFp8Tensor(transposed, transposed_scale_inv, blockwise.ROW_BLOCK), expected_t
    )
    assert scale_inv[200, 1].item() == 2.0**-127
    assert scale_inv[0, 0].item() == 1.0 and scale_inv[3, 2].item() == 1.0


@pytest.mark.parametrize("shape", [(16, 16), (144, 272), (4096, 14336), (130, 70)], ids=str)
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32], ids=str)
def test_the_128x128_cast_is_the_torch_ops_bit_for_bit(shape, source):
    w = _input(shape, source, seed=shape[1])
    w[0, 0] = float("nan")
    data, scale_inv = block_kernels.cast_128x128(w, E4M3)
    expected_data, expected_scale_inv = blockwise._quantize_reference(
        w, E4M3, blockwise.SQUARE_BLOCK
    )
    expected = BlockFp8Tensor(
        expected_data, blockwise.square_block_layout(expected_scale_inv), blockwise.SQUARE_BLOCK
    )
    _assert_same_cast(BlockFp8Tensor(data, scale_inv, blockwise.SQUARE_BLOCK), expected)


def test_a_tensor_of_more_than_2_to_the_31_elements_is_cast_whole():
    """64-bit offsets: the last rows and their transposed columns land where they belong."""
    rows, cols = 2**31 // 4096 + 256, 4096
    x = torch.ones(rows, cols, device="cuda", dtype=torch.bfloat16)
    x[-128:] = _input((128, cols), torch.bfloat16, seed=11)
    data, scale_inv, transposed, transposed_scale_inv = block_kernels.cast_1x128(
        x, E4M3, rowwise=True, transpose=True
    )
    tail, tail_t = _torch_ops_1x128(x[-128:], E4M3)
    assert torch.equal(_bytes(data[-128:]), _bytes(tail.data))
    assert torch.equal(scale_inv[-128:], tail.scale_inv)
    assert torch.equal(_bytes(transposed[:, -128:]), _bytes(tail_t.data))
    assert torch.equal(transposed_scale_inv[:, -1:], tail_t.scale_inv)


def _refuse_the_dequantised_fallback() -> None:
    """Within `warnings.catch_warnings()`: `fp8_mm`'s warning that it ran dequantised, and
    only that one (torch may warn of its own), raises, so a test asserts the kernel ran."""
    warnings.filterwarnings("error", message="FP8 blockwise GEMMs run as dequantised")


@hopper
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["fprop", "dgrad", "wgrad"])
def test_torchs_blockwise_gemm_computes_the_dequantised_product(name, out_dtype, monkeypatch):
    """272 tokens (a multiple of 16, not of 128), 384 input features (3 K-blocks: the 128x128
    scales padded to 4). Hopper's FP8 tensor cores sum each 128-element block with about 14
    bits of precision before the fp32 promotion (DeepSeek-V3's report): hence 1e-3 in fp32; a
    wrong scale is off by a power of 2."""
    monkeypatch.setattr(gemm, "_reported", set())
    a, b = test_blockwise._linear_operands(272, 256, 384, device="cuda")[name]
    with warnings.catch_warnings():
        _refuse_the_dequantised_fallback()
        product = fp8_mm(a, b, out_dtype=out_dtype)
    expected = a.dequantize() @ b.dequantize()
    tolerance = 2**-7 if out_dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(
        product.float(), expected.to(out_dtype).float(), rtol=tolerance,
        atol=tolerance * expected.abs().max().item(),
    )  # fmt: skip


@hopper
def test_the_bias_is_added_in_the_blockwise_gemm(monkeypatch):
    """The bias is drawn on the scale of the product, so that a bias left out (or added twice)
    is off by far more than the bound (that of the bf16 case above)."""
    monkeypatch.setattr(gemm, "_reported", set())
    a, b = test_blockwise._linear_operands(256, 256, 256, device="cuda")["fprop"]
    product = a.dequantize() @ b.dequantize()
    generator = torch.Generator(device="cuda").manual_seed(5)
    bias = torch.randn(256, device="cuda", generator=generator) * product.abs().max()
    bias = bias.bfloat16()
    with warnings.catch_warnings():
        _refuse_the_dequantised_fallback()
        actual = fp8_mm(a, b, out_dtype=torch.bfloat16, bias=bias)
    expected = (product + bias.float()).bfloat16()
    torch.testing.assert_close(
        actual, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item()
    )


def test_a_shape_the_kernel_refuses_runs_dequantised_and_says_so(monkeypatch):
    monkeypatch.setattr(gemm, "_reported", set())
    a, b = test_blockwise._linear_operands(40, 144, 208, device="cuda")["fprop"]
    with pytest.warns(UserWarning, match="dequantised fp32 matmuls here"):
        product = fp8_mm(a, b, out_dtype=torch.float32)
    assert torch.equal(product, a.dequantize() @ b.dequantize())


@hopper
def test_a_blockwise_linear_on_cuda_computes_the_reference():
    """The layer's three GEMMs on Hopper (sizes multiples of 128, 272 tokens) against the
    reference of `test_blockwise_training` computed on the CPU."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 384, generator=generator).bfloat16() * 0.05
    bias = torch.randn(256, generator=generator).bfloat16()
    x = (torch.randn(2, 136, 384, generator=generator) * 2).bfloat16()
    grad = (torch.randn(2, 136, 256, generator=generator) * 1e-3).bfloat16()
    expected = test_blockwise_training._reference_gemms(
        x.reshape(-1, 384), weight, bias, grad.reshape(-1, 256)
    )
    weight_cuda = torch.nn.Parameter(weight.cuda())
    bias_cuda = torch.nn.Parameter(bias.cuda())
    x_cuda = x.cuda().requires_grad_()
    y = test_blockwise_training._slots().linear(x_cuda, weight_cuda, bias_cuda)
    y.backward(grad.cuda())
    actuals = (y.reshape(-1, 256), x_cuda.grad.reshape(-1, 384), weight_cuda.grad)
    for actual, reference in zip(actuals, expected):
        reference = reference.to(actual.dtype)
        atol = 2e-2 * reference.abs().max().item()
        torch.testing.assert_close(actual.cpu(), reference, rtol=2e-2, atol=atol)
