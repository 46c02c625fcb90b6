"""Sliding-window attention and softmax sinks against a plain-torch reference written here (a dense
mask, an explicit softmax with the sink logit in its denominator), forward and backward, the
sinks' gradients included; the layers `window_attn_skip_freq` picks; the block-sparse mask
FlexAttention runs on; and a gpt-oss-style GPT against Megatron-core 0.19.2 on the same weights
(`fixtures/make_upstream_gpt_oss_fixture.py`). FlexAttention itself runs with autograd on CUDA
only: its backward is checked by the `gpu` tests, its forward on the CPU too."""

from __future__ import annotations

import math
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask, flex_attention

from megatron.core.activations import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import flex_attention as flex_module
from megatron.core.transformer.attention_window import (
    causal_window_mask,
    causal_window_mask_mod,
    is_layer_window_attention,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.softmax_sinks import rescale_by_sink, softmax_with_sink
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.transformer.fixtures import gpt_oss_cases
from tests.unit_tests.upstream_parity import assert_matches_golden, case_config

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 12, 2, 4, 2, 8
CUDA_SEQ, CUDA_HEAD_DIM = 300, 16  # a partial last block of 128; FlexAttention's narrowest head
FIXTURE = Path(__file__).parent / "fixtures" / "upstream_gpt_oss.pt"
NEG_INF = float("-inf")


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    left: int | None,
    sinks: torch.Tensor | None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over [b, n, s, d] queries and [b, g, s, d] keys/values written out: query i
    sees keys j <= i (and j >= i - left with a window; where `allowed` [b, s, s] says so);
    p_ij = e^{s_ij} / (sum_k e^{s_ik} + e^{sink}), the sink term left out without sinks."""
    heads, groups = query.shape[1], key.shape[1]
    key = key.repeat_interleave(heads // groups, dim=1)
    value = value.repeat_interleave(heads // groups, dim=1)
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    i = torch.arange(query.shape[2], device=query.device).view(-1, 1)
    j = torch.arange(query.shape[2], device=query.device).view(1, -1)
    visible = j <= i
    if left is not None:
        visible = visible & (j >= i - left)
    if allowed is not None:
        visible = visible & allowed[:, None]
    scores = scores.masked_fill(~visible, NEG_INF)
    peak = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        peak = torch.maximum(peak, sinks.view(1, -1, 1, 1))
    weights = torch.exp(scores - peak)
    denominator = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks.view(1, -1, 1, 1) - peak)
    return (weights / denominator) @ value


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return TransformerConfig(**{**fields, **overrides})


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Queries [b, n, s, d] and keys, values [b, g, s, d], scaled so that scores vary."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, HEADS, SEQ, HEAD_DIM)] + 2 * [(BATCH, GROUPS, SEQ, HEAD_DIM)]
    return tuple(2 * torch.randn(shape, generator=generator).requires_grad_() for shape in shapes)


def _core_layout(t: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] -> the core attention's [s, b, n, d]."""
    return t.permute(2, 0, 1, 3)


WINDOWS = [None, (0, 0), (1, 0), (3, -1), (SEQ + 5, 0), (-1, 0), (-1, -1)]
SOFTMAX_TYPES = ["vanilla", "off-by-one", "learnable"]


@pytest.mark.parametrize("backend", [AttnBackend.auto, AttnBackend.local])
@pytest.mark.parametrize("softmax_type", SOFTMAX_TYPES)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_core_attention_matches_the_reference_forward_and_backward(window, softmax_type, backend):
    config = _config(window_size=window, softmax_type=softmax_type, attention_backend=backend)
    torch.manual_seed(0)
    attention = DotProductAttention(config, layer_number=1)
    if softmax_type == "learnable":
        assert attention.softmax_offset.shape == (HEADS,)
        with torch.no_grad():
            attention.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 4.0]))
        sinks = attention.softmax_offset.detach().clone().requires_grad_()
    else:
        assert attention.softmax_offset is None
        sinks = torch.zeros(HEADS) if softmax_type == "off-by-one" else None
    query, key, value = _inputs()
    output = attention(*(_core_layout(t) for t in (query, key, value)))
    left = None if window is None or window[0] == -1 else window[0]
    expected = reference_attention(query, key, value, left, sinks)
    torch.testing.assert_close(output, _core_layout(expected).reshape(SEQ, BATCH, -1))

    grad = torch.randn_like(output)
    actual_grads = torch.autograd.grad(output, (query, key, value), grad, retain_graph=True)
    expected_grads = torch.autograd.grad(expected, (query, key, value), _from_core(grad))
    for name, actual, wanted in zip("qkv", actual_grads, expected_grads):
        torch.testing.assert_close(actual, wanted, msg=f"d{name}")
    if softmax_type == "learnable":
        (actual_sink_grad,) = torch.autograd.grad(output, attention.softmax_offset, grad)
        (sink_grad,) = torch.autograd.grad(
            reference_attention(query, key, value, left, sinks), sinks, _from_core(grad)
        )
        assert sink_grad.abs().min() > 0
        torch.testing.assert_close(actual_sink_grad, sink_grad)


def _from_core(grad: torch.Tensor) -> torch.Tensor:
    """[s, b, n * d] -> [b, n, s, d]."""
    return grad.view(SEQ, BATCH, HEADS, HEAD_DIM).permute(1, 2, 0, 3)


def test_window_and_sinks_change_the_result():
    """The reference is not blind to what it checks: each option changes the output."""
    query, key, value = _inputs()
    plain = reference_attention(query, key, value, None, None)
    windowed = reference_attention(query, key, value, 2, None)
    sunk = reference_attention(query, key, value, None, torch.zeros(HEADS))
    assert (plain - windowed).abs().max() > 0.1
    assert (plain - sunk).abs().max() > 0.01
    # The first key_len - window queries see their whole past either way.
    torch.testing.assert_close(plain[:, :, :3], windowed[:, :, :3])


def test_an_explicit_mask_is_narrowed_by_the_window():
    """Per-document masks (`--reset-attention-mask`) and the window both apply."""
    config = _config(window_size=(2, 0), softmax_type="learnable")
    attention = DotProductAttention(config, layer_number=1)
    query, key, value = _inputs(1)
    documents = torch.tensor([0] * 5 + [1] * 7)
    allowed = (documents.view(-1, 1) == documents.view(1, -1)).expand(BATCH, SEQ, SEQ)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    mask = ~(allowed & causal)[:, None]  # Megatron's convention: True = masked out
    output = attention(*(_core_layout(t) for t in (query, key, value)), mask)
    sinks = attention.softmax_offset.detach()
    expected = reference_attention(query, key, value, 2, sinks, allowed)
    torch.testing.assert_close(output, _core_layout(expected).reshape(SEQ, BATCH, -1))


def test_softmax_with_sink_and_the_log_sum_exp_correction_agree():
    """The dense sink column and the kernels' `sigmoid(lse - sink)` correction give the same
    probabilities' output, and the same gradients (the sinks' included)."""
    generator = torch.Generator().manual_seed(2)
    scores = (3 * torch.randn(BATCH, HEADS, SEQ, SEQ, generator=generator)).requires_grad_()
    value = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)
    sinks = torch.randn(HEADS, generator=generator).requires_grad_()
    dense = softmax_with_sink(scores, sinks) @ value
    plain = torch.softmax(scores, dim=-1) @ value
    corrected = rescale_by_sink(plain, torch.logsumexp(scores, dim=-1), sinks)
    torch.testing.assert_close(corrected, dense)
    grad = torch.randn_like(dense)
    for a, b in zip(
        torch.autograd.grad(dense, (scores, sinks), grad),
        torch.autograd.grad(corrected, (scores, sinks), grad),
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 0, 3])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("documents", [False, True])
def test_flex_attention_forward_matches_the_reference(window, sinks, documents):
    """The FlexAttention path (its block mask, grouped heads, log-sum-exp sink correction),
    run by FlexAttention's own unfused forward: the CPU has no compiled FlexAttention with the
    log-sum-exp, nor any FlexAttention backward."""
    query, key, value = (t.detach() for t in _inputs(3))
    sink_logits = torch.tensor([-1.0, 0.5, 2.0, 4.0]) if sinks else None
    allowed, mask = None, None
    if documents:
        ids = torch.tensor([[0] * 4 + [1] * 8, [0] * 9 + [1] * 3])
        allowed = ids.unsqueeze(2) == ids.unsqueeze(1)
        mask = ~(allowed & torch.ones(SEQ, SEQ, dtype=torch.bool).tril())[:, None]
    block_mask = flex_module.window_block_mask(SEQ, window, torch.device("cpu"), mask)
    with mock.patch.object(flex_module, "_compiled_flex_attention", lambda: flex_attention):
        output = flex_module.flex_attention_with_sinks(
            query, key, value, block_mask, None, sink_logits
        )
    expected = reference_attention(query, key, value, window, sink_logits, allowed)
    torch.testing.assert_close(output, expected)


@pytest.mark.parametrize("window", [None, 0, 5])
def test_window_mask_mod_is_the_dense_window_mask(window):
    dense = create_mask(causal_window_mask_mod(window), None, None, SEQ, SEQ, device="cpu")
    torch.testing.assert_close(dense[0, 0], ~causal_window_mask(SEQ, window))


def test_gpt_oss_window_is_block_sparse():
    """gpt-oss's window of 128 positions at 8192: each block row of 128 queries touches at
    most two key blocks (the diagonal one and the one before), against up to 64 under causal
    attention."""
    seq, window = 8192, 127
    block_mask = flex_module.window_block_mask(seq, window, torch.device("cpu"), None)
    blocks = block_mask.to_dense()[0, 0]
    assert blocks.shape == (64, 64)
    assert blocks.sum(dim=-1).max() == 2 and blocks.sum() == 2 * 64 - 1
    causal = flex_module.window_block_mask(seq, None, torch.device("cpu"), None)
    assert causal.to_dense()[0, 0].sum() == 64 * 65 // 2


@pytest.mark.parametrize(
    "freq, windowed",
    [
        (None, [True, True, True, True]),
        (2, [True, False, True, False]),
        (1, [False, False, False, False]),
        (3, [True, True, False, True]),
        ([1, 1, 0, 1], [True, True, False, True]),
        ([0, 0, 0, 1], [False, False, False, True]),
    ],
)
def test_window_attn_skip_freq_picks_the_full_attention_layers(freq, windowed):
    config = _config(num_layers=4, window_size=(2, 0), window_attn_skip_freq=freq)
    picked = [is_layer_window_attention((2, 0), freq, n) for n in range(1, 5)]
    assert picked == windowed
    block = TransformerBlock(config, get_gpt_layer_local_spec())
    windows = [layer.self_attention.core_attention.window for layer in block.layers]
    assert windows == [2 if w else None for w in windowed]


def test_a_windowed_layer_sees_only_its_window():
    """A layer with a window of 1: changing position 0 changes the outputs at positions 0 and 1
    only."""
    config = _config(num_layers=1, window_size=(1, 0))
    torch.manual_seed(0)
    block = TransformerBlock(config, get_gpt_layer_local_spec())
    hidden = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM)
    changed = hidden.clone()
    changed[0] += 1.0
    with torch.no_grad():
        delta = (block(hidden) - block(changed)).abs().amax(dim=(1, 2))
    assert delta[0] > 0 and delta[1] > 0  # positions 0 and 1 see position 0
    assert delta[2:].max() == 0  # position 2 sees 1 and 2 only


def test_learnable_sinks_are_drawn_with_init_method_and_split_by_head():
    """One draw of `init_method` over all heads (as upstream at TP 1; under tensor parallelism
    each rank keeps its heads of the same draw, `test_gpt_oss_parallel.py`)."""
    config = _config(softmax_type="learnable", init_method_std=3.0)
    torch.manual_seed(5)
    whole = DotProductAttention(config).softmax_offset.detach()
    torch.manual_seed(5)
    expected = torch.empty(HEADS).normal_(mean=0.0, std=3.0)
    torch.testing.assert_close(whole, expected)
    assert (
        DotProductAttention(config).tensor_parallel_layouts()["softmax_offset"].partition_dim == 0
    )
    assert "softmax_offset" not in DotProductAttention(_config()).tensor_parallel_layouts()


def test_off_by_one_holds_no_state():
    attention = DotProductAttention(_config(softmax_type="off-by-one"))
    assert list(attention.state_dict()) == [] and list(attention.parameters()) == []


@pytest.mark.gpu
def test_flex_attention_has_no_dropout_and_says_so():
    config = _config(hidden_size=HEADS * CUDA_HEAD_DIM, window_size=(2, 0), attention_dropout=0.1)
    attention = DotProductAttention(config).cuda()
    query = torch.zeros(SEQ, BATCH, HEADS, CUDA_HEAD_DIM, device="cuda")
    key = torch.zeros(SEQ, BATCH, GROUPS, CUDA_HEAD_DIM, device="cuda")
    with pytest.raises(ValueError, match="FlexAttention.*has no attention dropout"):
        attention(query, key, key)


# --- the GLU options ---


def _glu_reference(x, activation, offset=0.0, clamp=None):
    gate, linear = x.chunk(2, dim=-1)
    if clamp is not None:
        gate = torch.where(gate > clamp, torch.full_like(gate, clamp), gate)
        linear = torch.where(linear.abs() > clamp, torch.sign(linear) * clamp, linear)
    return activation(gate) * (linear + offset)


@pytest.mark.parametrize(
    "activation, fields",
    [
        ("quick_gelu", dict(glu_linear_offset=1.0, activation_func_clamp_value=0.5)),
        ("quick_gelu", dict()),
        ("silu", dict(activation_func_clamp_value=0.5)),
        ("silu", dict(glu_linear_offset=-0.25)),
    ],
)
def test_gated_mlp_matches_the_formula(activation, fields):
    """gpt-oss's MLP: quick_gelu(min(x W, c)) * (clamp(x V, -c, c) + offset), and its gradients
    (none through the clamped entries)."""
    func = {"quick_gelu": quick_gelu, "silu": F.silu}[activation]
    config = _config(
        ffn_hidden_size=24, gated_linear_unit=True, activation_func=func, add_bias_linear=False,
        init_method_std=0.2, **fields,
    )  # fmt: skip
    torch.manual_seed(0)
    mlp = build_module(get_gpt_layer_local_spec().submodules.mlp, config=config)
    x = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, requires_grad=True)
    fc1, fc2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    hidden = x @ fc1.T
    if "activation_func_clamp_value" in fields:
        clamp = fields["activation_func_clamp_value"]
        cut = (hidden[..., :24] > clamp).float().mean(), (hidden[..., 24:].abs() > clamp).float()
        assert 0.05 < cut[0] < 0.95 and 0.05 < cut[1].mean() < 0.95  # the clamp cuts some
    expected = (
        _glu_reference(
            hidden,
            lambda g: g * torch.sigmoid(1.702 * g) if activation == "quick_gelu" else F.silu(g),
            fields.get("glu_linear_offset", 0.0),
            fields.get("activation_func_clamp_value"),
        )
        @ fc2.T
    )
    output, _ = mlp(x)
    torch.testing.assert_close(output, expected)
    grad = torch.randn_like(output)
    for a, b in zip(
        torch.autograd.grad(output, (x, fc1, fc2), grad),
        torch.autograd.grad(expected, (x, fc1, fc2), grad),
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("grouped", [False, True])
def test_experts_apply_the_clamped_glu(grouped):
    config = _config(
        gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
        activation_func_clamp_value=0.5, add_bias_linear=False, num_moe_experts=2,
        moe_ffn_hidden_size=8, init_method_std=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    experts = (GroupedMLP if grouped else SequentialMLP)(2, config)
    tokens = torch.randn(5, HEADS * HEAD_DIM)
    probs = torch.rand(5)
    output = experts(tokens, torch.tensor([2, 3]), probs)
    fc1, fc2 = experts.linear_fc1.weight, experts.linear_fc2.weight
    expected = torch.cat(
        [
            _glu_reference(part @ fc1[e].T, quick_gelu, 1.0, 0.5) @ fc2[e].T
            for e, part in enumerate(tokens.split([2, 3]))
        ]
    ) * probs.unsqueeze(-1)
    torch.testing.assert_close(output, expected)


# --- the same function as Megatron-core 0.19.2 ---


def _local_gpt(case: dict) -> GPTModel:
    return GPTModel(
        case_config(case["config"]),
        get_gpt_layer_local_spec(),
        vocab_size=gpt_oss_cases.VOCAB,
        max_sequence_length=gpt_oss_cases.SEQ,
        position_embedding_type="rope",
    )


@pytest.mark.parametrize("name", sorted(gpt_oss_cases.CASES))
def test_gpt_matches_megatron_core_on_the_same_weights(name):
    golden = torch.load(FIXTURE)
    assert golden["version"] == "0.19.2"
    case, expected = gpt_oss_cases.CASES[name], golden[name]
    model = _local_gpt(case)
    model.load_state_dict(expected["state_dict"])
    tokens, labels = gpt_oss_cases.batch(case)
    assert torch.equal(tokens, expected["tokens"]) and torch.equal(labels, expected["labels"])
    assert_matches_golden(model, tokens, labels, expected)


# --- FlexAttention on CUDA (compiled, forward and backward) ---


@pytest.fixture(scope="module")
def flex_compilations():
    """Each FlexAttention variant the GPU tests below run (its mask function, window, sequence
    length, and whether it returns the log-sum-exp: about 20) compiled once for the module,
    not once per test. Dynamo compiles a function 8 times by default, then runs it uncompiled;
    the limit is raised above the variants here, and hitting it is an error, so that every
    test runs the compiled kernel."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.usefixtures("flex_compilations")
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("softmax_type", SOFTMAX_TYPES)
@pytest.mark.parametrize("window", [None, (0, 0), (3, 0), (127, -1), (-1, 0)], ids=str)
def test_flex_attention_on_cuda_matches_the_reference(window, softmax_type, documents):
    """The compiled block-sparse kernel, its grouped heads and the sinks' log-sum-exp correction
    (SDPA where there is neither a window nor a sink) in fp32, against the dense reference in
    fp64: outputs and the gradients of queries, keys, values and sinks.

    Bound: 1e-4, relative and absolute. The kernels round in fp32: FlexAttention's Triton dots
    in IEEE fp32, SDPA's memory-efficient kernel (its only fused kernel that takes fp32)
    through 3xTF32 products (2^-21 each). Every element sums at most 300 terms of magnitude up
    to about 10 (inputs 2 * randn, heads 16 wide), so rounds by about 1e-5 at most: fp32
    emulations of both kernels' blockwise forward and backward on the CPU stay within 1.5e-6
    of each tensor's largest element, and within 1e-5 where the exact gradient is 0 (a window
    of 0). A wrong mask entry, window edge, key head or sink moves elements by 0.5 or more."""
    config = _config(
        hidden_size=HEADS * CUDA_HEAD_DIM, window_size=window, softmax_type=softmax_type
    )
    torch.manual_seed(0)
    attention = DotProductAttention(config, layer_number=1).cuda()
    generator = torch.Generator().manual_seed(4)
    shapes = [(BATCH, HEADS, CUDA_SEQ, CUDA_HEAD_DIM)] + 2 * [
        (BATCH, GROUPS, CUDA_SEQ, CUDA_HEAD_DIM)
    ]
    query, key, value = (
        (2 * torch.randn(shape, generator=generator)).cuda().requires_grad_() for shape in shapes
    )
    allowed, mask = None, None
    if documents:
        ids = (torch.arange(CUDA_SEQ) >= 170).long().cuda().expand(BATCH, -1)
        allowed = ids.unsqueeze(2) == ids.unsqueeze(1)
        causal = torch.ones(CUDA_SEQ, CUDA_SEQ, dtype=torch.bool, device="cuda").tril()
        mask = ~(allowed & causal)[:, None]
    inputs = [query, key, value]
    if softmax_type == "learnable":
        inputs.append(attention.softmax_offset)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    sinks = exact[3] if softmax_type == "learnable" else None
    if softmax_type == "off-by-one":
        sinks = torch.zeros(HEADS, dtype=torch.float64, device="cuda")
    output = attention(*(t.permute(2, 0, 1, 3) for t in (query, key, value)), mask)
    left = None if window is None or window[0] == -1 else window[0]
    expected = reference_attention(*exact[:3], left, sinks, allowed)
    expected = expected.permute(2, 0, 1, 3).reshape(output.shape)
    torch.testing.assert_close(output, expected.float(), rtol=1e-4, atol=1e-4)
    grad = torch.randn_like(output)
    actual = torch.autograd.grad(output, inputs, grad)
    wanted = torch.autograd.grad(expected, exact, grad.double())
    for name, a, b in zip(["query", "key", "value", "sinks"], actual, wanted):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.usefixtures("flex_compilations")
@pytest.mark.parametrize("name", sorted(gpt_oss_cases.CASES))
def test_gpt_on_cuda_matches_megatron_core(name):
    """The same comparison on CUDA, where FlexAttention computes the windows and sinks."""
    golden = torch.load(FIXTURE)
    case, expected = gpt_oss_cases.CASES[name], golden[name]
    model = _local_gpt(case).cuda()
    model.load_state_dict(expected["state_dict"])
    tokens, labels = (t.cuda() for t in gpt_oss_cases.batch(case))
    assert_matches_golden(model, tokens, labels, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.usefixtures("flex_compilations")
def test_compiled_gpt_oss_layers_on_cuda_compute_the_eager_loss_and_gradients():
    """`compile_layers` (inductor) around FlexAttention: the block mask is built outside the
    compiled graph and the compiled kernel runs inside it."""
    case = gpt_oss_cases.CASES["gpt_oss"]
    tokens, labels = (t.cuda() for t in gpt_oss_cases.batch(case))
    results = []
    for compiled in (False, True):
        case = dict(case, config=dict(case["config"], compile_layers=compiled))
        torch.manual_seed(0)
        model = _local_gpt(case).cuda()
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (loss, grads) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for param_name, grad in eager_grads.items():
        torch.testing.assert_close(grads[param_name], grad, rtol=1e-4, atol=1e-6, msg=param_name)
