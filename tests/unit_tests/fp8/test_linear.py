"""The FP8 linear layer's three GEMMs against plain-torch references that quantise with the same
scales (cast and dequantise, multiply in fp32): forward, input gradient and weight gradient, for
each format and recipe; the high-precision weight gradient of `--no-fp8-wgrad`; weight
gradients fused into an engine's `main_grad` (written over or added to) and the
`torch.autograd.grad` paths that must leave it alone."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.fp8 import quantize
from megatron.core.fp8.linear import Fp8LinearSlots
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.scaling import DelayedScalingState
from megatron.core.tensor_parallel.grad_accumulation import (
    FusionTarget,
    linear,
    register_main_grad,
)
from tests.unit_tests.fp8.reference import E4M3, E5M2, current_scale, dq, exact_cpu_scaled_mm, q

BF16 = torch.bfloat16
SCALE_FWD, SCALE_BWD = 3.0, 2.0**12
"""The delayed state's scales in these tests: small enough for some inputs to saturate."""


def _slots(fmt: str, kind: str, wgrad: bool = True) -> Fp8LinearSlots:
    recipe = Fp8Recipe(fmt, kind, wgrad=wgrad)
    if kind == "tensorwise":
        return Fp8LinearSlots(recipe)
    state = DelayedScalingState(recipe, group=None)
    slots = Fp8LinearSlots(recipe, state)
    state.load_scaling_tensors(
        {
            "amax_history_fwd": torch.zeros(1, 1),
            "scale_fwd": torch.tensor([SCALE_FWD]),
            "amax_history_bwd": torch.zeros(1, 1),
            "scale_bwd": torch.tensor([SCALE_BWD]),
        }
    )
    return slots


def _case(seed: int = 0, bias: bool = True):
    """A bf16 weight [48, 64], bias, input [3, 5, 64] and output gradient [3, 5, 48]."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(48, 64, generator=generator).to(BF16))
    bias_ = torch.nn.Parameter(torch.randn(48, generator=generator).to(BF16)) if bias else None
    x = (torch.randn(3, 5, 64, generator=generator) * 2).to(BF16).requires_grad_()
    grad = (torch.randn(3, 5, 48, generator=generator) * 1e-3).to(BF16)
    return weight, bias_, x, grad


def _scales(slots: Fp8LinearSlots, x: torch.Tensor, grad: torch.Tensor):
    """(input scale, gradient scale) the layer casts with."""
    if slots.state is None:
        return current_scale(x, E4M3), current_scale(grad, slots.recipe.backward_dtype)
    return torch.tensor(SCALE_FWD), torch.tensor(SCALE_BWD)


def _reference(slots, weight, bias, x, grad):
    """(y, dx, dw) with the layer's scales, in the plain-torch arithmetic."""
    bwd = slots.recipe.backward_dtype
    sx, sg = _scales(slots, x, grad)
    sw = current_scale(weight, E4M3)
    x2d, g2d = x.detach().reshape(-1, 64), grad.reshape(-1, 48)
    xd = dq(q(x2d, sx, E4M3), sx.reciprocal())
    wd = dq(q(weight, sw, E4M3), sw.reciprocal())
    gd = dq(q(g2d, sg, bwd), sg.reciprocal())
    product = xd @ wd.t()
    y = (product if bias is None else product + bias.float()).to(BF16).view(3, 5, 48)
    dx = (gd @ wd).to(BF16).view(3, 5, 64)
    dw = gd.t() @ xd
    return y, dx, dw


@exact_cpu_scaled_mm
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_three_gemms_equal_the_reference(fmt, kind):
    slots = _slots(fmt, kind)
    weight, bias, x, grad = _case()
    y = linear(x, weight, bias, slots)
    y.backward(grad)
    expected_y, expected_dx, expected_dw = _reference(slots, weight, bias, x, grad)
    assert torch.equal(y, expected_y)
    assert torch.equal(x.grad, expected_dx)
    assert torch.equal(weight.grad, expected_dw.to(BF16))
    assert torch.equal(bias.grad, grad.reshape(-1, 48).sum(0))
    if kind == "delayed":  # this pass's amaxes recorded for the update
        recorded = slots.state.scaling_tensors()
        assert recorded["amax_history_fwd"][0, 0] == x.detach().abs().max().float()
        assert recorded["amax_history_bwd"][0, 0] == grad.abs().max().float()


def test_hybrid_casts_the_output_gradient_to_e5m2():
    """E5M2's range keeps a gradient E4M3 would clip: with the same scale the two formats'
    input gradients differ exactly where E4M3 saturates."""
    weight, bias, x, grad = _case()
    grad = grad * 1e3  # values up to ~4: times 2^12 beyond E4M3's 448
    grads = {}
    for fmt in ("e4m3", "hybrid"):
        x.grad = None
        linear(x, weight, bias, _slots(fmt, "delayed")).backward(grad)
        grads[fmt] = x.grad.clone()
    assert not torch.equal(grads["e4m3"], grads["hybrid"])
    _, expected, _ = _reference(_slots("hybrid", "delayed"), weight, bias, x, grad)
    assert torch.equal(grads["hybrid"], expected)
    assert q(grad, torch.tensor(SCALE_BWD), E5M2).float().abs().max() > 448


def test_no_fp8_wgrad_computes_the_weight_gradient_in_high_precision():
    slots = _slots("hybrid", "delayed", wgrad=False)
    weight, bias, x, grad = _case()
    linear(x, weight, bias, slots).backward(grad)
    expected = grad.reshape(-1, 48).t().matmul(x.detach().reshape(-1, 64))
    assert torch.equal(weight.grad, expected)


class _Engine:
    """Stands for a data-parallel engine that keeps fp32 main gradients on the weight's device
    (`contiguous`: False for a main_grad a GEMM cannot write, a transposed view)."""

    def __init__(self, weight: torch.nn.Parameter, overwrite: bool, contiguous: bool = True):
        shape = weight.shape if contiguous else weight.shape[::-1]
        self.main_grad = torch.full(shape, 0.5, device=weight.device)
        if not contiguous:
            self.main_grad = self.main_grad.t()
        self.overwrite = overwrite

    def main_grad_of(self, param: torch.nn.Parameter) -> FusionTarget:
        return FusionTarget(self.main_grad, self.overwrite)


@pytest.mark.parametrize("overwrite", [True, False])
def test_weight_gradient_is_fused_into_an_fp32_main_grad(overwrite):
    """Written over (its old values unread) or added to, in fp32, unrounded."""
    slots = _slots("hybrid", "tensorwise")
    weight, bias, x, grad = _case()
    engine = _Engine(weight, overwrite)
    register_main_grad(weight, engine.main_grad_of)
    linear(x, weight, bias, slots).backward(grad)
    _, _, expected = _reference(slots, weight, bias, x, grad)
    assert weight.grad is None
    assert torch.equal(engine.main_grad, expected if overwrite else expected + 0.5)


@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("overwrite", [True, False])
def test_a_batch_of_no_tokens_has_zero_weight_and_bias_gradients(kind, overwrite):
    slots = _slots("hybrid", kind)
    weight = torch.nn.Parameter(torch.randn(48, 64).bfloat16())
    bias = torch.nn.Parameter(torch.randn(48).bfloat16())
    engine = _Engine(weight, overwrite)
    register_main_grad(weight, engine.main_grad_of)
    x = torch.randn(2, 0, 64).bfloat16().requires_grad_()
    y = linear(x, weight, bias, slots)
    assert y.shape == (2, 0, 48)
    y.backward(torch.randn(2, 0, 48).bfloat16())
    assert x.grad.shape == x.shape
    assert torch.equal(engine.main_grad, torch.full((48, 64), 0.0 if overwrite else 0.5))
    assert torch.equal(bias.grad, torch.zeros(48).bfloat16())


@exact_cpu_scaled_mm
def test_autograd_grad_and_backward_inputs_leave_main_grad_alone():
    """`torch.autograd.grad` asking for the weight gets its gradient; without it (or
    `backward(inputs=...)` without the weight) none is computed; `main_grad` stays untouched."""
    slots = _slots("e4m3", "tensorwise")
    weight, _, x, grad = _case(bias=False)
    engine = _Engine(weight, overwrite=False)
    register_main_grad(weight, engine.main_grad_of)
    _, expected_dx, expected_dw = _reference(slots, weight, None, x, grad)
    grad_w, grad_x = torch.autograd.grad(linear(x, weight, None, slots), (weight, x), grad)
    (grad_x_only,) = torch.autograd.grad(linear(x, weight, None, slots), x, grad)
    linear(x, weight, None, slots).backward(grad, inputs=[x])
    assert torch.equal(grad_w, expected_dw.to(BF16))
    for got in (grad_x, grad_x_only, x.grad):
        assert torch.equal(got, expected_dx)
    assert weight.grad is None and torch.all(engine.main_grad == 0.5)


@pytest.mark.parametrize("selective", [False, True])
def test_a_checkpointed_linear_recomputes_the_forwards_cast(selective):
    """A non-reentrant checkpoint around an FP8 linear under delayed scaling, with the scales
    changed between forward and backward (as the end of the block's forward does): the
    recomputed forward casts with the forward's scale, so the gradients are the uncheckpointed
    ones, and nothing is recorded twice. A selective checkpoint (keeping the GEMMs' outputs)
    refuses a recomputation that dispatches an op its forward did not: the replayed casts
    dispatch none to view the forward's scales."""
    from megatron.core.transformer.recompute import recompute, recompute_keeping

    weight, bias, x, grad = _case()
    results = []
    for checkpointed in (False, True):
        slots = _slots("hybrid", "delayed")
        if checkpointed and selective:
            kept = {torch.ops.aten._scaled_mm.default}
            y = recompute_keeping(kept, linear, x, weight, bias, slots)
        elif checkpointed:
            y = recompute(linear, x, weight, bias, slots)
        else:
            y = linear(x, weight, bias, slots)
        recorded = slots.state.scaling_tensors()["amax_history_fwd"].clone()
        changed = slots.state.scaling_tensors()  # as an update between the passes would
        changed["scale_fwd"].fill_(100.0)
        slots.state.load_scaling_tensors(changed)
        x.grad = weight.grad = bias.grad = None
        y.backward(grad)
        results.append((y, x.grad, weight.grad, bias.grad, recorded, slots.state.scaling_tensors()))
    (plain, checkpointed) = results
    for a, b in zip(plain[:4], checkpointed[:4]):
        assert torch.equal(a, b)
    assert torch.equal(plain[4], checkpointed[4])
    assert torch.equal(plain[5]["amax_history_fwd"], checkpointed[5]["amax_history_fwd"])


class _OpsOutsideTheReferenceQuantiser(TorchDispatchMode):
    """The aten ops dispatched while active, but those of the reference quantiser (which runs
    off CUDA in place of a kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not quantize._quantize_reference.__code__:
            frame = frame.f_back
        if frame is None:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
def test_a_call_views_neither_the_scaling_state_nor_the_weight(kind):
    """Host work per call (each op is a launch or an allocation on a GPU): once the first call
    has made them, an FP8 linear's forward and backward take their delayed-scaling scales and
    amax records and their FP8 weight's GEMM operands as views made before, slicing nothing,
    and view a tensor transposed only once (the saved input's, for the weight gradient)."""
    slots = _slots("hybrid", kind)
    weight, bias, x, grad = _case()
    linear(x, weight, bias, slots).backward(grad)
    counted = _OpsOutsideTheReferenceQuantiser()
    with counted:
        linear(x, weight, bias, slots).backward(grad)
    assert "_scaled_mm" in counted.ops
    assert not {"slice", "select", "narrow"} & set(counted.ops), counted.ops
    assert counted.ops.count("t") == 1, counted.ops
