"""MLP activation functions the flags name that PyTorch does not provide (Megatron-LM's), and the
gated linear unit with gpt-oss's offset and clamp."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

QUICK_GELU_ALPHA = 1.702
"""The slope of quick GELU's sigmoid (GELU(x) ~ x * sigmoid(1.702 x), Hendrycks & Gimpel)."""


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (`--squared-relu`, Primer; So et al. 2021)."""
    return torch.pow(F.relu(x), 2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): the sigmoid approximation of GELU gpt-oss gates its MLP with
    (`--quick-geglu`)."""
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


def gated_linear_unit(
    x: torch.Tensor,
    activation_func: Callable[[torch.Tensor], torch.Tensor],
    linear_offset: float = 0.0,
    clamp_value: float | None = None,
) -> torch.Tensor:
    """act(gate) * (linear + linear_offset) over the halves `[gate | linear]` of `x`'s last
    dimension, as Megatron-core's unfused GLU.

    With `clamp_value` c (gpt-oss's clamped GLU) the gate is first clamped from above at c and the
    linear half to [-c, c]; the clamps pass no gradient where they cut (c itself included in the
    range, as `torch.clamp`).

    Args:
        x: [..., 2 * ffn], the gate half first.
        activation_func: The gate's activation (SiLU for SwiGLU, `quick_gelu` for gpt-oss).
        linear_offset: Added to the linear half (`glu_linear_offset`; gpt-oss uses 1).
        clamp_value: The clamp c (`activation_func_clamp_value`); None: no clamp.

    Returns:
        [..., ffn].
    """
    gate, linear = torch.chunk(x, 2, dim=-1)
    if clamp_value is not None:
        gate = gate.clamp(max=clamp_value)
        linear = linear.clamp(min=-clamp_value, max=clamp_value)
    if linear_offset != 0.0:
        linear = linear + linear_offset
    return activation_func(gate) * linear
