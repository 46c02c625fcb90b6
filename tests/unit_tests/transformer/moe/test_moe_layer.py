"""MoELayer and its token dispatchers at expert-parallel sizes 1, 2 and 4 (4 spawned ranks) against
a plain reference written here: for each token, its top-k experts' MLPs weighted by the routing
probabilities, from the same global weights. The dispatchers' round trip also runs with expert
tensor parallelism 2 (every part of an expert gets the same tokens, the parts' outputs summed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import (
    DispatchSizing,
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import MOE_STATE_VARIANTS
from tests.unit_tests.transformer.moe.moe_checks import (
    BATCH,
    EXPERTS,
    HIDDEN,
    SEQ,
    TOPK,
    WORLD,
    moe_config,
    moe_layer,
)

DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}
VARIANTS = [
    dict(  # SwiGLU experts, shared experts with their gate, all-to-all
        moe_token_dispatcher_type="alltoall",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        moe_shared_expert_intermediate_size=24,
        moe_shared_expert_gate=True,
    ),
    dict(moe_token_dispatcher_type="allgather", moe_router_pre_softmax=True, moe_grouped_gemm=True),
    dict(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True),
]


def _data(rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=generator).to(current_device())


def _mlp(x, fc1, fc2, config, b1=None, b2=None) -> torch.Tensor:
    hidden = F.linear(x, fc1, b1)
    if config.gated_linear_unit:
        gate, up = hidden.chunk(2, dim=-1)
        hidden = config.activation_func(gate) * up
    else:
        hidden = config.activation_func(hidden)
    return F.linear(hidden, fc2, b2)


def _reference(x: torch.Tensor, params: dict[str, torch.Tensor], config) -> torch.Tensor:
    """The MoE layer on [s, b, h] written token-wise: top-k, weighted sum of expert MLPs."""
    x = x.reshape(-1, HIDDEN)
    logits = F.linear(x, params["router.weight"], params.get("router.bias"))
    if config.moe_router_pre_softmax:
        top = logits.softmax(dim=-1).topk(TOPK, dim=-1)
        weights = top.values
    else:
        top = logits.topk(TOPK, dim=-1)
        weights = top.values.softmax(dim=-1)
    output = torch.zeros_like(x)
    for expert in range(EXPERTS):
        weight = (weights * (top.indices == expert)).sum(dim=-1, keepdim=True)
        bias = [params.get(f"experts.linear_fc{i}.bias") for i in (1, 2)]
        output = output + weight * _mlp(
            x,
            params["experts.linear_fc1.weight"][expert],
            params["experts.linear_fc2.weight"][expert],
            config,
            None if bias[0] is None else bias[0][expert],
            None if bias[1] is None else bias[1][expert],
        )
    if config.moe_shared_expert_intermediate_size:
        shared = _mlp(
            x,
            params["shared_experts.linear_fc1.weight"],
            params["shared_experts.linear_fc2.weight"],
            config,
        )
        output = output + torch.sigmoid(F.linear(x, params["shared_experts.gate_weight"])) * shared
    return output.view(SEQ, BATCH, HIDDEN)


def _moe_layer_matches_reference(ep: int) -> None:
    rank = dist.get_rank()
    # Built before the groups exist: expert-parallel size 1, all experts, the global weights.
    references = [moe_layer(moe_config(1, **variant)) for variant in VARIANTS]
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    group_ranks = parallel_state.get_group_ranks("ep")
    for seed, (variant, reference) in enumerate(zip(VARIANTS, references)):
        config = moe_config(ep, **variant)
        layer = moe_layer(config)
        local = slice(layer.local_expert_indices[0], layer.local_expert_indices[-1] + 1)
        global_params = dict(reference.named_parameters())
        for name, param in layer.named_parameters():
            expected = global_params[name]
            if name.startswith("experts."):
                expected = expected[local]
            assert torch.equal(param, expected), f"{name} depends on the expert-parallel size"

        x = _data(rank, seed).requires_grad_()
        output, bias = layer(x)
        assert bias is None
        (output * _data(rank, seed + 10)).sum().backward()

        params = {n: p.detach().clone().requires_grad_() for n, p in global_params.items()}
        for source in group_ranks:  # expert grads sum over the tokens of the whole EP group
            ref_x = _data(source, seed).requires_grad_()
            ref_output = _reference(ref_x, params, config)
            if source == rank:  # the replicated parameters see this rank's tokens only
                torch.testing.assert_close(output, ref_output)
                dense = [n for n in params if not n.startswith("experts.")]
                own = torch.autograd.grad(
                    (ref_output * _data(rank, seed + 10)).sum(),
                    [ref_x] + [params[n] for n in dense],
                    retain_graph=True,
                )
                torch.testing.assert_close(x.grad, own[0])
                layer_params = dict(layer.named_parameters())
                for name, grad in zip(dense, own[1:]):
                    torch.testing.assert_close(layer_params[name].grad, grad)
            (ref_output * _data(source, seed + 10)).sum().backward()
        for name, param in layer.experts.named_parameters():
            torch.testing.assert_close(param.grad, params[f"experts.{name}"].grad[local])


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_moe_layer_matches_reference(ep):
    run_distributed(_moe_layer_matches_reference, WORLD, ep)


def _skewed_routing(rank: int, drop_first: bool = True) -> torch.Tensor:
    """Uneven routing: expert 0 popular, expert 7 never chosen, token 0 dropped (unless not
    `drop_first`: then every token has its top-k, as dropless routing gives)."""
    generator = torch.Generator().manual_seed(rank)
    logits = torch.randn(SEQ * BATCH, EXPERTS, generator=generator)
    logits[:, 0] += 2.0
    logits[:, EXPERTS - 1] -= 100.0
    indices = logits.topk(TOPK, dim=-1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    if drop_first:
        routing_map[0] = False
    return routing_map.to(current_device())


def _dispatch_round_trip(ep: int, etp: int, kind: str) -> None:
    """HOST sizing with a dropped token (capacity's case), then the dropless sizing without a
    host read (FIXED with one rank, else WORST_CASE, whose padding rows must not be read)."""
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    config = moe_config(ep, etp, moe_token_dispatcher_type=kind)
    dropless = DispatchSizing.FIXED if ep * etp == 1 else DispatchSizing.WORST_CASE
    for sizing, drop_first in ((DispatchSizing.HOST, True), (dropless, False)):
        dispatcher = DISPATCHERS[kind](
            config,
            parallel_state.get_expert_model_parallel_group(),
            parallel_state.get_expert_tensor_parallel_group(),
            parallel_state.get_expert_tensor_and_model_parallel_group(),
            sizing=sizing,
        )
        hidden = _data(rank, 0).requires_grad_()
        routing_map = _skewed_routing(rank, drop_first)
        tokens, tokens_per_expert, probs = dispatcher.dispatch(
            hidden, routing_map.to(hidden.dtype), routing_map
        )
        tp_ep = parallel_state.get_group_ranks("tp_ep")
        group_maps = [_skewed_routing(source, drop_first) for source in tp_ep]
        first = dispatcher.first_expert
        local = slice(first, first + dispatcher.num_local_experts)
        routed = torch.stack(group_maps).sum(dim=(0, 1))[local]
        assert tokens_per_expert.tolist() == routed.tolist()
        host = sizing is DispatchSizing.HOST
        assert tokens_per_expert.device == (torch.device("cpu") if host else hidden.device)
        real = int(routed.sum())
        assert probs[:real].eq(1).all()
        # A stand-in expert e multiplies by e + 1, so a token sent to the wrong expert shows; each
        # of the etp ranks holding a part of it gives 1 / etp of that (exact for etp 2), which
        # combine sums. Padding rows give NaN, which must reach no token.
        chunks = torch.split(tokens[:real], tokens_per_expert.tolist())
        padding = tokens[real:] * float("nan")
        scaled = [chunk * ((first + i + 1) / etp) for i, chunk in enumerate(chunks)]
        output = dispatcher.combine(torch.cat([*scaled, padding]))
        numbers = torch.arange(1.0, EXPERTS + 1, device=hidden.device)
        factor = routing_map.to(hidden.dtype) @ numbers
        expected = hidden.detach() * factor.view(SEQ, BATCH, 1)
        torch.testing.assert_close(output, expected)
        if drop_first:
            assert output[0, 0].eq(0).all()  # the dropped token
        output.sum().backward()
        torch.testing.assert_close(hidden.grad, factor.view(SEQ, BATCH, 1).expand_as(hidden))


@pytest.mark.parametrize("kind", ["allgather", "alltoall"])
@pytest.mark.parametrize("ep, etp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_dispatch_then_combine_returns_each_token(ep, etp, kind):
    run_distributed(_dispatch_round_trip, WORLD, ep, etp, kind)


def _experts(cls: type, config: TransformerConfig) -> SequentialMLP:
    torch.manual_seed(7)
    return cls(4, config, first_expert=4)


def test_grouped_and_sequential_experts_agree():
    config = moe_config(1, add_bias_linear=True, gated_linear_unit=True, activation_func=F.silu)
    counts = torch.tensor([3, 0, 5, 1])  # an expert without tokens
    tokens = torch.randn(9, HIDDEN, requires_grad=True)
    probs = torch.rand(9)
    outputs, grads = [], []
    for cls in (SequentialMLP, GroupedMLP):
        experts = _experts(cls, config)
        output = experts(tokens, counts, probs)
        output.sum().backward()
        outputs.append(output)
        grads.append([tokens.grad.clone()] + [p.grad for p in experts.parameters()])
        tokens.grad = None
    torch.testing.assert_close(outputs[0], outputs[1])
    for sequential, grouped in zip(*grads):
        torch.testing.assert_close(sequential, grouped)
    assert grads[0][1][1].eq(0).all()  # the empty expert's fc1 weight gets a zero gradient


def test_experts_without_tokens_still_get_gradients():
    experts = _experts(SequentialMLP, moe_config(1))
    output = experts(torch.zeros(0, HIDDEN), torch.zeros(4, dtype=torch.long), torch.zeros(0))
    output.sum().backward()
    assert all(p.grad is not None and p.grad.eq(0).all() for p in experts.parameters())


@pytest.mark.parametrize("kind", ["allgather", "alltoall"])
def test_padded_capacity_combines_each_token_from_its_own_rows(kind):
    """Capacity factor 1 with padding makes E x capacity = T x k rows, yet tokens hold
    different numbers of them (dropped routes, padding rows of probability 0): each token's
    output is still the sum of its kept experts' MLPs weighted by its router probabilities."""
    config = moe_config(
        1,
        moe_token_dispatcher_type=kind,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
    )
    layer = moe_layer(config)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        probs, routing_map = layer.router(x)
        output, _ = layer(x)
    tokens = x.reshape(-1, HIDDEN)
    assert routing_map.sum() == tokens.shape[0] * TOPK  # the case a row count cannot tell
    assert not routing_map.sum(dim=1).eq(TOPK).all()
    params = dict(layer.experts.named_parameters())
    biases = [params.get(f"linear_fc{i}.bias") for i in (1, 2)]
    expected = sum(
        probs[:, e : e + 1]
        * _mlp(
            tokens,
            params["linear_fc1.weight"][e],
            params["linear_fc2.weight"][e],
            config,
            *(None if bias is None else bias[e] for bias in biases),
        )
        for e in range(EXPERTS)
    )
    torch.testing.assert_close(output.reshape(-1, HIDDEN), expected)


@pytest.mark.gpu
def test_grouped_gemm_matches_the_loop_in_bf16_on_cuda():
    config = moe_config(1, params_dtype=torch.bfloat16, bf16=True, add_bias_linear=False)
    counts = torch.tensor([64, 0, 48, 16])
    tokens = torch.randn(128, HIDDEN, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(128, device="cuda")
    outputs = []
    for cls in (SequentialMLP, GroupedMLP):
        experts = _experts(cls, config).cuda()
        outputs.append(experts(tokens, counts, probs))
    torch.testing.assert_close(outputs[0], outputs[1])


def test_layer_refuses_a_mismatched_expert_parallel_size():
    with pytest.raises(ValueError, match="expert_model_parallel_size \\(2\\) differs"):
        moe_layer(moe_config(2))


@pytest.mark.parametrize("variant", MOE_STATE_VARIANTS)
def test_layer_built_on_meta_then_reset_in_module_order_is_the_eager_build(variant):
    """What Megatron-FSDP's materialisation does (`module.modules()` order, each module's
    `reset_parameters()`): the weights and buffers of an eager build with the same seed."""
    config = moe_config(1, **MOE_STATE_VARIANTS[variant])
    spec = get_moe_module_spec()
    torch.manual_seed(123)
    eager = MoELayer(config, spec.submodules).state_dict()
    with torch.device("meta"):
        layer = MoELayer(config, spec.submodules)
    assert all(tensor.is_meta for tensor in layer.state_dict().values())
    layer.to_empty(device="cpu")
    torch.manual_seed(123)
    for module in layer.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert layer.state_dict().keys() == eager.keys()
    for name, tensor in eager.items():
        assert torch.equal(layer.state_dict()[name], tensor), name
