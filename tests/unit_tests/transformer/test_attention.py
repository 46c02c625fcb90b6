"""SelfAttention / DotProductAttention against independent references."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, BATCH, HIDDEN, HEADS = 16, 2, 32, 4
HEAD_DIM = HIDDEN // HEADS


def _config(**overrides):
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return TransformerConfig(**{**base, **overrides})


def _attention(config, seed=0):
    torch.manual_seed(seed)
    attention = build_module(
        get_gpt_layer_local_spec().submodules.self_attention, config=config, layer_number=1
    )
    with torch.no_grad():  # non-zero biases, so that their layout is checked too
        attention.linear_qkv.bias.normal_()
        attention.linear_proj.bias.normal_()
    return attention


def _count_forward_calls(module):
    """A list that grows by one each time `module` is called (forward pre-hook)."""
    calls = []
    module.register_forward_pre_hook(lambda *args: calls.append(1))
    return calls


def _run(attention, x, **kwargs):
    output, bias = attention(x, **kwargs)
    assert bias is None  # the projection adds its own bias
    return output


def test_mha_matches_torch_multihead_attention():
    attention = _attention(_config()).eval()
    # Megatron's layout with one head per group: per head [q, k, v] blocks of HEAD_DIM rows.
    weight = attention.linear_qkv.weight.detach().view(HEADS, 3, HEAD_DIM, HIDDEN)
    bias = attention.linear_qkv.bias.detach().view(HEADS, 3, HEAD_DIM)
    reference = torch.nn.MultiheadAttention(HIDDEN, HEADS)
    with torch.no_grad():
        reference.in_proj_weight.copy_(weight.transpose(0, 1).reshape(3 * HIDDEN, HIDDEN))
        reference.in_proj_bias.copy_(bias.transpose(0, 1).reshape(3 * HIDDEN))
        reference.out_proj.weight.copy_(attention.linear_proj.weight)
        reference.out_proj.bias.copy_(attention.linear_proj.bias)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    expected, _ = reference(x, x, x, attn_mask=causal, need_weights=False)
    torch.testing.assert_close(_run(attention, x), expected)


@pytest.mark.parametrize("groups", [1, 2])
def test_gqa_equals_mha_with_shared_key_value_heads(groups):
    """Query head j reads key/value group j // (heads / groups), Megatron's grouping."""
    gqa = _attention(_config(num_query_groups=groups)).eval()
    mha = _attention(_config()).eval()
    per_group = HEADS // groups
    gqa_weight = gqa.linear_qkv.weight.detach().view(groups, per_group + 2, HEAD_DIM, HIDDEN)
    gqa_bias = gqa.linear_qkv.bias.detach().view(groups, per_group + 2, HEAD_DIM)
    group_of_head = torch.arange(HEADS) // per_group
    index_in_group = torch.arange(HEADS) % per_group

    def as_mha(t):
        q = t[group_of_head, index_in_group]
        k = t[group_of_head, per_group]
        v = t[group_of_head, per_group + 1]
        return torch.stack([q, k, v], dim=1).flatten(0, 2)

    with torch.no_grad():
        mha.linear_qkv.weight.copy_(as_mha(gqa_weight))
        mha.linear_qkv.bias.copy_(as_mha(gqa_bias))
        mha.linear_proj.load_state_dict(gqa.linear_proj.state_dict())
    x = torch.randn(SEQ, BATCH, HIDDEN)
    out = _run(gqa, x)
    assert out.shape == (SEQ, BATCH, HIDDEN)
    assert gqa.linear_qkv.weight.shape == ((HEADS + 2 * groups) * HEAD_DIM, HIDDEN)
    torch.testing.assert_close(out, _run(mha, x))


def test_explicit_mask_follows_megatron_convention():
    attention = _attention(_config(num_query_groups=2)).eval()
    x = torch.randn(SEQ, BATCH, HIDDEN)
    causal = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked out
    torch.testing.assert_close(_run(attention, x, attention_mask=causal), _run(attention, x))
    full = torch.zeros_like(causal)
    assert not torch.allclose(_run(attention, x, attention_mask=full), _run(attention, x))


def test_local_attention_keeps_queries_masked_entirely_finite():
    """Left padding masks every key of the first queries: Megatron-core's fill (-10000) makes
    them attend evenly (before: -inf, NaN that spread to every position of the sample); the
    other queries match SDPA's math kernel."""
    x = torch.randn(SEQ, BATCH, HIDDEN)
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    mask[0, :, :, :4] = True  # sample 0: its first 4 tokens are padding
    outputs = {
        backend.name: _run(
            _attention(_config(attention_backend=backend)).eval(), x, attention_mask=mask
        )
        for backend in (AttnBackend.local, AttnBackend.unfused)
    }
    assert torch.isfinite(outputs["local"]).all()
    torch.testing.assert_close(outputs["local"][4:], outputs["unfused"][4:])


@pytest.mark.parametrize("backend", [AttnBackend.local, AttnBackend.unfused])
def test_softmax_scale_replaces_the_default_scale(backend):
    """`softmax_scale` on every backend, against torch's causal attention with that scale."""
    attention = DotProductAttention(_config(attention_backend=backend, softmax_scale=0.7)).eval()
    q, k, v = (torch.randn(SEQ, BATCH, HEADS, HEAD_DIM) for _ in range(3))
    expected = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, scale=0.7
    )
    expected = expected.permute(2, 0, 1, 3).reshape(SEQ, BATCH, HEADS * HEAD_DIM)
    torch.testing.assert_close(attention(q, k, v), expected)


def test_rotary_embeddings_change_attention_but_not_shapes():
    attention = _attention(_config(num_query_groups=2)).eval()
    x = torch.randn(SEQ, BATCH, HIDDEN)
    angles = RotaryEmbedding(HEAD_DIM)(SEQ)
    with_rope = _run(attention, x, rotary_pos_emb=angles)
    assert with_rope.shape == (SEQ, BATCH, HIDDEN)
    assert torch.isfinite(with_rope).all()
    assert not torch.allclose(with_rope, _run(attention, x))


def test_selective_recompute_gives_the_same_gradients_and_really_recomputes():
    grads, core_attention_calls = [], []
    for granularity in (None, "selective"):
        config = _config(attention_dropout=0.2, recompute_granularity=granularity)
        attention = _attention(config).train()
        # The core attention is called inside the checkpoint, so its pre-hooks also run when
        # backward recomputes it; equal gradients alone would pass with no recompute at all.
        calls = _count_forward_calls(attention.core_attention)
        torch.manual_seed(1)
        x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
        _run(attention, x).square().sum().backward()
        grads.append([x.grad] + [p.grad for p in attention.parameters()])
        core_attention_calls.append(len(calls))
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain)
    # Once per step without recompute; with it, once in forward and once more in backward.
    assert core_attention_calls == [1, 2]


def test_attention_dropout_is_active_only_in_training():
    attention = _attention(_config(attention_dropout=0.5))
    x = torch.randn(SEQ, BATCH, HIDDEN)
    attention.eval()
    torch.testing.assert_close(_run(attention, x), _run(attention, x))
    attention.train()
    assert not torch.allclose(_run(attention, x), _run(attention, x))


def test_a_context_parallel_size_without_its_group_is_refused():
    # No parallel_state and no pg_collection: the cp group has one rank, not the config's 2.
    with pytest.raises(ValueError, match=r"context_parallel_size \(2\) differs from the size"):
        DotProductAttention(_config(context_parallel_size=2))
