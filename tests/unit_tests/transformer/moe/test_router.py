"""TopKRouter and its helpers against Megatron-core 0.19.2 (a stored fixture, made by
fixtures/make_router_fixture.py) and against the formulas written out here."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    update_expert_bias,
    z_loss_func,
)
from megatron.core.transformer.moe.router import (
    TopKRouter,
    drop_tokens_over_capacity,
    topk_routing,
)
from megatron.core.transformer.transformer_config import TransformerConfig

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "router_fixture.pt")
SEQ, BATCH, EXPERTS = 4, 4, 8
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=EXPERTS)


def _config(**overrides) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **overrides})


CASES = {
    "softmax": dict(),
    "pre_softmax": dict(moe_router_pre_softmax=True),
    "sigmoid_scaled": dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
    "grouped": dict(
        moe_router_topk=4,
        moe_router_pre_softmax=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
    ),
    "sigmoid_bias": dict(moe_router_score_function="sigmoid"),
    # DeepSeek-V3's recipe: --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    # --moe-router-num-groups --moe-router-group-topk --moe-router-topk-scaling-factor 2.5.
    "deepseek_v3": dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
    ),
    "grouped_sigmoid": dict(
        moe_router_topk=3,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=4,
        moe_router_group_topk=2,
    ),
}
BIASES = {"sigmoid_bias": "expert_bias", "deepseek_v3": "small_expert_bias"}
"""The fixture's expert bias each case was routed with (make_router_fixture.py's BIASES)."""


@pytest.mark.parametrize("case", CASES)
def test_routing_matches_megatron_core(case):
    bias = FIXTURE[BIASES[case]] if case in BIASES else None
    probs, routing_map = topk_routing(FIXTURE["logits"], _config(**CASES[case]), bias)
    assert torch.equal(routing_map, FIXTURE[f"{case}.map"])
    torch.testing.assert_close(probs, FIXTURE[f"{case}.probs"])


def _group_limited_reference(
    scores: torch.Tensor,
    selection: torch.Tensor,
    topk: int,
    num_groups: int,
    group_topk: int,
    scaling: float,
) -> torch.Tensor:
    """Megatron-core's group-limited sigmoid routing, token by token in plain Python: each
    group scores the sum of its best topk // group_topk selection scores, the best group_topk
    groups are kept, and the topk best experts of those are chosen; their weights are the
    unbiased scores normalised over the k, times the scaling factor."""
    tokens, experts = scores.shape
    size = experts // num_groups
    probs = torch.zeros_like(scores)
    for t in range(tokens):
        row = selection[t].tolist()
        group_score = [
            sum(sorted(row[g * size : (g + 1) * size], reverse=True)[: topk // group_topk])
            for g in range(num_groups)
        ]
        groups = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_topk]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -row[e])[:topk]
        total = sum(scores[t, e].item() for e in chosen)
        for e in chosen:
            probs[t, e] = scores[t, e] / total * scaling
    return probs


@pytest.mark.parametrize("biased", [False, True])
def test_deepseek_v3_routing_matches_the_formula(biased):
    """Sigmoid scores, expert bias, group-limited top-k with its top-2-sum group scores (top-8
    of 4 groups out of 8 as DeepSeek-V3, at 32 experts) and the scaling factor."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 32, dtype=torch.float64, generator=generator)
    bias = 0.3 * torch.randn(32, dtype=torch.float64, generator=generator) if biased else None
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=32,
        moe_router_topk=8,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=biased,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        moe_router_topk_scaling_factor=2.5,
    )
    probs, routing_map = topk_routing(logits, config, bias)
    scores = torch.sigmoid(logits)
    selection = scores + bias if biased else scores
    expected = _group_limited_reference(scores, selection, 8, 8, 4, 2.5)
    assert torch.equal(routing_map, expected != 0)
    torch.testing.assert_close(probs, expected)
    # Limited: every token's experts lie in at most 4 of the 8 groups of 4, and the limit
    # changes the selection of some tokens (else the test would not tell it apart).
    assert routing_map.view(64, 8, 4).any(dim=-1).sum(dim=-1).le(4).all()
    unlimited = torch.topk(selection, 8, dim=-1).indices
    assert not torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, unlimited, True))


def test_the_expert_bias_changes_the_deepseek_v3_fixtures_selection():
    """The fixture's small bias decides some selections: the bias case tests its use."""
    config = _config(**{**CASES["deepseek_v3"], "moe_router_enable_expert_bias": False})
    _, unbiased = topk_routing(FIXTURE["logits"], config)
    assert not torch.equal(unbiased, FIXTURE["deepseek_v3.map"])


def test_softmax_routing_formula():
    logits = FIXTURE["logits"]
    probs, routing_map = topk_routing(logits, _config())
    top = logits.topk(2, dim=1)
    expected = torch.zeros_like(logits).scatter(1, top.indices, top.values.softmax(dim=1))
    torch.testing.assert_close(probs, expected)
    assert routing_map.sum(dim=1).eq(2).all()


def test_expert_bias_changes_the_selection_not_the_weights():
    logits = FIXTURE["logits"]
    bias = torch.zeros(EXPERTS, dtype=logits.dtype)
    bias[3] = 10.0  # every token picks expert 3
    probs, routing_map = topk_routing(logits, _config(moe_router_score_function="sigmoid"), bias)
    assert routing_map[:, 3].all()
    scores = torch.sigmoid(logits) * routing_map
    torch.testing.assert_close(probs, scores / scores.sum(dim=1, keepdim=True))


@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drop_by_probs_matches_megatron_core(pad):
    config = _config(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=pad)
    probs, routing_map = FIXTURE["softmax.probs"], FIXTURE["softmax.map"]
    dropped, kept = drop_tokens_over_capacity(probs, routing_map, config)
    assert torch.equal(kept, FIXTURE[f"drop_probs.pad{int(pad)}.map"])
    torch.testing.assert_close(dropped, FIXTURE[f"drop_probs.pad{int(pad)}.probs"])


@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drop_by_position_keeps_the_first_tokens(pad):
    config = _config(
        moe_expert_capacity_factor=0.5,
        moe_token_drop_policy="position",
        moe_pad_expert_input_to_capacity=pad,
    )
    probs, routing_map = FIXTURE["softmax.probs"], FIXTURE["softmax.map"]
    dropped, kept = drop_tokens_over_capacity(probs, routing_map, config)
    capacity = 2  # ceil(16 tokens * top-2 / 8 experts * 0.5)
    for expert in range(EXPERTS):
        routed = routing_map[:, expert].nonzero().flatten()
        first = routed[:capacity]
        assert kept[first, expert].all()
        if pad:
            assert kept[:, expert].sum() == capacity
        else:
            assert kept[:, expert].sum() == len(first)
    assert torch.equal(dropped, probs * kept)


def _router(**overrides) -> TopKRouter:
    torch.manual_seed(0)
    return TopKRouter(_config(add_bias_linear=False, **overrides), layer_number=2)


def _hidden() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(SEQ, BATCH, 32, requires_grad=True)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_load_balancing_loss_matches_megatron_core(kind, score_function):
    destroy_moe_metrics_tracker()
    router = _router(
        moe_router_load_balancing_type=kind,
        moe_aux_loss_coeff=0.1,
        moe_router_score_function=score_function,
    )
    # Route the fixture's logits: a weight whose product with a one-hot input is the logits.
    logits = FIXTURE["logits"].float()
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, :EXPERTS] = torch.eye(EXPERTS)
    hidden = torch.zeros(SEQ * BATCH, 32)
    hidden[:, :EXPERTS] = logits
    hidden = hidden.view(SEQ, BATCH, 32).requires_grad_()
    probs, _ = router(hidden)
    expected = FIXTURE[f"{kind}.{score_function}"].float()
    name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
    recorded = get_moe_metrics_tracker().metrics[name]
    torch.testing.assert_close(recorded[1], expected / 0.1)
    assert recorded[0] == 0
    # The attached loss gets gradient 1 (no scale set): d(aux)/d(input) on top of probs'.
    probs.sum().backward()
    with_aux = hidden.grad.clone()
    hidden.grad = None
    router.eval()
    router(hidden)[0].sum().backward()
    assert not torch.allclose(with_aux, hidden.grad)


def test_z_loss_matches_megatron_core_and_scales_with_the_loss_scale():
    destroy_moe_metrics_tracker()
    router = _router(moe_z_loss_coeff=0.01)
    logits = FIXTURE["logits"].float()
    torch.testing.assert_close(z_loss_func(logits, 0.01).double(), FIXTURE["z_loss"])
    hidden = _hidden()
    probs, _ = router(hidden)
    direct = torch.mean(torch.logsumexp(router.gating(hidden.detach()), dim=-1) ** 2)
    torch.testing.assert_close(get_moe_metrics_tracker().metrics["z_loss"][1], direct)
    grads = []
    for scale in (1.0, 3.0):
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))
        router.zero_grad()
        router(hidden)[0].sum().mul(0).backward()  # only the z-loss reaches the weight
        grads.append(router.weight.grad.clone())
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    torch.testing.assert_close(grads[1], 3 * grads[0])


def test_expert_bias_update_moves_toward_balance():
    router = _router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    router(_hidden())
    counts = router.local_tokens_per_expert.clone()
    assert counts.sum() == SEQ * BATCH * 2
    update_expert_bias([router], group=None)
    rate = router.config.moe_router_bias_update_rate
    torch.testing.assert_close(router.expert_bias, torch.sign(counts.mean() - counts) * rate)
    assert router.local_tokens_per_expert.eq(0).all()
    with torch.no_grad():  # evaluation does not count
        router(_hidden())
    assert router.local_tokens_per_expert.eq(0).all()
    assert "expert_bias" in router.state_dict()
    assert "local_tokens_per_expert" not in router.state_dict()
    assert router.bfloat16().expert_bias.dtype == torch.float32


def test_router_dtype_and_force_load_balancing():
    router = _router(moe_router_dtype="fp64")
    probs, _ = router(_hidden())
    assert probs.dtype == torch.float64 and router.weight.dtype == torch.float32
    forced, hidden = _router(moe_router_force_load_balancing=True), _hidden()
    maps = []
    for seed in (5, 6):
        torch.manual_seed(seed)
        maps.append(forced(hidden)[1])
    assert not torch.equal(maps[0], maps[1])  # random logits, whatever the input


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(moe_router_topk=9), "moe_router_topk \\(9\\) exceeds num_moe_experts"),
        (dict(moe_router_group_topk=2), "needs both moe_router_num_groups"),
        (dict(moe_router_num_groups=3, moe_router_group_topk=1), "divisible by moe_router_num"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=3), "must be <= moe_router_topk"),
        (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor=0.0 must be > 0 and"),
        (dict(moe_expert_capacity_factor=math.inf), "moe_expert_capacity_factor=inf must be"),
        (dict(moe_router_topk_scaling_factor=0.0), "moe_router_topk_scaling_factor=0.0 must"),
        (dict(moe_router_topk_scaling_factor=math.nan), "moe_router_topk_scaling_factor=nan"),
        (dict(moe_aux_loss_coeff=math.nan), "moe_aux_loss_coeff=nan must be >= 0 and finite"),
        (dict(moe_aux_loss_coeff=-0.1), "moe_aux_loss_coeff=-0.1 must be >= 0 and finite"),
        (dict(moe_router_score_function="sqrtsoftplus"), "'sqrtsoftplus' .* is not built"),
        (dict(moe_router_load_balancing_type="sinkhorn"), "'sinkhorn' .* is not built"),
        (dict(moe_router_load_balancing_type="global_aux_loss"), "is not built"),
        (dict(moe_token_dispatcher_type="flex"), "'flex' .* is not built"),
        (dict(moe_token_drop_policy="random"), "moe_token_drop_policy must be one of"),
        (dict(moe_router_dtype="bf16"), "moe_router_dtype must be one of"),
        (dict(moe_router_topk=1), "needs moe_router_pre_softmax=True"),
        (dict(moe_router_enable_expert_bias=True), "needs moe_router_score_function='sigmoid'"),
        (dict(moe_pad_expert_input_to_capacity=True), "needs moe_expert_capacity_factor"),
        (dict(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="none"), "no effect"),
        (dict(moe_shared_expert_intermediate_size=16), "set add_bias_linear=False"),
        (dict(moe_shared_expert_gate=True), "needs shared experts"),
        (dict(moe_layer_freq=[1, 0, 1]), "one 0 \\(dense\\) or 1 \\(MoE\\) per layer"),
        (dict(moe_layer_freq="([1]*3+[0])*2"), "expand a pattern string"),
        (dict(moe_z_loss_coeff=-1.0), "moe_z_loss_coeff=-1.0 must be >= 0 and finite"),
        (dict(moe_z_loss_coeff=math.inf), "moe_z_loss_coeff=inf must be >= 0 and finite"),
        (
            dict(
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0,
            ),
            "moe_router_bias_update_rate must be finite and > 0",
        ),
        (dict(moe_router_bias_update_rate=math.inf), "moe_router_bias_update_rate=inf must be"),
    ],
)
def test_config_rejects(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


def test_config_defaults():
    config = _config()
    assert config.moe_ffn_hidden_size == config.ffn_hidden_size
    assert config.moe_token_dispatcher_type == "allgather"
    assert dataclasses.replace(config, moe_ffn_hidden_size=8).moe_ffn_hidden_size == 8
