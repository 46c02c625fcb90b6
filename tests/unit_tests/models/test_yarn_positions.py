"""YaRN positions for standard attention (`GPTModel(position_embedding_type="yarn")`, the config's
`yarn_*` fields): the angles against YaRN's frequencies written out here from the paper's and
upstream's formula (float64), a self-attention layer against a plain-torch one that rotates its
queries and keys in halves by those angles with cos and sin times the concentration factor, a
whole GPT against Megatron-core 0.19.2 on the same weights
(`fixtures/make_upstream_yarn_fixture.py`: loss, every gradient, angles, concentration factor),
and what YaRN does not combine with refused by name."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from tests.unit_tests.models.fixtures import yarn_cases
from tests.unit_tests.upstream_parity import assert_matches_golden, case_config

FIXTURE = Path(__file__).parent / "fixtures" / "upstream_yarn.pt"
SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 40, 2, 4, 2, 16


def reference_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original: int,
    beta_fast: float,
    beta_slow: float,
    round_to_int: bool,
) -> torch.Tensor:
    """YaRN's frequencies (float64), "NTK-by-parts" (Peng et al. 2023, section 3.2) as upstream
    and Hugging Face compute it: pair i of RoPE's theta_i = base^(-2i/dim) turns
    L theta_i / (2 pi) times over the original context L; the pair index where that is r is
    dim ln(L / (2 pi r)) / (2 ln base). Pairs below the index of `beta_fast` rotations keep
    theta_i, pairs above that of `beta_slow` take theta_i / s, and the pairs between blend the
    two with a weight linear in the pair index."""
    pairs = torch.arange(dim // 2, dtype=torch.float64)
    theta = base ** (-2 * pairs / dim)

    def index_of(rotations: float) -> float:
        return dim * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(base))

    low, high = index_of(beta_fast), index_of(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    interpolated = ((pairs - low) / (high - low)).clamp(0, 1)
    return theta / factor * interpolated + theta * (1 - interpolated)


def reference_concentration(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's attention temperature sqrt(1/t) = 0.1 ln(s) + 1 (the paper's section 3.4), in
    DeepSeek's generalisation with two coefficients (1 and 0 give the paper's)."""

    def scale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return scale(mscale) / scale(mscale_all_dim)


YARN_CONFIGS = {
    "rounded": dict(
        yarn_rotary_scaling_factor=8.0,
        yarn_original_max_position_embeddings=10,
        yarn_beta_fast=4.0,
        yarn_beta_slow=0.5,
    ),
    "gpt_oss": dict(
        yarn_rotary_scaling_factor=32.0,
        yarn_original_max_position_embeddings=10,
        yarn_beta_fast=32.0,
        yarn_beta_slow=1.0,
        yarn_correction_range_round_to_int=False,
    ),
    "mscales": dict(
        yarn_rotary_scaling_factor=16.0,
        yarn_original_max_position_embeddings=12,
        yarn_beta_fast=8.0,
        yarn_beta_slow=0.25,
        yarn_mscale=0.9,
        yarn_mscale_all_dim=0.4,
        yarn_correction_range_round_to_int=False,
    ),
}
"""YaRN settings over a sequence 4 times their original context: the band rounded or not, the
concentration factor of the factor alone or of two coefficients."""

BASE = 100


def _config(**yarn) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **yarn,
    )


def _gpt(config: TransformerConfig, **kwargs) -> GPTModel:
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=SEQ,
        **{"position_embedding_type": "yarn", "rotary_base": BASE, **kwargs},
    )


@pytest.mark.parametrize("name", sorted(YARN_CONFIGS))
def test_angles_are_yarns_frequencies_in_halves(name):
    yarn = YARN_CONFIGS[name]
    config = _config(**yarn)
    embedding = _gpt(config).rotary_pos_emb
    expected_freq = reference_inv_freq(
        HEAD_DIM,
        BASE,
        config.yarn_rotary_scaling_factor,
        config.yarn_original_max_position_embeddings,
        config.yarn_beta_fast,
        config.yarn_beta_slow,
        config.yarn_correction_range_round_to_int,
    )
    angles = embedding(SEQ)
    assert angles.shape == (SEQ, 1, 1, HEAD_DIM) and angles.dtype == torch.float32
    expected = torch.outer(torch.arange(SEQ, dtype=torch.float64), expected_freq)
    expected = torch.cat([expected, expected], dim=-1)[:, None, None]
    torch.testing.assert_close(angles.double(), expected, rtol=1e-6, atol=1e-5)
    # The interpolation moves the angles: the slowest pair turns s times slower than RoPE's.
    rope_last = SEQ - 1.0
    assert angles[-1, 0, 0, HEAD_DIM // 2 - 1] * config.yarn_rotary_scaling_factor == (
        pytest.approx(rope_last * BASE ** (-(HEAD_DIM - 2) / HEAD_DIM), rel=1e-5)
    )


def _reference_attention(attention, x, angles, mscale):
    """Self-attention written out in float64 from the layer's weights (Megatron's grouped QKV
    layout): queries and keys rotated in halves, t cos + rotate_half(t) sin, with cos and sin
    times `mscale`; causal softmax; the output projection."""
    weight = attention.linear_qkv.weight.double()
    bias = attention.linear_qkv.bias.double()
    mixed = x.double() @ weight.T + bias
    s, b = x.shape[:2]
    per_group = HEADS // GROUPS
    mixed = mixed.view(s, b, GROUPS, (per_group + 2) * HEAD_DIM)
    query, key, value = mixed.split([per_group * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
    query = query.reshape(s, b, HEADS, HEAD_DIM)
    cos, sin = angles.double().cos() * mscale, angles.double().sin() * mscale

    def rotate(t):
        first, second = t.chunk(2, dim=-1)
        return t * cos + torch.cat([-second, first], dim=-1) * sin

    query, key = rotate(query), rotate(key)
    key = key.repeat_interleave(per_group, dim=2)
    value = value.repeat_interleave(per_group, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) / math.sqrt(HEAD_DIM)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    context = torch.einsum("bnst,tbnd->sbnd", probs, value).reshape(s, b, -1)
    return context @ attention.linear_proj.weight.double().T + attention.linear_proj.bias.double()


@pytest.mark.parametrize("name", sorted(YARN_CONFIGS))
def test_self_attention_scales_the_rotated_queries_and_keys(name):
    yarn = YARN_CONFIGS[name]
    config = _config(**yarn)
    mscale = reference_concentration(
        config.yarn_rotary_scaling_factor, config.yarn_mscale, config.yarn_mscale_all_dim
    )
    assert mscale != 1.0
    torch.manual_seed(0)
    attention = build_module(
        get_gpt_layer_local_spec().submodules.self_attention, config=config, layer_number=1
    )
    with torch.no_grad():  # attention far from uniform, so that the scale shows
        attention.linear_qkv.weight.normal_(0.0, 0.3)
        attention.linear_qkv.bias.normal_()
        attention.linear_proj.bias.normal_()
    assert attention.rotary_mscale == pytest.approx(mscale, rel=1e-12)
    angles = _gpt(config).rotary_pos_emb(SEQ)
    x = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, requires_grad=True)
    output, _ = attention(x, rotary_pos_emb=angles)
    expected = _reference_attention(attention, x, angles, mscale)
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(output)
    (actual,) = torch.autograd.grad(output, x, grad)
    (wanted,) = torch.autograd.grad(expected, x, grad.double())
    torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5)  # both in x's fp32
    # Without the concentration factor the layer computes something else.
    unscaled = _reference_attention(attention, x, angles, 1.0)
    assert (unscaled - expected).abs().max() > 1e-2


# --- the same function as Megatron-core 0.19.2 ---


def _local_gpt(case: dict, **overrides) -> GPTModel:
    return GPTModel(
        case_config(case["config"], **overrides),
        get_gpt_layer_local_spec(),
        vocab_size=yarn_cases.VOCAB,
        max_sequence_length=yarn_cases.SEQ,
        position_embedding_type="yarn",
        rotary_base=case["rotary_base"],
    )


@pytest.fixture(scope="module")
def golden() -> dict:
    data = torch.load(FIXTURE)
    assert data["version"] == "0.19.2"
    return data


@pytest.mark.parametrize("name", sorted(yarn_cases.CASES))
def test_gpt_matches_megatron_core_on_the_same_weights(name, golden):
    case, expected = yarn_cases.CASES[name], golden[name]
    model = _local_gpt(case)
    model.load_state_dict(expected["state_dict"])
    torch.testing.assert_close(model.rotary_pos_emb(yarn_cases.SEQ), expected["angles"])
    assert model.rotary_pos_emb.concentration_factor == pytest.approx(
        expected["concentration_factor"], rel=1e-12
    )
    assert model.decoder.layers[0].self_attention.rotary_mscale == pytest.approx(
        expected["concentration_factor"], rel=1e-12
    )
    tokens, labels = yarn_cases.batch(case)
    assert torch.equal(tokens, expected["tokens"]) and torch.equal(labels, expected["labels"])
    assert_matches_golden(model, tokens, labels, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(yarn_cases.CASES))
def test_gpt_on_cuda_with_fused_rope_matches_megatron_core(name, golden):
    """The same comparison on CUDA, the queries and keys rotated (and scaled by the
    concentration factor) in the fused Triton kernel, windows and sinks in FlexAttention."""
    torch._dynamo.reset()
    case, expected = yarn_cases.CASES[name], golden[name]
    model = _local_gpt(case, apply_rope_fusion=True).cuda()
    model.load_state_dict(expected["state_dict"])
    tokens, labels = (t.cuda() for t in yarn_cases.batch(case))
    assert_matches_golden(model, tokens, labels, expected, rtol=1e-4, atol=1e-5)


def test_the_fixture_tells_yarn_from_rope(golden):
    """The same weights with RoPE's positions (no interpolation, no concentration factor) give
    another loss: the comparison above checks YaRN, not only the rest of the model."""
    case = yarn_cases.CASES["yarn"]
    fields, _ = yarn_cases.split_yarn(case["config"])
    model = GPTModel(
        case_config(fields),
        get_gpt_layer_local_spec(),
        vocab_size=yarn_cases.VOCAB,
        max_sequence_length=yarn_cases.SEQ,
        position_embedding_type="rope",
        rotary_base=case["rotary_base"],
    )
    model.load_state_dict(golden["yarn"]["state_dict"])
    tokens, labels = yarn_cases.batch(case)
    loss = model(tokens, labels=labels)
    assert (loss - golden["yarn"]["loss"]).abs().max() > 1e-3


# --- what YaRN does not combine with ---


@pytest.mark.parametrize(
    "kwargs, config_fields, message",
    [
        (dict(rotary_percent=0.5), {}, "rotary_percent=0.5"),
        (dict(rope_scaling=True), {}, "rope_scaling=True"),
        (dict(seq_len_interpolation_factor=2.0), {}, "seq_len_interpolation_factor=2.0"),
        ({}, dict(rotary_interleaved=True), "config.rotary_interleaved=True"),
        (
            dict(position_embedding_type="rope"),
            dict(yarn_rotary_scaling_factor=4.0),
            "config yarn_rotary_scaling_factor=4.0 describes YaRN, but "
            "position_embedding_type='rope'",
        ),
        (
            dict(position_embedding_type="learned_absolute"),
            dict(yarn_correction_range_round_to_int=False),
            "yarn_correction_range_round_to_int=False describes YaRN",
        ),
    ],
)
def test_gpt_model_refuses_what_yarn_does_not_combine_with(kwargs, config_fields, message):
    with pytest.raises(ValueError, match=message):
        _gpt(_config(**config_fields), **kwargs)


def test_multi_latent_attention_keeps_its_own_yarn():
    mla = MLATransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, q_lora_rank=None,
        kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="position_embedding_type='yarn' with multi-latent"):
        GPTModel(mla, get_gpt_layer_local_spec(multi_latent_attention=True), 64, SEQ,
                 position_embedding_type="yarn")  # fmt: skip
    with pytest.raises(ValueError, match="yarn_beta_fast=4.0: the yarn_\\* fields set standard"):
        dataclasses.replace(mla, yarn_beta_fast=4.0)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(yarn_rotary_scaling_factor=0.0), "yarn_rotary_scaling_factor=0.0 must be > 0"),
        (dict(yarn_original_max_position_embeddings=0), "yarn_original_max_position_embeddings"),
        (
            dict(yarn_rotary_scaling_factor=40.0, yarn_mscale_all_dim=-5.0),
            "yarn_mscale_all_dim=-5.0 with yarn_rotary_scaling_factor=40.0 gives a YaRN scale",
        ),
    ],
)
def test_config_refuses_bad_yarn_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        _config(**fields)
