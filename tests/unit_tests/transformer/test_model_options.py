"""Model options against plain PyTorch computations: zero-centred norms, QK norms, squared ReLU,
the attention backends, query-key layer scaling and activation recompute."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import squared_relu
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.torch_norm import (
    L2Norm,
    WrappedTorchNorm,
    ZeroCenteredLayerNorm,
    ZeroCenteredRMSNorm,
)
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, BATCH, HIDDEN, HEADS = 8, 2, 32, 4
HEAD_DIM = HIDDEN // HEADS


def _config(**overrides) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return TransformerConfig(**{**base, **overrides})


def _block(config: TransformerConfig, seed: int = 0) -> TransformerBlock:
    torch.manual_seed(seed)
    return TransformerBlock(config, get_gpt_layer_local_spec())


# --- zero-centred gamma (--apply-layernorm-1p) ---


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centered_norm_equals_norm_with_weight_plus_one(normalization):
    config = _config(normalization=normalization, layernorm_zero_centered_gamma=True)
    norm = WrappedTorchNorm(config, HIDDEN, eps=1e-5)
    expected_cls = ZeroCenteredLayerNorm if normalization == "LayerNorm" else ZeroCenteredRMSNorm
    assert isinstance(norm, expected_cls)
    assert torch.count_nonzero(norm.weight) == 0  # the scale starts at 1 + 0
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    ref_weight = norm.weight.detach().clone().requires_grad_()
    if normalization == "LayerNorm":
        with torch.no_grad():
            norm.bias.normal_()
        ref_bias = norm.bias.detach().clone().requires_grad_()
        expected = F.layer_norm(x, (HIDDEN,), ref_weight + 1, ref_bias, 1e-5)
    else:
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        expected = x * rms * (ref_weight + 1)
    output = norm(x)
    torch.testing.assert_close(output, expected)
    grad = torch.randn_like(output)
    got = torch.autograd.grad(output, (x, norm.weight), grad)
    ref = torch.autograd.grad(expected, (x, ref_weight), grad)
    torch.testing.assert_close(got, ref)


def test_zero_centered_norms_in_every_layer_slot():
    block = _block(_config(layernorm_zero_centered_gamma=True, qk_layernorm=True))
    layer = block.layers[0]
    for norm in (
        layer.input_layernorm,
        layer.pre_mlp_layernorm,
        layer.self_attention.q_layernorm,
        layer.self_attention.k_layernorm,
        block.final_layernorm,
    ):
        assert isinstance(norm, ZeroCenteredLayerNorm)


# --- QK norms ---


def _projected_heads(attention, x):
    """Queries [s, b, nh, d] and keys [s, b, ng, d] straight from the QKV linear (MHA layout:
    per head, query, key, value)."""
    mixed, _ = attention.linear_qkv(x)
    mixed = mixed.view(SEQ, BATCH, HEADS, 3 * HEAD_DIM)
    return mixed[..., :HEAD_DIM], mixed[..., HEAD_DIM : 2 * HEAD_DIM]


def test_qk_layernorm_normalises_each_head():
    attention = _block(_config(qk_layernorm=True)).layers[0].self_attention
    with torch.no_grad():
        for norm in (attention.q_layernorm, attention.k_layernorm):
            norm.weight.normal_()
            norm.bias.normal_()
    x = torch.randn(SEQ, BATCH, HIDDEN)
    query, key, _ = attention.get_query_key_value_tensors(x)
    raw_q, raw_k = _projected_heads(attention, x)
    q_norm, k_norm = attention.q_layernorm, attention.k_layernorm
    expected_q = F.layer_norm(raw_q, (HEAD_DIM,), q_norm.weight, q_norm.bias, 1e-5)
    expected_k = F.layer_norm(raw_k, (HEAD_DIM,), k_norm.weight, k_norm.bias, 1e-5)
    torch.testing.assert_close(query, expected_q)
    torch.testing.assert_close(key, expected_k)


def test_qk_l2_norm_scales_heads_to_unit_rms():
    attention = _block(_config(qk_l2_norm=True)).layers[0].self_attention
    assert not list(attention.q_layernorm.parameters())  # no weight
    x = torch.randn(SEQ, BATCH, HIDDEN)
    query, key, _ = attention.get_query_key_value_tensors(x)
    raw_q, raw_k = _projected_heads(attention, x)
    for got, raw in ((query, raw_q), (key, raw_k)):
        expected = raw / torch.sqrt(raw.pow(2).mean(-1, keepdim=True) + 1e-5)
        torch.testing.assert_close(got, expected)


def test_without_qk_norm_no_modules_are_built():
    attention = _block(_config()).layers[0].self_attention
    assert attention.q_layernorm is None and attention.k_layernorm is None


def test_qk_l2_norm_wins_over_qk_layernorm_as_upstream():
    both = _block(_config(qk_layernorm=True, qk_l2_norm=True)).layers[0].self_attention
    assert isinstance(both.q_layernorm, L2Norm) and isinstance(both.k_layernorm, L2Norm)


# --- squared ReLU ---


def test_squared_relu_mlp():
    mlp = _block(_config(activation_func=squared_relu)).layers[0].mlp
    x = torch.randn(SEQ, BATCH, HIDDEN)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    hidden = torch.clamp(x @ fc1.weight.t() + fc1.bias, min=0) ** 2
    expected = hidden @ fc2.weight.t() + fc2.bias
    output, bias = mlp(x)
    torch.testing.assert_close(output, expected)
    assert bias is None


# --- attention backends and query-key layer scaling ---


def _reference_attention(query, key, value):
    """softmax(q k^T / sqrt(d) + causal mask) v over [s, b, n, d], in float64."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (query, key, value))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    context = (probs @ v).permute(2, 0, 1, 3)
    return context.reshape(SEQ, BATCH, -1)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(attention_backend=AttnBackend.local),
        dict(attention_backend=AttnBackend.local, apply_query_key_layer_scaling=True),
        dict(attention_backend=AttnBackend.local, attention_softmax_in_fp32=False),
        dict(attention_backend=AttnBackend.unfused),
        dict(attention_backend=AttnBackend.auto),
    ],
)
def test_core_attention_backends_match_reference(overrides):
    # Layer 2: query-key layer scaling divides by 2 and multiplies back.
    core = _block(_config(**overrides)).layers[1].self_attention.core_attention
    torch.manual_seed(1)
    query, key, value = (torch.randn(SEQ, BATCH, HEADS, HEAD_DIM) for _ in range(3))
    output = core(query, key, value)
    torch.testing.assert_close(output, _reference_attention(query, key, value).float())


def test_local_attention_softmax_dtype():
    """bf16 inputs: with attention_softmax_in_fp32 the probabilities are computed from fp32
    scores (rounded to bf16 once); without, from bf16 scores."""
    torch.manual_seed(2)
    query, key, value = (
        torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3)
    )
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(HEAD_DIM))
    for in_fp32 in (True, False):
        config = _config(
            attention_backend=AttnBackend.local,
            attention_softmax_in_fp32=in_fp32,
            params_dtype=torch.bfloat16,
            bf16=True,
        )
        core = _block(config).layers[0].self_attention.core_attention
        s = scores.float() if in_fp32 else scores
        probs = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1).to(torch.bfloat16)
        expected = (probs @ v).permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)
        torch.testing.assert_close(core(query, key, value), expected, rtol=0, atol=0)


# --- activation recompute ---


def _grads(config: TransformerConfig, x: torch.Tensor):
    block = _block(config).train()
    calls = []
    for layer in block.layers:
        # A pre-hook: checkpoint's early stop ends a recomputation before post-hooks run.
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    torch.manual_seed(7)  # dropout draws from here: recompute must replay the same masks
    output = block(x)
    output.backward(torch.ones_like(output) / output.numel())
    grads = {name: p.grad for name, p in block.named_parameters()}
    return output.detach(), grads, len(calls)


RECOMPUTE_CASES = {
    "full_uniform_1": (dict(recompute_granularity="full"), 8),
    "full_uniform_2": (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        8,
    ),
    "full_uniform_3_of_4": (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
        8,
    ),
    "full_block_1": (
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        5,
    ),
    "full_block_3": (
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
        7,
    ),
    "selective_core_attn": (dict(recompute_granularity="selective"), 4),
    "selective_mlp": (dict(recompute_granularity="selective", recompute_modules=["mlp"]), 4),
    "selective_layernorm": (
        dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
        4,
    ),
    "selective_all": (
        dict(
            recompute_granularity="selective",
            recompute_modules=["core_attn", "mlp", "layernorm"],
        ),
        4,
    ),
}


@pytest.mark.parametrize("case", RECOMPUTE_CASES)
def test_recompute_gives_the_gradients_of_no_recompute(case):
    overrides, expected_layer_calls = RECOMPUTE_CASES[case]
    base = dict(num_layers=4, hidden_dropout=0.2, attention_dropout=0.2)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    ref_out, ref_grads, ref_calls = _grads(_config(**base), x)
    out, grads, calls = _grads(_config(**base, **overrides), x)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    # Full recompute runs the recomputed layers' forwards again in backward.
    assert ref_calls == 4
    assert calls == expected_layer_calls


@pytest.mark.parametrize("module", ["core_attn", "mlp", "layernorm"])
def test_selective_recompute_reruns_the_module(module):
    config = _config(recompute_granularity="selective", recompute_modules=[module])
    layer = _block(config).layers[0].train()
    target = {
        "core_attn": layer.self_attention.core_attention,
        "mlp": layer.mlp,
        "layernorm": layer.input_layernorm,
    }[module]
    calls = []
    target.register_forward_pre_hook(lambda *_: calls.append(1))
    output, _ = layer(torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True))
    assert len(calls) == 1
    output.sum().backward()
    assert len(calls) == 2


def test_selective_recompute_is_decided_at_construction():
    """What each layer recomputes is set once; a norm fused into the next linear (`IdentityOp`,
    the Transformer Engine spec's slots) is not checkpointed, as in Megatron-LM."""
    config = _config(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = IdentityOp
    layer = build_module(spec, config=config).train()
    assert not layer.recompute_input_layernorm
    assert layer.recompute_pre_mlp_layernorm and layer.recompute_mlp
    assert not layer.self_attention.recompute_core_attention
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    assert layer(x)[0].grad_fn is not None
    plain = _block(_config()).layers[0]
    assert not (plain.recompute_pre_mlp_layernorm or plain.recompute_mlp)
    assert not plain.self_attention.recompute_core_attention


def test_recompute_chunks():
    def chunks(**overrides):
        config = _config(num_layers=5, recompute_granularity="full", **overrides)
        return _block(config).recompute_chunks()

    assert chunks() == [(i, i + 1, True) for i in range(5)]
    uniform = chunks(recompute_method="uniform", recompute_num_layers=2)
    assert uniform == [(0, 2, True), (2, 4, True), (4, 5, True)]
    block = chunks(recompute_method="block", recompute_num_layers=2)
    assert block == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert chunks(recompute_method="block", recompute_num_layers=5)[-1] == (4, 5, True)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
            "'moe_act' is not built",
        ),
        (
            dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
            "multi-latent",
        ),
        (dict(recompute_granularity="selective", recompute_modules=["attn"]), "'attn' is unknown"),
        (dict(recompute_granularity="selective", recompute_method="uniform"), "'full' only"),
        (
            dict(recompute_granularity="full", recompute_method="block"),
            "needs recompute_num_layers",
        ),
        (
            dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
            "exceeds num_layers",
        ),
        (dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te"), "'te' is refused"),
        (dict(attention_backend="flash"), "must be an AttnBackend"),
    ],
)
def test_config_rejects(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


def test_recompute_modules_default_is_core_attn():
    assert _config().recompute_modules == ["core_attn"]
