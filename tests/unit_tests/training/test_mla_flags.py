"""The multi-latent attention flags: each reaches its `MLATransformerConfig` field with
upstream's defaults, the YaRN flags set MLA's YaRN, and what MLA does not combine with (or what
describes MLA in a run without it) is refused by name, every such flag in one message."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.training.arguments import core_transformer_config_from_args
from tests.unit_tests.training.flag_checks import validated

MLA = "--multi-latent-attention"

MLA_CONFIG_CASES = [
    ("--q-lora-rank 16", "q_lora_rank", 16),
    ("--kv-lora-rank 24", "kv_lora_rank", 24),
    ("--qk-head-dim 8", "qk_head_dim", 8),
    ("--qk-pos-emb-head-dim 6", "qk_pos_emb_head_dim", 6),
    ("--v-head-dim 12", "v_head_dim", 12),
    ("--rotary-scaling-factor 40", "rotary_scaling_factor", 40.0),
    ("--mscale 0.7", "mscale", 0.7),
    ("--mscale-all-dim 0.7", "mscale_all_dim", 0.7),
    ("--rope-type rope", "rope_type", "rope"),
    ("--rope-type rope --rotary-base 500", "rotary_base", 500),
    ("--rope-type rope --rotary-percent 0.5", "rotary_percent", 0.5),
    ("--yarn-original-max-position-embeddings 16", "original_max_position_embeddings", 16),
    ("--yarn-beta-fast 16", "beta_fast", 16.0),
    ("--yarn-beta-slow 2", "beta_slow", 2.0),
    ("--qk-layernorm", "qk_layernorm", True),
]
"""Flags (after --multi-latent-attention), the field each sets, and the value."""

_REFUSED_FIELDS = {"multi_latent_attention", "cache_mla_latents", "mla_down_proj_fusion"}
"""MLA's own fields not set by a value flag: the switch itself, and two whose flags are
refused (not built)."""


@pytest.mark.parametrize("flags, field, value", MLA_CONFIG_CASES)
def test_mla_flag_reaches_its_config_field(flags, field, value):
    config = core_transformer_config_from_args(validated(MLA, *flags.split()))
    assert isinstance(config, MLATransformerConfig)
    assert getattr(config, field) == value
    baseline = core_transformer_config_from_args(validated(MLA))
    assert getattr(baseline, field) != value, "the flags must change the field"


def test_every_field_of_mla_has_a_flag():
    own = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    own -= {f.name for f in dataclasses.fields(TransformerConfig)}
    covered = {field for _, field, _ in MLA_CONFIG_CASES}
    assert own - _REFUSED_FIELDS <= covered
    assert own & _REFUSED_FIELDS == _REFUSED_FIELDS - {"multi_latent_attention"}


def test_mla_defaults_are_upstreams_flag_defaults():
    """Upstream's parser defaults where it has a flag (--kv-lora-rank 32, no query compression,
    --rotary-scaling-factor 1), MLATransformerConfig's for the rest (YaRN, its band over
    4096 positions); the filled values are spelled in args, so runs compare equal."""
    args = validated(MLA)
    config = core_transformer_config_from_args(args)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim) == (None, 32, 128)
    assert (config.qk_pos_emb_head_dim, config.v_head_dim) == (64, 128)
    assert (config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (1.0, 1.0, 0.0)
    assert config.rope_type == args.rope_type == "yarn"
    assert (args.yarn_original_max_position_embeddings, args.yarn_beta_fast) == (4096, 32)
    assert args.yarn_beta_slow == 1
    assert config.normalization == "LayerNorm"  # the flag's default, as upstream's config gets
    assert validated(MLA, "--yarn-correction-range-round-to-int").multi_latent_attention


def test_mla_flags_without_mla_are_refused_together():
    with pytest.raises(ValueError) as error:
        validated(
            "--q-lora-rank", "8", "--mscale", "0.5", "--yarn-beta-fast", "4",
            "--rope-type", "yarn", "--recompute-granularity", "selective",
            "--recompute-modules", "mla_up_proj",
        )  # fmt: skip
    message = str(error.value)
    for given in ("--q-lora-rank 8", "--mscale 0.5", "--yarn-beta-fast 4.0", "--rope-type yarn"):
        assert given in message
    assert "these set multi-latent attention, which this run does not use" in message
    assert "--recompute-modules mla_up_proj recomputes multi-latent attention's" in message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            "--group-query-attention --num-query-groups 2",
            "--group-query-attention with --multi-latent-attention: MLA has no query groups",
        ),
        ("--position-embedding-type rope --use-rope-scaling", "--use-rope-scaling with --multi"),
        (
            "--position-embedding-type rope --rotary-seq-len-interpolation-factor 2",
            "--rotary-seq-len-interpolation-factor with --multi-latent-attention",
        ),
        ("--qk-pos-emb-head-dim 5", r"--qk-pos-emb-head-dim \(5\) must be even"),
        ("--rotary-percent 0.5", "--rotary-percent 0.5 applies to --rope-type rope"),
        ("--position-embedding-type rope --rotary-interleaved", "--rotary-interleaved: MLA"),
        ("--qk-l2-norm", "--qk-l2-norm: Llama-4's query-key norm"),
        (
            "--mscale-all-dim -20 --rotary-scaling-factor 40",
            "--mscale-all-dim -20.0 with --rotary-scaling-factor 40.0",
        ),
        ("--yarn-beta-slow 0", "--yarn-beta-slow 0.0 must be > 0"),
        ("--cache-mla-latents", "--cache-mla-latents: multi-latent attention's latent cache"),
        (
            "--transformer-impl transformer_engine",
            "--transformer-impl transformer_engine with --multi-latent-attention: MLA is built",
        ),
        ("--no-yarn-correction-range-round-to-int", "YaRN without rounding its band's ends"),
    ],
)
def test_what_mla_does_not_combine_with_is_refused_by_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        validated(MLA, *flags.split())


def test_mla_up_proj_recompute_is_accepted_with_mla():
    args = validated(
        MLA,
        "--recompute-granularity",
        "selective",
        "--recompute-modules",
        "mla_up_proj",
        "core_attn",
    )
    config = core_transformer_config_from_args(args)
    assert config.recompute_modules == ["mla_up_proj", "core_attn"]
