"""FP8 in a GPT with MoE layers: which projections run in FP8 (routed and shared experts, not the
router; none in the bf16 first / last layers), the model end to end against its fake-quant twin
for a few steps, and recomputation of the MoE layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fp8 import expert_gemm_kernels
from megatron.core.fp8 import experts as fp8_experts
from megatron.core.fp8.experts import Fp8ExpertSlots
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.scaling import BACKWARD, FORWARD
from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec
from megatron.core.transformer.moe import experts as moe_experts
from megatron.core.transformer.moe.experts import ExpertLinear
from megatron.core.transformer.moe.token_dispatcher import DispatchSizing
from tests.unit_tests.fp8.reference import E4M3, current_scale, dq, exact_cpu_scaled_mm, mm, q
from tests.unit_tests.fp8.test_experts import grouped_kernel, triton_kernels  # noqa: F401 (fixtures)
from tests.unit_tests.fp8.test_model import _FakeQuantSlots, assert_recompute_changes_nothing
from tests.unit_tests.model_builders import SEQ_LENGTH, VOCAB_SIZE, make_token_batches
from tests.unit_tests.model_builders import tiny_gpt_config as _tiny_gpt_config

MOE = dict(
    num_moe_experts=4,
    moe_ffn_hidden_size=32,
    moe_router_topk=2,
    moe_layer_freq=[0, 1],
    moe_shared_expert_intermediate_size=32,
    add_bias_linear=False,
    gated_linear_unit=True,
    activation_func=F.silu,
    params_dtype=torch.bfloat16,
    bf16=True,
)


def _config(fmt="hybrid", recipe="delayed", **overrides):
    fields = dict(MOE, fp8=fmt, fp8_recipe=recipe)
    if recipe == "delayed":
        fields.update(fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    fields.update(overrides)
    return _tiny_gpt_config(**fields)


def _gpt(config) -> GPTModel:
    torch.manual_seed(0)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config, spec, vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH)


def _fp8_modules(model: GPTModel) -> list[str]:
    return [name for name, module in model.named_modules() if getattr(module, "fp8", None)]


def test_routed_and_shared_experts_train_in_fp8_but_not_the_router():
    model = _gpt(_config())
    experts = [f"decoder.layers.1.mlp.experts.linear_fc{i}" for i in (1, 2)]
    shared = [f"decoder.layers.1.mlp.shared_experts.linear_fc{i}" for i in (1, 2)]
    assert set(experts + shared) <= set(_fp8_modules(model))
    assert not any("router" in name for name in _fp8_modules(model))
    for name in experts:
        assert isinstance(model.get_submodule(name).fp8, Fp8ExpertSlots)


@pytest.mark.parametrize("impl", ["none", "full_iteration"])
def test_experts_of_a_graphed_model_know_it(impl):
    """`cuda_graph_impl` "full_iteration" reaches every expert projection's settings, which then
    keep the grouped kernels at any size (`Fp8ExpertSlots.expert_gemms`)."""
    model = _gpt(_config(moe_grouped_gemm=True, cuda_graph_impl=impl))
    slots = [getattr(m, "fp8", None) for m in model.modules()]
    slots = [s for s in slots if isinstance(s, Fp8ExpertSlots)]
    assert len(slots) == 2 and all(s.graphed == (impl == "full_iteration") for s in slots)


def test_first_and_last_layers_in_bf16_keep_their_moe_layers_in_bf16():
    config = _config(
        recipe="tensorwise",
        num_layers=4,
        moe_layer_freq=1,
        first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=1,
        num_layers_at_end_in_bf16=1,
    )
    layers = {name.split(".")[2] for name in _fp8_modules(_gpt(config))}
    assert layers == {"1", "2"}


def test_experts_whose_sizes_are_not_multiples_of_16_are_refused_by_name():
    with pytest.raises(
        ValueError, match=r"layer layers\.1\.mlp\.experts\.linear_fc2: weight \[32, 24\]"
    ):
        _gpt(_config(moe_ffn_hidden_size=24))


class _FakeQuantExpertSlots(Fp8ExpertSlots):
    """An expert projection's FP8 settings whose GEMMs run as the plain-torch reference: each
    expert's input, output gradient and weight quantised with the scale the recipe gives it,
    dequantised, multiplied in fp32 (`mm`)."""

    @classmethod
    def replacing(cls, slots: Fp8ExpertSlots) -> _FakeQuantExpertSlots:
        fake = cls.__new__(cls)
        fake.__dict__.update(slots.__dict__)
        return fake

    def scale_for(self, direction: str, index: int, x: torch.Tensor, dtype) -> torch.Tensor:
        if self.state is None:
            return current_scale(x, dtype)
        slot = (self.input_slots if direction == FORWARD else self.grad_slots)[index]
        scale = self.state.scale(direction, slot, x.device).clone().reshape(())
        record = self.state.amax_record(direction, slot)
        if record is not None:
            record.copy_(torch.maximum(record, x.detach().abs().amax().float()))
        return scale

    def experts_linear(self, input_, weight, counts, *, grouped, tp_group=None, gemm_rows=None):
        return _FakeQuantExperts.apply(input_, weight, self, counts)


def _fake_quant(x, scale, dtype):
    return dq(q(x, scale, dtype), scale.reciprocal())


class _FakeQuantExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, slots, counts):
        outputs, saved = [], []
        for index, x_e in enumerate(x.split(counts)):
            sw = current_scale(weight[index], E4M3)
            wd = _fake_quant(weight[index], sw, E4M3)
            if not x_e.shape[0]:
                outputs.append(x_e.new_empty(0, weight.shape[1]))
                saved.append((None, wd))
                continue
            xd = _fake_quant(x_e, slots.scale_for(FORWARD, index, x_e, E4M3), E4M3)
            outputs.append(mm(xd, wd.t()).to(x.dtype))
            saved.append((xd, wd))
        ctx.saved, ctx.slots, ctx.counts, ctx.dtype = saved, slots, counts, x.dtype
        ctx.weight_shape = weight.shape
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad):
        dtype = ctx.slots.recipe.backward_dtype
        grads_x, grads_w = [], []
        for index, (g_e, (xd, wd)) in enumerate(zip(grad.split(ctx.counts), ctx.saved)):
            if xd is None:
                grads_x.append(g_e.new_empty(0, ctx.weight_shape[2]))
                grads_w.append(torch.zeros(ctx.weight_shape[1:], dtype=ctx.dtype))
                continue
            gd = _fake_quant(g_e, ctx.slots.scale_for(BACKWARD, index, g_e, dtype), dtype)
            grads_x.append(mm(gd, wd).to(ctx.dtype))
            grads_w.append(mm(gd.t(), xd).to(ctx.dtype))
        return torch.cat(grads_x), torch.stack(grads_w), None, None


def _twin(model: GPTModel) -> GPTModel:
    for module in model.modules():
        if isinstance(module, ExpertLinear) and module.fp8 is not None:
            module.fp8 = _FakeQuantExpertSlots.replacing(module.fp8)
        elif getattr(module, "fp8", None) is not None:
            module.fp8 = _FakeQuantSlots.replacing(module.fp8)
    return model


def _train(model: GPTModel, steps: int = 3) -> list[torch.Tensor]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for tokens, labels in make_token_batches(steps, 3, seed=5):
        loss = model(tokens, labels=labels).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _assert_trains_as_its_twin(config) -> None:
    fp8, twin = _gpt(config), _twin(_gpt(config))
    assert _train(fp8) == _train(twin)
    for (name, a), b in zip(fp8.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name
    if config.fp8_recipe == "delayed":
        expected = twin.decoder.fp8_state.scaling_tensors()
        for key, value in fp8.decoder.fp8_state.scaling_tensors().items():
            assert torch.equal(value, expected[key]), key


@exact_cpu_scaled_mm
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_moe_gpt_equals_its_fake_quant_twin(fmt, recipe):
    """A tiny bf16 MoE GPT (routed and shared experts) trained a few steps in FP8, and its twin
    whose FP8 projections run the plain-torch reference: the same losses, weights and
    delayed-scaling state, bit for bit."""
    _assert_trains_as_its_twin(_config(fmt, recipe))


@exact_cpu_scaled_mm
def test_grouped_fp8_moe_gpt_equals_its_fake_quant_twin(grouped_kernel):  # noqa: F811
    """The same with `moe_grouped_gemm` through the grouped kernel (every GEMM, e4m3)."""
    _assert_trains_as_its_twin(_config("e4m3", "delayed", moe_grouped_gemm=True))


@exact_cpu_scaled_mm
def test_grouped_fp8_experts_taking_device_counts_size_the_dispatch_from_shapes(
    triton_kernels,  # noqa: F811 (the fixture)
    monkeypatch,
):
    """Where the grouped FP8 kernels take the counts on the device, a layer with one rank per
    expert group sizes its dispatch from the shapes (FIXED), not on the host; it trains the same
    as the layer that reads them on the host, and as its fake-quant twin, bit for bit (through
    the kernels' CPU emulations)."""
    config = _config("hybrid", "delayed", moe_grouped_gemm=True)
    monkeypatch.setattr(moe_experts, "grouped_fp8_takes_device_counts", lambda: False)
    host = _gpt(config)
    monkeypatch.setattr(moe_experts, "grouped_fp8_takes_device_counts", lambda: True)
    device = _gpt(config)
    sizings = [model.decoder.layers[1].mlp.token_dispatcher.sizing for model in (host, device)]
    assert sizings == [DispatchSizing.HOST, DispatchSizing.FIXED]
    assert _train(host) == _train(device)
    for (name, a), b in zip(host.named_parameters(), device.parameters()):
        assert torch.equal(a, b), name
    _assert_trains_as_its_twin(config)


def test_padded_exchanges_size_the_fp8_gemms_by_the_rows_routing_gives_each_rank(
    triton_kernels,  # noqa: F811 (the fixture)
    monkeypatch,
):
    """Under the padded exchange (expert parallelism) the experts' input holds ep times the
    rows balanced routing gives them: the choice between the grouped kernels and one GEMM per
    expert counts a 1 / ep share, not the padding."""
    ep = 4
    config = _config("hybrid", "tensorwise", moe_grouped_gemm=True, expert_model_parallel_size=ep)
    experts = moe_experts.GroupedMLP(2, config)
    recipe = Fp8Recipe("hybrid", "tensorwise")
    slots = [Fp8ExpertSlots(recipe, num_experts=8, first_expert=0, num_local_experts=2)] * 2
    experts.enable_fp8(*slots)
    tokens = torch.zeros(64 * ep, config.hidden_size, dtype=torch.bfloat16)
    assert experts._real_rows(tokens) == 64
    weight = experts.linear_fc1.weight  # the larger projection
    flops = 2.0 * 64 * weight.shape[1] * weight.shape[2] / weight.shape[0]
    monkeypatch.setattr(fp8_experts, "PER_EXPERT_FROM_FLOPS", 2 * flops)
    assert experts._fp8_takes_device_counts(tokens, experts._real_rows(tokens))
    assert not experts._fp8_takes_device_counts(tokens, tokens.shape[0])  # the padded rows


def test_graphed_moe_layers_keep_the_counts_of_large_experts_on_the_device(
    triton_kernels,  # noqa: F811 (the fixture)
    monkeypatch,
):
    """Experts of any size (the threshold at 0 here) keep the layer's counts on the device in a
    model built for CUDA graphs; built without, they read them on the host."""
    monkeypatch.setattr(fp8_experts, "PER_EXPERT_FROM_FLOPS", 0.0)
    for impl, on_device in (("none", False), ("full_iteration", True)):
        config = _config("hybrid", "tensorwise", moe_grouped_gemm=True, cuda_graph_impl=impl)
        tokens = torch.zeros(64, config.hidden_size, dtype=torch.bfloat16)
        model = _gpt(config)
        layer = next(m for m in model.modules() if isinstance(m, moe_experts.GroupedMLP))
        assert layer._fp8_takes_device_counts(tokens, tokens.shape[0]) is on_device


def test_recomputed_moe_layers_give_the_same_gradients_and_amax_history():
    """`--recompute-modules moe`: the recomputed experts cast with the forward's scales and
    record nothing."""
    recompute = dict(recompute_granularity="selective", recompute_modules=["moe"])
    assert_recompute_changes_nothing(lambda **o: _gpt(_config(**o)), recompute, _train)


def test_compiled_moe_layers_run_the_same_fp8_experts():
    """With `compile_layers` the FP8 experts run outside the compiled graphs: the same losses
    and gradients as eager."""
    results = []
    for compile_layers in (False, True):
        model = _gpt(_config(compile_layers=compile_layers, compile_backend="aot_eager"))
        tokens, labels = make_token_batches(1, 2, seed=4)[0]
        losses = []
        for _ in range(2):  # the second pass casts with updated delayed scales
            loss = model(tokens, labels=labels).float().mean()
            loss.backward()
            losses.append(loss.detach())
        results.append((losses, [param.grad for param in model.parameters()]))
    (eager_losses, eager_grads), (compiled_losses, compiled_grads) = results
    assert eager_losses == compiled_losses
    assert all(torch.equal(a, b) for a, b in zip(eager_grads, compiled_grads))


@exact_cpu_scaled_mm
def test_compiled_grouped_moe_layers_choose_the_fp8_kernels_outside_the_graphs(
    triton_kernels,  # noqa: F811 (the fixture)
    monkeypatch,
):
    """The grouped FP8 experts' kernels are chosen where they run, outside the compiled graphs
    (the Triton kernels do not run while a compiler traces): a compiled layer runs the same
    Triton GEMMs as the eager one, with the same losses and gradients."""
    monkeypatch.setattr(
        expert_gemm_kernels, "kernels_available", lambda device: not torch.compiler.is_compiling()
    )
    results = []
    for compile_layers in (False, True):
        config = _config(
            moe_grouped_gemm=True, compile_layers=compile_layers, compile_backend="aot_eager"
        )
        model = _gpt(config)
        tokens, labels = make_token_batches(1, 2, seed=4)[0]
        triton_kernels.clear()
        loss = model(tokens, labels=labels).float().mean()
        loss.backward()
        assert triton_kernels.count("emulated_grouped_wgrad_into") == 2, triton_kernels
        results.append((loss.detach(), [param.grad for param in model.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert torch.equal(eager_loss, compiled_loss)
    assert all(torch.equal(a, b) for a, b in zip(eager_grads, compiled_grads))
