"""The FP8 weight copies: current-scaled per tensor, made once and made again after every
signal that the weight may have changed (an in-place write, any optimizer step, fused kernels
included, an engine's `forget_fp8_weights`), and an engine's provider taking over."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron.core.fp8 import weights
from megatron.core.fp8.weights import (
    Fp8Weight,
    forget_fp8_weights,
    fp8_weight_of,
    register_fp8_weight,
)
from tests.unit_tests.fp8.reference import E4M3, current_scale, q


def _weight() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(32, 16).bfloat16())


def test_the_copy_is_the_current_scaled_weight_and_its_transpose():
    weight = _weight()
    copy = fp8_weight_of(weight)
    scale = current_scale(weight, E4M3)
    expected = q(weight, scale, E4M3)
    assert torch.equal(copy.tensor.data.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(copy.tensor.scale_inv, scale.reciprocal())
    fprop, dgrad = copy.fprop_operand(), copy.dgrad_operand()
    assert fprop.data.shape == (16, 32) and fprop.data.stride() == (1, 16)  # W^T column-major
    assert dgrad.data.shape == (32, 16) and dgrad.data.stride() == (1, 32)  # W column-major
    assert torch.equal(dgrad.data.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda p: torch.optim.SGD([p], lr=0.1),
        lambda p: torch.optim.AdamW([p], lr=0.1, fused=True),  # bumps no version counter
    ],
)
def test_made_once_until_the_weight_may_have_changed(optimizer):
    weight = _weight()
    first = fp8_weight_of(weight)
    assert fp8_weight_of(weight) is first  # once per step, not per use
    with torch.no_grad():
        weight.mul_(2)
    second = fp8_weight_of(weight)
    assert second is not first
    weight.grad = torch.ones_like(weight)
    optimizer(weight).step()
    third = fp8_weight_of(weight)
    assert third is not second
    expected = q(weight, current_scale(weight, E4M3), E4M3)
    assert torch.equal(third.tensor.data.view(torch.uint8), expected.view(torch.uint8))
    forget_fp8_weights([weight])
    assert fp8_weight_of(weight) is not third


def test_a_data_swap_makes_the_copy_again():
    """`.data` assignments (`model.cuda()`, `model.to(dtype)`) bump no version counter: the
    copy follows the new tensor all the same."""
    weight = _weight()
    first = fp8_weight_of(weight)
    weight.data = weight.data * 2
    second = fp8_weight_of(weight)
    assert second is not first
    assert torch.equal(second.tensor.scale_inv, current_scale(weight, E4M3).reciprocal())
    weight.data = weight.data.float()  # the same values in another dtype
    assert fp8_weight_of(weight) is not second


def test_tensors_that_are_not_parameters_are_not_cached():
    plain = torch.randn(16, 16)
    assert fp8_weight_of(plain) is not fp8_weight_of(plain)


def test_a_registered_provider_is_asked_while_its_engine_lives():
    class Engine:
        def __init__(self):
            self.made: list[torch.nn.Parameter] = []

        def fp8_weight(self, param):
            self.made.append(param)
            return Fp8Weight.quantized(torch.zeros_like(param))

    weight, engine = _weight(), Engine()
    register_fp8_weight(weight, engine.fp8_weight)
    assert not fp8_weight_of(weight).tensor.data.float().any()
    assert engine.made == [weight]
    del engine
    gc.collect()
    assert fp8_weight_of(weight).tensor.data.float().any()  # the cache again


def test_entries_leave_with_their_parameter():
    weight = _weight()
    fp8_weight_of(weight)
    key = id(weight)
    assert key in weights._cache
    del weight
    gc.collect()
    assert key not in weights._cache
