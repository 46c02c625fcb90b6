"""`num_floating_point_operations` against Megatron-LM's closed forms, computed here by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.training.flops import num_floating_point_operations


def test_gpt_matches_megatrons_closed_form():
    """GPT-3 style (MHA, 4h GELU MLP): Narayanan et al. (2021), without activation recompute:
    72 B s L h^2 (1 + s / 6h + V / 12Lh) (their 96 and V/16Lh count a recompute forward)."""
    B, s, L, h, V = 8, 2048, 24, 2048, 50304
    config = TransformerConfig(num_layers=L, hidden_size=h, num_attention_heads=16)
    expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert num_floating_point_operations(config, V, s, B) == pytest.approx(expected, rel=1e-12)


def _gqa_config(
    L: int, h: int, n: int, g: int, ffn: int, swiglu: bool, **fields
) -> TransformerConfig:
    """L layers of width h, n heads in g query groups, an MLP of width ffn (SwiGLU or GELU)."""
    return TransformerConfig(
        num_layers=L,
        hidden_size=h,
        num_attention_heads=n,
        num_query_groups=g,
        ffn_hidden_size=ffn,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        **fields,
    )


def test_gqa_swiglu_matches_megatrons_general_formula():
    """Megatron-LM's `num_floating_point_operations` (training.py) for a dense model:
    12 B s L h^2 ((1 + g/n + s/h) q/h + (F/h) 3/2 + V / 2Lh), q = n x head width."""
    B, s, L, h, V = 2, 1024, 4, 512, 32000
    n, g, ffn = 8, 2, 1408
    config = _gqa_config(L, h, n, g, ffn, swiglu=True)
    q = n * (h // n)
    expected = (
        12 * B * s * L * h**2 * ((1 + g / n + s / h) * q / h + ffn / h * 3 / 2 + V / (2 * L * h))
    )
    assert num_floating_point_operations(config, V, s, B) == pytest.approx(expected, rel=1e-12)


def _upstream_mlp_flops(B, s, h, L, ffn, swiglu, moe_pattern, topk, moe_ffn, shared) -> float:
    """Megatron-LM's `transformer_flops` MLP term, as written there: 3 (fwd + 2 bwd) x 2 (FMA)
    x h x (dense layers' ffn + MoE layers' routed and shared experts), per token."""
    num_moe_layers = sum(moe_pattern)
    num_dense_layers = L - num_moe_layers
    ffn_expansion_factor = 3 if swiglu else 2
    per_token = (3 * 2 * h) * (
        ffn * ffn_expansion_factor * num_dense_layers
        + moe_ffn * topk * ffn_expansion_factor * num_moe_layers
        + shared * ffn_expansion_factor * num_moe_layers
    )
    return B * s * per_token


@pytest.mark.parametrize(
    ("swiglu", "freq", "shared"),
    [(True, [0, 1, 1, 1], 48), (False, 2, None), (True, 1, 32)],
)
def test_moe_counts_the_experts_each_token_uses_as_megatron(swiglu, freq, shared):
    """Megatron-LM's formula for an MoE model: dense layers per --moe-layer-freq, top-k routed
    experts of --moe-ffn-hidden-size and the shared experts per MoE layer; attention and
    logits as in `test_gqa_swiglu_matches_megatrons_general_formula`."""
    B, s, L, h, V = 2, 256, 4, 64, 1000
    n, g, ffn, moe_ffn, topk, experts = 4, 2, 160, 24, 2, 8
    config = _gqa_config(
        L,
        h,
        n,
        g,
        ffn,
        swiglu,
        add_bias_linear=False,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_intermediate_size=shared,
        moe_layer_freq=freq,
    )
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(L)]
    q = n * (h // n)
    attention_and_logits = 12 * B * s * L * h**2 * ((1 + g / n + s / h) * q / h + V / (2 * L * h))
    mlp = _upstream_mlp_flops(B, s, h, L, ffn, swiglu, pattern, topk, moe_ffn, shared or 0)
    assert num_floating_point_operations(config, V, s, B) == pytest.approx(
        attention_and_logits + mlp, rel=1e-12
    )


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_mla_counts_the_gemms_a_forward_runs(q_lora_rank):
    """Multi-latent attention: three times the matrix-multiply FLOPs torch counts in one
    forward of the model (its down- and up-projections, scores over qk_head_dim +
    qk_pos_emb_head_dim channels, a context over v_head_dim, with the full-sequence convention
    of the `local` backend's explicit products)."""
    B, s, V = 2, 12, 64
    config = MLATransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=10,
        qk_head_dim=6,
        qk_pos_emb_head_dim=4,
        v_head_dim=5,
        attention_backend=AttnBackend.local,
    )
    model = GPTModel(
        config, get_gpt_decoder_block_spec(config, False), V, s, position_embedding_type="rope"
    )
    tokens = torch.zeros(B, s, dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens)
    assert num_floating_point_operations(config, V, s, B) == 3 * counter.get_total_flops()


@pytest.mark.parametrize("freq", [None, [1, 0, 1], [1, 1, 0]])
def test_mtp_depths_count_as_megatron_counts_them(freq):
    """Megatron-LM's `transformer_flops` with D = --mtp-num-layers: L + D layers, the depths'
    MLPs of the decoder's last layer's kind, 3 x 2 x D (3h + 2h^2) for their norms and eh_proj
    per token, and D + 1 sets of logits."""
    B, s, L, h, V, D = 2, 128, 3, 64, 1000, 2
    n, g, ffn, moe_ffn, topk = 4, 2, 160, 24, 2
    moe = (
        {}
        if freq is None
        else dict(
            num_moe_experts=8,
            moe_router_topk=topk,
            moe_ffn_hidden_size=moe_ffn,
            moe_layer_freq=freq,
        )
    )
    config = _gqa_config(L, h, n, g, ffn, True, add_bias_linear=False, mtp_num_layers=D, **moe)
    pattern = [0] * L if freq is None else freq
    q = n * (h // n)
    attention = 12 * B * s * (L + D) * h**2 * (1 + g / n + s / h) * q / h
    mlp = _upstream_mlp_flops(
        B, s, h, L + D, ffn, True, pattern + [pattern[-1]] * D, topk, moe_ffn, 0
    )
    mtp = 3 * 2 * B * s * D * (3 * h + 2 * h * h)
    logits = 3 * 2 * B * s * h * V * (D + 1)
    assert num_floating_point_operations(config, V, s, B) == pytest.approx(
        attention + mlp + mtp + logits, rel=1e-12
    )
