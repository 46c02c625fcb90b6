"""Plain-torch FP8 references: quantise with a given scale, dequantise by multiplying with its
inverse, multiply in fp32: the arithmetic `torch._scaled_mm` performs on CPU, bit for bit, where
its CPU kernel dequantises before an fp32 matmul (torch 2.13's). Where it does not (torch 2.11
on CPUs whose oneDNN has FP8 matmuls rounds otherwise), `exact_cpu_scaled_mm` skips the tests
that compare with these references bit for bit."""

from __future__ import annotations

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
    a = torch.randn(64, 64, generator=generator).to(E4M3)
    b = torch.randn(48, 64, generator=generator).to(E4M3).t()
    scale_a, scale_b = torch.tensor(0.37), torch.tensor(1.9)
    product = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    return torch.equal(product, dq(a, scale_a) @ dq(b, scale_b))


exact_cpu_scaled_mm = pytest.mark.skipif(
    not cpu_scaled_mm_is_exact(),
    reason="torch's CPU _scaled_mm here does not round as the dequantised fp32 product (torch "
    "2.13's CPU kernel does, bit for bit)",
)
"""For the tests that compare FP8 GEMMs on CPU with the references bit for bit."""
