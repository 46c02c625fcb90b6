"""MLP: plain and gated (SwiGLU) against a hand-written computation."""

import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig


def _mlp(**overrides):
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, **overrides
    )
    torch.manual_seed(0)
    mlp = build_module(get_gpt_layer_local_spec().submodules.mlp, config=config)
    with torch.no_grad():
        for linear in (mlp.linear_fc1, mlp.linear_fc2):
            if linear.bias is not None:
                linear.bias.normal_()
    return mlp


def test_plain_mlp():
    mlp = _mlp()
    x = torch.randn(16, 2, 32)
    output, bias = mlp(x)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    expected = F.gelu(x @ fc1.weight.T + fc1.bias) @ fc2.weight.T + fc2.bias
    torch.testing.assert_close(output, expected)
    assert bias is None  # fc2 adds its own bias


def test_swiglu_mlp():
    mlp = _mlp(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    assert fc1.weight.shape == (2 * 48, 32) and fc2.weight.shape == (32, 48)
    assert fc1.bias is None and fc2.bias is None
    x = torch.randn(16, 2, 32)
    gate_weight, up_weight = fc1.weight[:48], fc1.weight[48:]
    expected = (F.silu(x @ gate_weight.T) * (x @ up_weight.T)) @ fc2.weight.T
    output, bias = mlp(x)
    assert bias is None
    torch.testing.assert_close(output, expected)
