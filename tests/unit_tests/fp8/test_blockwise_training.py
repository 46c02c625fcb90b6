"""The blockwise recipe in training, on CPU: the linear layer's three GEMMs against the plain-torch
reference that quantises with the same block scales (partial blocks, tokens not a multiple of
128), weight gradients fused into a `main_grad`, a checkpointed linear, and a tiny GPT trained a
few steps against its twin whose FP8 linears run the reference, with and without full
recompute."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.blockwise import ROW_BLOCK, SQUARE_BLOCK
from megatron.core.fp8.linear import Fp8LinearSlots
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.grad_accumulation import linear, register_main_grad
from megatron.core.transformer.recompute import recompute
from tests.unit_tests.fp8.reference import E4M3, block_fake_quant, padded_tokens_t
from tests.unit_tests.fp8.test_linear import _Engine
from tests.unit_tests.model_builders import build_tiny_gpt, make_token_batches, tiny_gpt_config

BF16 = torch.bfloat16
BLOCKWISE = dict(fp8="e4m3", fp8_recipe="blockwise", params_dtype=BF16, bf16=True)


def _slots() -> Fp8LinearSlots:
    return Fp8LinearSlots(Fp8Recipe("e4m3", "blockwise"))


def _case(seed: int = 0):
    """A bf16 weight [144, 208] (partial 128x128 blocks), bias, input [3, 50, 208] (150 tokens)
    and output gradient [3, 50, 144]."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(144, 208, generator=generator).to(BF16))
    bias = torch.nn.Parameter(torch.randn(144, generator=generator).to(BF16))
    x = (torch.randn(3, 50, 208, generator=generator) * 2).to(BF16).requires_grad_()
    grad = (torch.randn(3, 50, 144, generator=generator) * 1e-3).to(BF16)
    return weight, bias, x, grad


def _reference_gemms(x2d, weight, bias, g2d):
    """(Y, dX, dW) in fp32 from the block-quantised operands: X and dY in 1x128 blocks, W in
    128x128 ones, and for dW both transposed and quantised again in 1x128 blocks along the
    tokens, padded with zero tokens to a multiple of 128 as the layer contracts over them."""
    xd = block_fake_quant(x2d, E4M3, ROW_BLOCK)
    wd = block_fake_quant(weight, E4M3, SQUARE_BLOCK)
    gd = block_fake_quant(g2d, E4M3, ROW_BLOCK)
    product = xd @ wd.t()
    y = product if bias is None else product + bias.float()
    grad_t = block_fake_quant(padded_tokens_t(g2d), E4M3, ROW_BLOCK)
    input_t = block_fake_quant(padded_tokens_t(x2d), E4M3, ROW_BLOCK)
    return y, gd @ wd, grad_t @ input_t.t()


def test_three_gemms_equal_the_reference():
    weight, bias, x, grad = _case()
    y = linear(x, weight, bias, _slots())
    y.backward(grad)
    expected_y, expected_dx, expected_dw = _reference_gemms(
        x.detach().reshape(-1, 208), weight.detach(), bias.detach(), grad.reshape(-1, 144)
    )
    assert torch.equal(y, expected_y.to(BF16).view(3, 50, 144))
    assert torch.equal(x.grad, expected_dx.to(BF16).view(3, 50, 208))
    assert torch.equal(weight.grad, expected_dw.to(BF16))
    assert torch.equal(bias.grad, grad.reshape(-1, 144).sum(0))


@pytest.mark.parametrize("overwrite", [True, False])
def test_weight_gradient_is_fused_into_an_fp32_main_grad(overwrite):
    weight, bias, x, grad = _case(seed=1)
    engine = _Engine(weight, overwrite)
    register_main_grad(weight, engine.main_grad_of)
    linear(x, weight, bias, _slots()).backward(grad)
    _, _, expected = _reference_gemms(
        x.detach().reshape(-1, 208), weight.detach(), bias.detach(), grad.reshape(-1, 144)
    )
    assert weight.grad is None
    assert torch.equal(engine.main_grad, expected if overwrite else expected + 0.5)


def test_a_checkpointed_linear_recomputes_the_forwards_casts():
    weight, bias, x, grad = _case(seed=2)
    results = []
    for checkpointed in (False, True):
        x.grad = weight.grad = bias.grad = None
        y = (recompute if checkpointed else lambda f, *a: f(*a))(linear, x, weight, bias, _slots())
        y.backward(grad)
        results.append((y, x.grad, weight.grad, bias.grad))
    for plain, recomputed in zip(*results):
        assert torch.equal(plain, recomputed)


class _ReferenceSlots(Fp8LinearSlots):
    """A blockwise layer's FP8 settings whose GEMMs run the plain-torch reference."""

    def linear(self, input_, weight, bias, residual=None):
        out = _ReferenceLinear.apply(input_, weight, bias)
        return out if residual is None else residual + out


class _ReferenceLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2d, weight)
        ctx.shape, ctx.has_bias = x.shape, bias is not None
        y = (
            block_fake_quant(x2d, E4M3, ROW_BLOCK)
            @ block_fake_quant(weight, E4M3, SQUARE_BLOCK).t()
        )
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        g2d = grad.reshape(-1, grad.shape[-1])
        _, dx, dw = _reference_gemms(x2d, weight, None, g2d)
        bias_grad = g2d.sum(0) if ctx.has_bias else None
        return dx.to(grad.dtype).view(ctx.shape), dw.to(weight.dtype), bias_grad


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


def test_a_blockwise_gpt_trains_as_its_reference_twin():
    """A tiny bf16 GPT trained a few steps with the blockwise recipe and its twin whose FP8
    linears run the plain-torch reference: the same losses and weights, bit for bit."""
    model = build_tiny_gpt(tiny_gpt_config(**BLOCKWISE))
    twin = build_tiny_gpt(tiny_gpt_config(**BLOCKWISE))
    assert model.decoder.fp8_state is None  # no delayed state to save or restore
    replaced = 0
    for module in twin.modules():
        if getattr(module, "fp8", None) is not None:
            module.fp8 = _ReferenceSlots(module.fp8.recipe)
            replaced += 1
    assert replaced == 8  # the four linears of each of the two layers
    losses, twin_losses = _train(model), _train(twin)
    assert losses == twin_losses
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


def test_full_recompute_gives_the_same_gradients():
    recomputed = dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    grads = []
    for overrides in ({}, recomputed):
        model = build_tiny_gpt(tiny_gpt_config(**BLOCKWISE, **overrides))
        _train(model, steps=1)
        tokens, labels = make_token_batches(1, 3, seed=9)[0]
        model(tokens, labels=labels).float().mean().backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name
