"""FP8 in a GPT model: which linears run in FP8, the model end to end against a fake-quant twin,
full recompute, and the amax reduction over ranks (one all-reduce per pass)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from megatron.core.fp8 import linear
from megatron.core.fp8.linear import Fp8LinearSlots
from megatron.core.fp8.quantize import quantize
from megatron.core.fp8.scaling import BACKWARD, FORWARD
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.fp8.reference import E4M3, current_scale, dq, exact_cpu_scaled_mm, mm, q
from tests.unit_tests.model_builders import build_tiny_gpt, make_token_batches, tiny_gpt_config

BF16 = dict(params_dtype=torch.bfloat16, bf16=True)
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _fp8_config(fmt="hybrid", recipe="delayed", **overrides):
    fields = dict(fp8=fmt, fp8_recipe=recipe, **BF16)
    if recipe == "delayed":
        fields.update(fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    fields.update(overrides)
    return tiny_gpt_config(**fields)


def _fp8_flags(model: GPTModel) -> dict[str, bool]:
    return {
        name: module.fp8 is not None
        for name, module in model.named_modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear))
    }


def test_only_the_linears_of_fp8_layers_get_fp8_settings():
    """The four linears of every layer but the bf16 first / last ones; never the output layer."""
    config = _fp8_config(
        recipe="tensorwise",
        num_layers=4,
        first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=1,
        num_layers_at_end_in_bf16=2,
    )
    flags = _fp8_flags(build_tiny_gpt(config, share_embeddings_and_output_weights=False))
    expected = {"output_layer": False}
    for layer in range(4):
        for name in LINEARS:
            prefix = "self_attention" if name in LINEARS[:2] else "mlp"
            expected[f"decoder.layers.{layer}.{prefix}.{name}"] = layer == 1
    assert flags == expected


def test_a_layer_whose_sizes_are_not_multiples_of_16_is_refused_by_name():
    config = _fp8_config(hidden_size=40, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"layer layers\.0\.self_attention\.linear_qkv: weight"):
        build_tiny_gpt(config)


class _FakeQuantSlots(Fp8LinearSlots):
    """A layer's FP8 settings whose GEMMs run as the plain-torch reference: quantise with the
    scale the recipe gives, dequantise, multiply in fp32 (`mm`)."""

    @classmethod
    def replacing(cls, slots: Fp8LinearSlots) -> _FakeQuantSlots:
        fake = cls.__new__(cls)
        fake.__dict__.update(slots.__dict__)
        return fake

    def scale_for(self, direction: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.state is None:
            return current_scale(x, dtype)
        slot = self.input_slot if direction == FORWARD else self.grad_slot
        scale = self.state.scale(direction, slot, x.device).clone().reshape(())
        record = self.state.amax_record(direction, slot)
        if record is not None:
            record.copy_(torch.maximum(record, x.detach().abs().amax().float()))
        return scale

    def linear(self, input_, weight, bias, residual=None):
        out = _FakeQuantLinear.apply(input_, weight, bias, self)
        return out if residual is None else residual + out


class _FakeQuantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, slots):
        x2d = x.reshape(-1, x.shape[-1])
        sx = slots.scale_for(FORWARD, x2d, E4M3)
        sw = current_scale(weight, E4M3)
        xd = dq(q(x2d, sx, E4M3), sx.reciprocal())
        wd = dq(q(weight, sw, E4M3), sw.reciprocal())
        product = mm(xd, wd.t())
        if bias is not None:
            product = product + bias.float()
        ctx.save_for_backward(xd, wd)
        ctx.slots, ctx.shape, ctx.dtype, ctx.has_bias = slots, x.shape, x.dtype, bias is not None
        return product.to(x.dtype).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        xd, wd = ctx.saved_tensors
        g2d = grad.reshape(-1, grad.shape[-1])
        dtype = ctx.slots.recipe.backward_dtype
        sg = ctx.slots.scale_for(BACKWARD, g2d, dtype)
        gd = dq(q(g2d, sg, dtype), sg.reciprocal())
        dx = mm(gd, wd).to(ctx.dtype).view(ctx.shape)
        dw = mm(gd.t(), xd).to(ctx.dtype)
        return dx, dw, g2d.sum(0) if ctx.has_bias else None, None


def _train(
    model: GPTModel,
    steps: int = 4,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """`steps` steps of Adam on `batches` (default: batches of 3 of the tiny GPT's tokens); the
    losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for tokens, labels in batches or make_token_batches(steps, 3, seed=5):
        loss = model(tokens, labels=labels).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def assert_trains_as_its_fake_quant_twin(
    fp8: GPTModel,
    twin: GPTModel,
    train: Callable[[GPTModel], list[torch.Tensor]] = _train,
    blocks: tuple[str, ...] = (),
) -> None:
    """`fp8` and `twin` (built alike), the FP8 linears of `twin` running the plain-torch
    reference (`_FakeQuantSlots`), trained by `train`: the same losses and weights, and the
    same delayed-scaling states of `blocks`, bit for bit."""
    for module in twin.modules():
        if getattr(module, "fp8", None) is not None:
            module.fp8 = _FakeQuantSlots.replacing(module.fp8)
    assert train(fp8) == train(twin)
    for (name, a), b in zip(fp8.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name
    for block in blocks:
        state = getattr(fp8, block).fp8_state.scaling_tensors()
        twin_state = getattr(twin, block).fp8_state.scaling_tensors()
        for key, value in state.items():
            assert torch.equal(value, twin_state[key]), (block, key)


@exact_cpu_scaled_mm
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_gpt_equals_its_fake_quant_twin(fmt, recipe):
    """A tiny bf16 GPT trained a few steps in FP8 and its twin whose FP8 linears run the
    plain-torch reference: the same losses and weights, bit for bit."""
    fp8 = build_tiny_gpt(_fp8_config(fmt, recipe))
    twin = build_tiny_gpt(_fp8_config(fmt, recipe))
    blocks = ("decoder",) if recipe == "delayed" else ()
    assert_trains_as_its_fake_quant_twin(fp8, twin, blocks=blocks)


def test_fp8_training_stays_close_to_bf16():
    """The same tiny model in bf16 and in FP8: the losses of a few steps agree closely."""
    bf16 = _train(build_tiny_gpt(tiny_gpt_config(**BF16)), steps=6)
    fp8 = _train(build_tiny_gpt(_fp8_config()), steps=6)
    assert fp8 != bf16
    for a, b in zip(fp8, bf16):
        assert abs(a - b) < 0.02 * b


FULL_RECOMPUTE = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
)


def assert_recompute_changes_nothing(
    build: Callable[..., GPTModel],
    recompute: dict,
    train: Callable[[GPTModel, int], object] = _train,
    batch: tuple[torch.Tensor, torch.Tensor] | None = None,
    blocks: tuple[str, ...] = ("decoder",),
) -> None:
    """`build()` and `build(**recompute)`, each trained 2 steps by `train`, then a forward and
    backward on `batch`: the same gradients and the same delayed-scaling state of each of
    `blocks` (recomputed forwards cast with the forward's scales and record nothing)."""
    tokens, labels = batch or make_token_batches(1, 3, seed=9)[0]
    results = []
    for overrides in ({}, recompute):
        model = build(**overrides)
        train(model, 2)
        model(tokens, labels=labels).float().mean().backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        states = {block: getattr(model, block).fp8_state.scaling_tensors() for block in blocks}
        results.append((grads, states))
    (grads, states), (recomputed_grads, recomputed_states) = results
    for name, grad in grads.items():
        assert torch.equal(grad, recomputed_grads[name]), name
    for block, state in states.items():
        for key, value in state.items():
            assert torch.equal(value, recomputed_states[block][key]), (block, key)


def test_full_recompute_gives_the_same_gradients_and_amax_history():
    assert_recompute_changes_nothing(lambda **o: build_tiny_gpt(_fp8_config(**o)), FULL_RECOMPUTE)


def _amax_reduction_run() -> tuple[dict[str, torch.Tensor], int]:
    """A forward and backward of the tiny FP8 GPT on this rank's own batch (no engine): the
    state after them, and the all-reduces issued."""
    model = build_tiny_gpt(_fp8_config())
    tokens, labels = make_token_batches(1, 2, seed=dist.get_rank())[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(tokens, labels=labels).float().mean().backward()
    reduces = sum(event.name == "c10d::allreduce_" for event in profile.events())
    return model.decoder.fp8_state.scaling_tensors(), reduces


def test_amaxes_are_reduced_over_ranks_once_per_pass():
    """Two ranks with different data end with the same histories and scales, after one
    all-reduce for the forward pass and one for the backward."""
    (state0, reduces0), (state1, reduces1) = run_distributed(_amax_reduction_run, 2)
    assert reduces0 == reduces1 == 2
    for key, value in state0.items():
        assert torch.equal(value, state1[key]), key
    assert (state0["scale_fwd"] != 1).all() and (state0["scale_bwd"] != 1).all()


def _eager_and_compiled_passes(
    device: torch.device | None = None, **fields
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Two forward and backward passes of the tiny FP8 GPT, eager then with compiled layers
    (`fields` set the rest of the config), on `device` (None: the rank's): each run's losses
    and gradients. The second pass casts with the scales the first updated."""
    device = current_device() if device is None else device
    results = []
    for compile_layers in (False, True):
        model = build_tiny_gpt(_fp8_config(compile_layers=compile_layers, **fields)).to(device)
        tokens, labels = make_token_batches(1, 2, seed=4)[0]
        tokens, labels = tokens.to(device), labels.to(device)
        losses = []
        for _ in range(2):
            loss = model(tokens, labels=labels).float().mean()
            loss.backward()
            losses.append(loss.detach())
        results.append((losses, [param.grad for param in model.parameters()]))
    return results


def test_compiled_layers_run_the_same_fp8_linears():
    """With `compile_layers` the FP8 linears run between the compiled graphs: the same losses
    and gradients as eager."""
    (eager_losses, eager_grads), (losses, grads) = _eager_and_compiled_passes(
        compile_backend="aot_eager"
    )
    assert eager_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(eager_grads, grads))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_inductor_layers_around_fp8_linears_compute_the_eager_results(recipe):
    """On CUDA inductor compiles the layers around the FP8 linears' `torch._scaled_mm`, with
    its C++ wrapper (the default there). In fp32 its kernels reorder sums, so the bound is fp32
    reassociation, as for compiled layers without FP8: an input that lands that close to an FP8
    rounding boundary is rare enough at this size that the casts see the same values."""
    fp32 = dict(params_dtype=torch.float32, bf16=False)
    cuda = torch.device("cuda")
    passes = _eager_and_compiled_passes(cuda, recipe=recipe, compile_backend="inductor", **fp32)
    (eager_losses, eager_grads), (losses, grads) = passes
    assert all(grad.is_cuda for grad in grads)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-6)


def test_a_frozen_fp8_model_gives_outputs_that_need_no_gradient():
    """As in bf16: the delayed-scaling backward hook is added only where a backward can come."""
    tokens, labels = make_token_batches(1, 2)[0]
    for config in (_fp8_config(), tiny_gpt_config(**BF16)):
        model = build_tiny_gpt(config)
        model.requires_grad_(False)
        assert not model(tokens, labels=labels).requires_grad


def test_an_evaluation_forward_makes_no_transposed_copies(monkeypatch):
    """Under `torch.no_grad()` no weight gradient can be asked for: no cast makes the transposed
    input (a training forward does)."""
    transposes = []

    def recording_quantize(x, dtype, **kwargs):
        transposes.append(kwargs.get("transpose", False))
        return quantize(x, dtype, **kwargs)

    monkeypatch.setattr(linear, "quantize", recording_quantize)
    model = build_tiny_gpt(_fp8_config(recipe="tensorwise"))
    tokens, labels = make_token_batches(1, 2)[0]
    with torch.no_grad():
        model(tokens, labels=labels)
    assert transposes and not any(transposes)
    transposes.clear()
    model(tokens, labels=labels)
    assert all(transposes)
