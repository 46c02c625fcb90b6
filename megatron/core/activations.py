"""MLP activation functions the flags name that PyTorch does not provide (Megatron-LM's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (`--squared-relu`, Primer; So et al. 2021)."""
    return torch.pow(F.relu(x), 2)
