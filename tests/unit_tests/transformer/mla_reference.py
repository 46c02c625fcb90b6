"""Multi-latent attention written from the DeepSeek-V2/V3 papers and DeepSeek's inference code,
in plain torch (float64, dense causal mask, explicit softmax): the reference of the MLA tests.

It takes the weights by Megatron-core's names, batch-first input [b, s, h], and rotates the
positional channels as DeepSeek does: adjacent pairs as complex numbers times e^{i theta}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MLAShape:
    """The fields of an MLA config the reference reads."""

    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    rope_type: str = "yarn"
    rotary_base: float = 10000.0
    rotary_scaling_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    eps: float = 1e-5


def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(shape: MLAShape) -> torch.Tensor:
    """Radians per position of each channel pair: RoPE's, or YaRN's (DeepSeek's
    `precompute_freqs_cis`: the slow pairs divided by the factor, a linear ramp between)."""
    dim, base = shape.qk_pos_emb_head_dim, shape.rotary_base
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if shape.rope_type == "rope":
        return freqs

    def correction_dim(rotations: float) -> float:
        length = shape.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(shape.beta_fast)), 0)
    high = min(math.ceil(correction_dim(shape.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / shape.rotary_scaling_factor * (1 - smooth) + freqs * smooth


def rotate(x: torch.Tensor, freqs: torch.Tensor, scale: float) -> torch.Tensor:
    """x [b, s, ..., d] times e^{i pos freq} on its adjacent channel pairs, times `scale`."""
    positions = torch.arange(x.shape[1], dtype=torch.float64)
    angles = torch.outer(positions, freqs)  # [s, d/2]
    cis = torch.polar(torch.full_like(angles, scale), angles)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    cis = cis.view(1, x.shape[1], *([1] * (x.dim() - 3)), -1)
    return torch.view_as_real(pairs * cis).flatten(-2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight is None:
        return x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def mla_reference(
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    shape: MLAShape,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal MLA of x [b, s, h] (float64) with `weights` (Megatron-core's names, without the
    module prefix): [b, s, h]. `attention_mask` [s, s] (True = masked) replaces the causal
    mask."""
    b, s, _ = x.shape
    n, dk, dr, dv = shape.heads, shape.qk_head_dim, shape.qk_pos_emb_head_dim, shape.v_head_dim

    def w(name: str) -> torch.Tensor | None:
        value = weights.get(name)
        return None if value is None else value.double()

    if shape.q_lora_rank is None:
        q = x @ w("linear_q_proj.weight").T
    else:
        c_q = rms_norm(x @ w("linear_q_down_proj.weight").T, w("q_layernorm.weight"), shape.eps)
        q = c_q @ w("linear_q_up_proj.weight").T
    q = q.view(b, s, n, dk + dr)
    q_nope, q_pe = q.split([dk, dr], dim=-1)

    compressed = x @ w("linear_kv_down_proj.weight").T
    c_kv, k_pe = compressed.split([shape.kv_lora_rank, dr], dim=-1)
    kv = rms_norm(c_kv, w("kv_layernorm.weight"), shape.eps) @ w("linear_kv_up_proj.weight").T
    k_nope, v = kv.view(b, s, n, dk + dv).split([dk, dv], dim=-1)

    freqs = rope_frequencies(shape)
    concentration = 1.0
    if shape.rope_type == "yarn":
        factor = shape.rotary_scaling_factor
        concentration = yarn_get_mscale(factor, shape.mscale) / yarn_get_mscale(
            factor, shape.mscale_all_dim
        )
    q_pe = rotate(q_pe, freqs, concentration)
    k_pe = rotate(k_pe, freqs, concentration)  # [b, s, dr]: one rotated key for every head

    query = torch.cat([q_nope, q_pe], dim=-1)
    key = torch.cat([k_nope, k_pe.unsqueeze(2).expand(b, s, n, dr)], dim=-1)
    softmax_scale = yarn_get_mscale(shape.rotary_scaling_factor, shape.mscale_all_dim) ** 2
    softmax_scale /= math.sqrt(dk + dr)
    scores = torch.einsum("bsnd,btnd->bnst", query, key) * softmax_scale
    if attention_mask is None:
        attention_mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(attention_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    context = torch.einsum("bnst,btnd->bsnd", probs, v).reshape(b, s, n * dv)
    out = context @ w("linear_proj.weight").T
    bias = w("linear_proj.bias")
    return out if bias is None else out + bias
