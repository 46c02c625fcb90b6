"""TransformerLayer wiring, TransformerBlock structure and activation recompute."""

import dataclasses

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import (
    _local_mlp_submodules,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

SEQ, BATCH, HIDDEN = 16, 2, 32


def _config(**overrides):
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return TransformerConfig(**{**base, **overrides})


def _block(config, seed=0, **kwargs):
    torch.manual_seed(seed)
    return TransformerBlock(config, get_gpt_layer_local_spec(), **kwargs)


def _add(output_and_bias):
    output, bias = output_and_bias
    return output if bias is None else output + bias


@pytest.mark.parametrize("post_norm_residual", [False, True])
def test_layer_matches_manual_composition(post_norm_residual):
    config = _config(apply_residual_connection_post_layernorm=post_norm_residual)
    layer = _block(config).layers[0].eval()
    with torch.no_grad():
        for module in (layer.input_layernorm, layer.pre_mlp_layernorm):
            module.weight.normal_()
            module.bias.normal_()
    x = torch.randn(SEQ, BATCH, HIDDEN)
    normed = layer.input_layernorm(x)
    h = (normed if post_norm_residual else x) + _add(layer.self_attention(normed))
    normed = layer.pre_mlp_layernorm(h)
    expected = (normed if post_norm_residual else h) + _add(layer.mlp(normed))
    output, context = layer(x)  # Megatron's (hidden_states, context)
    torch.testing.assert_close(output, expected)
    assert context is None  # self-attention only: no cross-attention context


@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["no-dropout", "dropout"])
def test_residual_connections_join_the_output_projections(dropout):
    """Without dropout between them, a training layer hands each block's residual connection to
    its output projection (`adds_residual`), which adds it last: the layer's output and every
    gradient equal the composition with separate adds. With dropout, the layer adds them."""
    config = _config(hidden_dropout=dropout)
    layer = _block(config).layers[0].train()
    assert layer.self_attention.adds_residual and layer.mlp.adds_residual
    handed = []
    for block in (layer.self_attention, layer.mlp):
        block.register_forward_pre_hook(
            lambda module, args, kwargs: handed.append("residual" in kwargs), with_kwargs=True
        )
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    grad = torch.randn(SEQ, BATCH, HIDDEN)
    torch.manual_seed(1)
    output, _ = layer(x)
    output.backward(grad)
    assert handed == [dropout == 0.0] * 2
    if dropout:
        return
    got = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    layer.zero_grad()
    x.grad = None
    h = x + _add(layer.self_attention(layer.input_layernorm(x)))
    expected = h + _add(layer.mlp(layer.pre_mlp_layernorm(h)))
    expected.backward(grad)
    assert torch.equal(output, expected)
    want = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    for name, value in want.items():
        assert torch.equal(got[name], value), name


class _HalvedMLP(MLP):
    """A user's MLP whose forward changes the output after the base class's."""

    def forward(self, hidden_states, **kwargs):
        output, bias = super().forward(hidden_states, **kwargs)
        return output * 0.5, bias


def test_a_block_whose_forward_is_overridden_takes_no_residual():
    """A subclass overriding `forward` does not take the residual (it might drop it, or change
    it with the output): the layer adds it, and the output is the subclass's plus the
    residual. MoE's shared experts, another such subclass, take none either."""
    spec = get_gpt_layer_local_spec()
    spec.submodules.mlp = dataclasses.replace(spec.submodules.mlp, module=_HalvedMLP)
    torch.manual_seed(0)
    layer = TransformerBlock(_config(), spec).layers[0].train()
    assert layer.self_attention.adds_residual and not layer.mlp.adds_residual
    x = torch.randn(SEQ, BATCH, HIDDEN)
    output, _ = layer(x)
    h = x + _add(layer.self_attention(layer.input_layernorm(x)))
    expected = h + _add(layer.mlp(layer.pre_mlp_layernorm(h)))
    assert torch.equal(output, expected)
    shared = SharedExpertMLP(_config(), _local_mlp_submodules())
    assert not shared.adds_residual


def test_block_structure():
    block = _block(_config(num_layers=3))
    assert len(block.layers) == 3
    assert all(isinstance(layer, TransformerLayer) for layer in block.layers)
    assert [layer.layer_number for layer in block.layers] == [1, 2, 3]
    assert isinstance(block.final_layernorm, torch.nn.LayerNorm)
    assert _block(_config(), post_layer_norm=False).final_layernorm is None
    out = block(torch.randn(SEQ, BATCH, HIDDEN))
    assert out.shape == (SEQ, BATCH, HIDDEN)


def test_rms_norm_block():
    block = _block(_config(normalization="RMSNorm"))
    norms = [block.final_layernorm] + [layer.input_layernorm for layer in block.layers]
    assert all(isinstance(norm, torch.nn.RMSNorm) for norm in norms)
    assert torch.isfinite(block(torch.randn(SEQ, BATCH, HIDDEN))).all()


def test_spec_pinned_to_another_normalization_raises():
    with pytest.raises(ValueError, match="normalization"):
        TransformerBlock(_config(), get_gpt_layer_local_spec(normalization="RMSNorm"))


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_gives_the_same_gradients(granularity):
    results = []
    for recompute in (None, granularity):
        # Dropout on, to check that recomputation replays the same masks.
        config = _config(hidden_dropout=0.1, attention_dropout=0.1, recompute_granularity=recompute)
        block = _block(config).train()
        torch.manual_seed(1)
        x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
        out = block(x)
        # Two backward passes through one graph: each recomputes (before: the second raised,
        # its recomputation context was a generator that can be entered once only).
        loss = out.square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        results.append([out.detach(), x.grad] + [p.grad for p in block.parameters()])
    for plain, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, plain)


def test_full_recompute_really_recomputes():
    calls = []
    block = _block(_config(recompute_granularity="full")).train()
    # The layer is called inside the checkpoint, so its forward pre-hooks run in the
    # recomputation too. (Post-forward hooks may not: recomputation stops early once the
    # tensors backward needs exist again.)
    block.layers[0].register_forward_pre_hook(lambda *args: calls.append(1))
    block(torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # once in forward, once more in backward
