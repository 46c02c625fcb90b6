"""`num_floating_point_operations` against Megatron-LM's closed forms, computed here by hand."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flops import num_floating_point_operations


def test_gpt_matches_megatrons_closed_form():
    """GPT-3 style (MHA, 4h GELU MLP): Narayanan et al. (2021), without activation recompute:
    72 B s L h^2 (1 + s / 6h + V / 12Lh) (their 96 and V/16Lh count a recompute forward)."""
    B, s, L, h, V = 8, 2048, 24, 2048, 50304
    config = TransformerConfig(num_layers=L, hidden_size=h, num_attention_heads=16)
    expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert num_floating_point_operations(config, V, s, B) == pytest.approx(expected, rel=1e-12)


def test_gqa_swiglu_matches_megatrons_general_formula():
    """Megatron-LM's `num_floating_point_operations` (training.py) for a dense model:
    12 B s L h^2 ((1 + g/n + s/h) q/h + (F/h) 3/2 + V / 2Lh), q = n x head width."""
    B, s, L, h, V = 2, 1024, 4, 512, 32000
    n, g, ffn = 8, 2, 1408
    config = TransformerConfig(
        num_layers=L,
        hidden_size=h,
        num_attention_heads=n,
        num_query_groups=g,
        ffn_hidden_size=ffn,
        gated_linear_unit=True,
        activation_func=F.silu,
    )
    q = n * (h // n)
    expected = (
        12 * B * s * L * h**2 * ((1 + g / n + s / h) * q / h + ffn / h * 3 / 2 + V / (2 * L * h))
    )
    assert num_floating_point_operations(config, V, s, B) == pytest.approx(expected, rel=1e-12)
