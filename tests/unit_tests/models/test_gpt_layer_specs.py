"""GPT layer specs: local spec contents, TE spec failing helpfully without TE."""

import importlib.util

import pytest
import torch

from megatron.core.extensions import transformer_engine
from megatron.core.fusions.fused_layer_norm import HAVE_APEX
from megatron.core.models.gpt import (
    GPTModel,
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import (
    TransformerBlockSubmodules,
    TransformerConfig,
    TransformerLayer,
    WrappedTorchNorm,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_block import LayerNormImpl

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def test_local_spec_uses_torch_modules():
    spec = get_gpt_layer_local_spec()
    assert spec.module is TransformerLayer
    submodules = spec.submodules
    assert submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert submodules.self_attention.submodules.linear_proj is RowParallelLinear
    assert submodules.mlp.submodules.linear_fc1 is ColumnParallelLinear
    assert submodules.mlp.submodules.linear_fc2 is RowParallelLinear
    if not HAVE_APEX:
        assert submodules.input_layernorm.module is WrappedTorchNorm


def test_local_spec_rejects_unknown_normalization():
    with pytest.raises(ValueError, match="normalization"):
        get_gpt_layer_local_spec(normalization="BatchNorm")


def _qk_norms(spec, **config) -> list[str]:
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, **config)
    model = GPTModel(config, spec, 64, 8)
    return [name for name, _ in model.named_parameters() if "q_layernorm" in name]


def test_local_spec_takes_upstreams_arguments_in_order():
    """(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8,
    normalization, qk_l2_norm). Before: keyword-only, without the query-key norm arguments."""
    assert _qk_norms(get_gpt_layer_local_spec(None, False, True), qk_layernorm=True)
    assert not _qk_norms(get_gpt_layer_local_spec(None, False, True))  # the config decides
    assert _qk_norms(get_gpt_layer_local_spec(), qk_layernorm=True)  # None follows the config
    # Told there is no norm, a config asking for one is refused (upstream builds none silently).
    for no_norm in (
        get_gpt_layer_local_spec(qk_layernorm=False),
        get_gpt_layer_local_spec(None, False, False, False, None, None, False),
    ):
        with pytest.raises(ValueError, match="asks for query-key norms, but the layer spec"):
            _qk_norms(no_norm, qk_layernorm=True)
    # The fourth: multi-latent attention.
    mla = get_gpt_layer_local_spec(None, False, False, True).submodules.self_attention
    assert mla.module is MLASelfAttention
    with pytest.warns(UserWarning, match="fp8 argument"):
        get_gpt_layer_local_spec(fp8="e4m3")


@pytest.mark.skipif(HAVE_TE, reason="transformer-engine is installed")
def test_te_spec_without_te_explains_how_to_install_or_fall_back():
    with pytest.raises(ImportError) as info:
        get_gpt_layer_with_transformer_engine_spec()
    message = str(info.value)
    assert "transformer-engine" in message
    assert "pip install --no-build-isolation transformer-engine[pytorch]" in message
    assert "--transformer-impl local" in message


@pytest.mark.skipif(HAVE_TE, reason="transformer-engine is installed")
def test_te_wrappers_without_te_raise_import_error():
    from megatron.core.extensions.transformer_engine import TELinear, TENorm

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ImportError, match="transformer-engine"):
        TELinear(8, 8, config=config, init_method=config.init_method)
    with pytest.raises(ImportError, match="transformer-engine"):
        TENorm(config, 8)


def _block_config() -> TransformerConfig:
    return TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4)


def test_local_decoder_block_spec_repeats_the_layer_and_uses_the_local_final_norm():
    config = _block_config()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    assert isinstance(spec, TransformerBlockSubmodules)
    assert len(spec.layer_specs) == 3
    assert all(layer.module is TransformerLayer for layer in spec.layer_specs)
    assert spec.layer_norm is LayerNormImpl
    model = GPTModel(config, spec, vocab_size=64, max_sequence_length=8)
    assert len(model.decoder.layers) == 3
    if not HAVE_APEX:
        assert type(model.decoder.final_layernorm) is torch.nn.LayerNorm


@pytest.mark.skipif(HAVE_TE, reason="transformer-engine is installed")
def test_te_decoder_block_spec_without_te_raises_import_error():
    with pytest.raises(ImportError, match="transformer-engine"):
        get_gpt_decoder_block_spec(_block_config(), use_transformer_engine=True)


@pytest.mark.skipif(not transformer_engine.HAVE_TE, reason="needs transformer-engine")
def test_te_decoder_block_spec_uses_te_norm_for_the_final_norm():
    spec = get_gpt_decoder_block_spec(_block_config(), use_transformer_engine=True)
    assert spec.layer_norm is transformer_engine.TENorm
    assert all(layer.module is TransformerLayer for layer in spec.layer_specs)
