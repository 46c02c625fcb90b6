"""Norm factories: torch LayerNorm / RMSNorm from the config, apex guarded."""

import pytest
import torch

from megatron.core.fusions import fused_layer_norm
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(**overrides):
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, **overrides)


@pytest.mark.parametrize(
    "normalization, cls", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)]
)
def test_wrapped_torch_norm_builds_the_configured_norm(normalization, cls):
    config = _config(normalization=normalization, params_dtype=torch.bfloat16, bf16=True)
    norm = WrappedTorchNorm(config, 32, eps=1e-6)
    assert type(norm) is cls
    assert norm.eps == 1e-6
    assert norm.weight.dtype == torch.bfloat16
    assert torch.all(norm.weight == 1)


def test_rms_norm_normalises_the_root_mean_square():
    norm = WrappedTorchNorm(_config(normalization="RMSNorm"), 32)
    x = 3.0 * torch.randn(4, 32)
    rms = norm(x).square().mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(4), rtol=1e-3, atol=1e-3)


def test_spec_normalization_must_match_the_config():
    with pytest.raises(ValueError, match="config.normalization"):
        WrappedTorchNorm(_config(normalization="LayerNorm"), 32, normalization="RMSNorm")


@pytest.mark.skipif(fused_layer_norm.HAVE_APEX, reason="apex is installed")
def test_fused_layer_norm_without_apex_raises_import_error():
    with pytest.raises(ImportError, match="apex"):
        fused_layer_norm.FusedLayerNorm(_config(), 32)
