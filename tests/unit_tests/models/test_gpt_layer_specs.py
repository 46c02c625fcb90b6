"""GPT layer specs: local spec contents, TE spec failing helpfully without TE."""

import importlib.util

import pytest

from megatron.core.fusions.fused_layer_norm import HAVE_APEX
from megatron.core.models.gpt import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import Linear, TransformerLayer, WrappedTorchNorm

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def test_local_spec_uses_torch_modules():
    spec = get_gpt_layer_local_spec()
    assert spec.module is TransformerLayer
    submodules = spec.submodules
    assert submodules.self_attention.submodules.linear_qkv is Linear
    assert submodules.mlp.submodules.linear_fc2 is Linear
    if not HAVE_APEX:
        assert submodules.input_layernorm.module is WrappedTorchNorm


def test_local_spec_rejects_unknown_normalization():
    with pytest.raises(ValueError, match="normalization"):
        get_gpt_layer_local_spec(normalization="BatchNorm")


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
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ImportError, match="transformer-engine"):
        TELinear(8, 8, config=config, init_method=config.init_method)
    with pytest.raises(ImportError, match="transformer-engine"):
        TENorm(config, 8)
