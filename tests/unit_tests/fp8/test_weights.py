"""The FP8 weight copies: current-scaled per tensor (or per 128x128 block), made once and made
again after every signal that the weight may have changed (an in-place write, any optimizer
step, fused kernels included, an engine's `forget_fp8_weights`), and an engine's provider taking
over (or, where it answers None, leaving the weight to the cache)."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron.core.fp8 import weights
from megatron.core.fp8.blockwise import SQUARE_BLOCK
from megatron.core.fp8.weights import (
    Fp8Weight,
    forget_fp8_weights,
    fp8_weight_of,
    register_fp8_weight,
)
from tests.unit_tests.fp8.reference import E4M3, block_dq, block_q, current_scale, q


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


def test_a_provider_answering_none_leaves_the_weight_to_the_cache():
    """A provider whose copy no longer follows the parameter answers None: the weight is cast
    whole, cached as any other, while the provider is still asked first."""
    asked: list[bool] = []

    def provider(param):
        asked.append(True)
        return None if len(asked) < 3 else Fp8Weight.quantized(torch.zeros_like(param))

    weight = _weight()
    register_fp8_weight(weight, provider)
    first = fp8_weight_of(weight)
    scale = current_scale(weight, E4M3)
    assert torch.equal(first.tensor.scale_inv, scale.reciprocal())
    assert torch.equal(first.tensor.data.float(), q(weight.detach(), scale, E4M3).float())
    assert fp8_weight_of(weight) is first
    assert not fp8_weight_of(weight).tensor.data.float().any()  # the provider's again
    assert len(asked) == 3


def test_entries_leave_with_their_parameter():
    weight = _weight()
    fp8_weight_of(weight)
    key = id(weight)
    assert key in weights._cache
    del weight
    gc.collect()
    assert key not in weights._cache


def test_a_blockwise_copy_has_128x128_blocks_and_transposes_them_whole():
    weight = torch.nn.Parameter(torch.randn(144, 272).bfloat16())
    copy = fp8_weight_of(weight, blockwise=True)
    data, scale_inv = block_q(weight, E4M3, SQUARE_BLOCK)
    assert torch.equal(copy.tensor.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(copy.tensor.scale_inv, scale_inv)
    fprop, dgrad = copy.fprop_operand(), copy.dgrad_operand()
    assert fprop.data.shape == (272, 144) and fprop.data.stride() == (1, 272)  # W^T column-major
    assert dgrad.data.shape == (144, 272) and dgrad.data.stride() == (1, 144)  # W column-major
    assert dgrad.block == SQUARE_BLOCK
    assert torch.equal(dgrad.dequantize(), block_dq(data, scale_inv, SQUARE_BLOCK))
    assert fp8_weight_of(weight, blockwise=True) is copy
    assert fp8_weight_of(weight).tensor.scale_inv.numel() == 1  # the per-tensor copy: made anew


def test_a_blockwise_layer_refuses_an_engines_per_tensor_copy():
    """An engine that keeps FP8 weights (fp8_param_gather) keeps them per tensor: a blockwise
    layer asking for one is refused rather than given the wrong scales."""
    weight = _weight()
    register_fp8_weight(weight, lambda param: Fp8Weight.quantized(param))
    with pytest.raises(ValueError, match="the blockwise recipe scales them per 128x128 block"):
        fp8_weight_of(weight, blockwise=True)
