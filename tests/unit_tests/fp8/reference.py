"""Plain-torch FP8 references: quantise with a given scale, dequantise by multiplying with its
inverse, multiply in fp32 (the arithmetic `torch._scaled_mm` performs on CPU, bit for bit)."""

from __future__ import annotations

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
