"""The FP8 linear layer on CUDA (`torch._scaled_mm` on Hopper, the fused casts) computes what the
plain-torch reference computes from the same quantised operands, within the rounding of a GEMM
that accumulates in another order (fast accumulation in the forward GEMM): a wrong operand,
layout, format or scale would be off by far more."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.linear import Fp8LinearSlots
from megatron.core.fp8.scaling import DelayedScalingState
from tests.unit_tests.fp8 import test_linear
from tests.unit_tests.model_builders import build_tiny_gpt, make_token_batches, tiny_gpt_config

pytestmark = pytest.mark.gpu


def _on_cuda(*tensors):
    moved = []
    for tensor in tensors:
        if tensor is None:
            moved.append(None)
            continue
        copy = tensor.detach().cuda()
        if isinstance(tensor, torch.nn.Parameter):
            copy = torch.nn.Parameter(copy)
        elif tensor.requires_grad:
            copy.requires_grad_()
        moved.append(copy)
    return moved


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs an FP8 GPU (compute capability 8.9 or newer)",
)
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_cuda_fp8_linear_computes_the_reference(fmt, kind):
    weight, bias, x, grad = test_linear._case()
    expected = test_linear._reference(test_linear._slots(fmt, kind), weight, bias, x, grad)
    slots = test_linear._slots(fmt, kind)
    if slots.state is not None:  # the same scales, in a state on the GPU
        state_dict = {key: value.cuda() for key, value in slots.state.scaling_tensors().items()}
        slots = Fp8LinearSlots(slots.recipe, DelayedScalingState(slots.recipe, group=None))
        slots.state.load_scaling_tensors(state_dict)
    weight, bias, x, grad = _on_cuda(weight, bias, x, grad)
    y = slots.linear(x, weight, bias)
    y.backward(grad)
    for actual, reference in zip((y, x.grad, weight.grad), expected):
        reference = reference.to(actual.dtype)
        atol = 2e-2 * reference.abs().max().item()
        torch.testing.assert_close(actual.cpu(), reference, rtol=2e-2, atol=atol)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs an FP8 GPU (compute capability 8.9 or newer)",
)
def test_a_state_loaded_before_the_first_cast_moves_to_the_gpu():
    """A delayed-scaling state loaded into a fresh model waits on the CPU (it does not know
    where the model computes) and moves to the GPU at the first cast, also for the scales a
    recomputed layer replays: the next step of the loaded model is the saved model's."""
    config = tiny_gpt_config(
        fp8="hybrid",
        fp8_amax_history_len=4,
        fp8_amax_compute_algo="max",
        params_dtype=torch.bfloat16,
        bf16=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    batches = [(x.cuda(), y.cuda()) for x, y in make_token_batches(3, 4, seed=0)]
    saved = build_tiny_gpt(config).cuda()
    for tokens, labels in batches[:2]:  # no optimizer step: only the FP8 state changes
        saved(tokens, labels=labels).float().mean().backward()
    loaded = build_tiny_gpt(config).cuda()  # the same weights
    loaded.load_state_dict(saved.state_dict())
    assert loaded.decoder.fp8_state.scaling_tensors()["scale_fwd"].device.type == "cpu"
    results = []
    for model in (saved, loaded):
        model.zero_grad(set_to_none=True)
        tokens, labels = batches[2]
        loss = model(tokens, labels=labels).float().mean()
        state = model.decoder.fp8_state.scaling_tensors()  # after the forward's update
        loss.backward()
        results.append((loss.detach(), state, {n: p.grad for n, p in model.named_parameters()}))
    (loss, state, grads), (loaded_loss, loaded_state, loaded_grads) = results
    assert torch.equal(loaded_loss, loss)
    for key in ("amax_history_fwd", "scale_fwd"):
        assert loaded_state[key].is_cuda and torch.equal(loaded_state[key], state[key]), key
    for name, grad in grads.items():
        torch.testing.assert_close(loaded_grads[name], grad, msg=name)
