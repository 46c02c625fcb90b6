"""Placeholder for a spec slot whose work is done elsewhere (e.g. a norm fused into a linear)."""

from __future__ import annotations

from typing import Any

import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input unchanged; accepts and ignores any constructor arguments.

    Specs use it where a fused neighbour already does the slot's job, e.g. the input layer norm
    when Transformer Engine's `LayerNormLinear` normalises inside the QKV projection.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x
