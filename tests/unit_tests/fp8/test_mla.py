"""FP8 inside multi-latent attention: every MLA linear (the replicated down-projections too)
runs in FP8, a tiny MLA GPT trained in FP8 equals its fake-quant twin bit for bit, and
"mla_up_proj" recompute casts with the forward's scales (same gradients and amax history)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig
from tests.unit_tests.fp8.reference import exact_cpu_scaled_mm
from tests.unit_tests.fp8.test_model import (
    BF16,
    assert_recompute_changes_nothing,
    assert_trains_as_its_fake_quant_twin,
)
from tests.unit_tests.model_builders import SEQ_LENGTH, VOCAB_SIZE

MLA_LINEARS = (
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
    "linear_proj",
)


def _mla_fp8_gpt(recipe: str = "delayed", **overrides) -> GPTModel:
    """Widths multiples of 16, as FP8 GEMMs need: q_up 16 -> 4 x (16 + 16), kv_down 32 ->
    16 + 16, kv_up 16 -> 4 x (16 + 32), linear_proj 4 x 32 -> 32."""
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=16,
        v_head_dim=32,
        qk_layernorm=True,
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=4,
        fp8="hybrid",
        fp8_recipe=recipe,
        **BF16,
    )
    if recipe == "delayed":
        fields.update(fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    fields.update(overrides)
    config = MLATransformerConfig(**fields)
    torch.manual_seed(1234)
    return GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        position_embedding_type="rope",
    )


def test_every_mla_linear_runs_in_fp8():
    model = _mla_fp8_gpt()
    for layer in model.decoder.layers:
        for name in MLA_LINEARS:
            assert getattr(layer.self_attention, name).fp8 is not None, name


@exact_cpu_scaled_mm
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_mla_gpt_equals_its_fake_quant_twin(recipe):
    assert_trains_as_its_fake_quant_twin(_mla_fp8_gpt(recipe), _mla_fp8_gpt(recipe))


def test_mla_up_proj_recompute_gives_the_same_gradients_and_amax_history():
    recompute = dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"])
    assert_recompute_changes_nothing(_mla_fp8_gpt, recompute)
