"""Plain-torch FP8 references: quantise with a given scale, dequantise by multiplying with its
inverse, multiply in fp32 with both operands row-major (`mm`): the arithmetic `torch._scaled_mm`
performs on CPU, bit for bit, where its CPU kernel dequantises before an fp32 matmul. On CPUs
with FP16 or AMX units torch hands the GEMM to oneDNN, whose FP8 kernel rounds otherwise: the
tests that compare with these references bit for bit (`exact_cpu_scaled_mm`) run with oneDNN
off, and are skipped where the kernel still rounds otherwise. The blockwise recipe's references
quantise block by block, each block with its own scale, written out from Transformer Engine's
rule."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLT_MAX = torch.finfo(torch.float32).max


def q(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x * scale` in fp32, clamped to `dtype`'s range, cast."""
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def dq(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """`data * scale_inv` in fp32."""
    return data.float() * scale_inv


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` of fp32 matrices as torch 2.13's CPU `_scaled_mm` multiplies its dequantised
    operands: both made contiguous (row-major) first.

    The fp32 GEMM's rounding may depend on the operands' layout, not only their values: on some
    CPUs (MKL on an AVX-512 AMD EPYC) a product of a few rows, such as an expert's with few
    tokens, sums the rows past the last multiple of 4 in another order when `b` is column-major
    (a weight's transposed view), so `xd @ wd.t()` can differ from the kernel's product in the
    last bit."""
    return a.contiguous() @ b.contiguous()


def plain_amax(x: torch.Tensor) -> torch.Tensor:
    """`max |x|` with NaNs skipped (infinities kept), written out."""
    return x.abs().nan_to_num(nan=0.0, posinf=math.inf).max()


def current_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Transformer Engine's current-scaling rule, written out: `max / amax`, 1 for an amax of
    0, inf or NaN, the largest fp32 for an infinite quotient."""
    amax = x.detach().abs().amax().float()
    if amax == 0 or not torch.isfinite(amax):
        return torch.tensor(1.0)
    scale = torch.tensor(torch.finfo(dtype).max) / amax  # a true division, not a reciprocal
    return torch.tensor(FLT_MAX) if torch.isinf(scale) else scale


def cpu_scaled_mm_is_exact() -> bool:
    """Whether torch's CPU `_scaled_mm` here equals the dequantised fp32 product bit for bit."""
    generator = torch.Generator().manual_seed(0)
    scale_a, scale_b = torch.tensor(0.37), torch.tensor(1.9)
    b = torch.randn(48, 64, generator=generator).to(E4M3).t()
    for rows in (64, 7):  # 7: a few rows, where the fp32 GEMM may round by layout (`mm`)
        a = torch.randn(rows, 64, generator=generator).to(E4M3)
        product = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
        if not torch.equal(product, mm(dq(a, scale_a), dq(b, scale_b))):
            return False
    return True


@pytest.fixture
def scaled_mm_without_onednn() -> Iterator[None]:
    """Runs the test with oneDNN off, so that torch's CPU `_scaled_mm` dequantises and multiplies
    in fp32 as the references do; skips it where the kernel still rounds otherwise."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        if not cpu_scaled_mm_is_exact():
            pytest.skip(
                f"torch {torch.__version__}'s CPU _scaled_mm does not round as the dequantised "
                "fp32 product here, even without oneDNN"
            )
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


exact_cpu_scaled_mm = pytest.mark.usefixtures("scaled_mm_without_onednn")
"""For the tests that compare FP8 GEMMs on CPU with the references bit for bit (the fixture is
made visible to them by the package's `conftest.py`)."""


BLOCK = 128


def block_scale(amax: float, dtype: torch.dtype) -> float:
    """Transformer Engine's blockwise scale (`Float8BlockScaling`'s defaults), written out: the
    largest power of 2 at or below the fp32 quotient `max / amax`; 1 for an amax of 0, inf or
    NaN; 2^127 where the quotient overflows fp32."""
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    quotient = (torch.tensor(torch.finfo(dtype).max) / torch.tensor(amax)).item()
    if math.isinf(quotient):
        return 2.0**127
    return 2.0 ** math.floor(math.log2(quotient))


def block_q(
    x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (2-D) quantised block by block, each block by `block_scale` of its largest
    magnitude (NaNs skipped): (the FP8 values, the scales' inverses `[row blocks, column
    blocks]`)."""
    rows, cols = x.shape
    row_blocks, col_blocks = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    data = torch.empty(rows, cols, dtype=dtype)
    scale_inv = torch.empty(row_blocks, col_blocks)
    for i in range(row_blocks):
        for j in range(col_blocks):
            where = (
                slice(i * block[0], (i + 1) * block[0]),
                slice(j * block[1], (j + 1) * block[1]),
            )
            tile = x[where].detach().float()
            scale = torch.tensor(block_scale(plain_amax(tile).item(), dtype))
            data[where] = q(tile, scale, dtype)
            scale_inv[i, j] = scale.reciprocal()
    return data, scale_inv


def block_dq(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`data` in fp32, each block times its scale's inverse."""
    expanded = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return data.float() * expanded[: data.shape[0], : data.shape[1]]


def block_fake_quant(x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]) -> torch.Tensor:
    """`x` quantised in blocks and dequantised, fp32."""
    return block_dq(*block_q(x, dtype, block), block)


def padded_tokens_t(x: torch.Tensor) -> torch.Tensor:
    """`x` (`[tokens, features]`) transposed, with zero columns up to a multiple of 128 tokens:
    what the blockwise weight-gradient GEMM contracts over."""
    tokens = x.shape[0]
    return torch.nn.functional.pad(x.t(), (0, -(-tokens // BLOCK) * BLOCK - tokens))
