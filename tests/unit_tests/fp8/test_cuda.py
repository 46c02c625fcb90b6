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
