"""Gradient-accumulation fusion: a linear layer's weight gradient added by its GEMM straight into
the `main_grad` a data-parallel engine keeps for the weight (Megatron-LM's
`--gradient-accumulation-fusion`).

Without it, backward computes each weight gradient in the parameters' dtype (bf16) and the engine
then adds it into its fp32 `main_grad`: a rounding to bf16, a gradient-sized allocation, and an
elementwise kernel reading both and writing the sum. With it, the weight-gradient GEMM accumulates
into `main_grad` in its epilogue (`main_grad += dY^T X`, in fp32), and the layer hands autograd no
gradient for the weight.

An engine opts a parameter in with `register_main_grad(param, engine_method)` (the DDP engine does
so when the model's config sets `gradient_accumulation_fusion`). The parallel linears route
through `linear()` and `weight_grad()`, which fuse only while:

- the engine is alive: a deleted engine's parameters train as plain parameters again;
- the weight's `.grad` is None when its gradient is computed: a `.grad` kept from an earlier
  backward is accumulated into by autograd, as torch does, so the gradient is not split in two.

Autograd still runs the weight's `AccumulateGrad`, with no gradient from the fused layer, and the
parameter's post-accumulate-grad hooks fire as usual: the engine learns there that the gradient is
complete. Other uses of the weight in the same graph (a tied output layer's embedding lookup, a
penalty on the weight) reach `.grad` as usual and the engine adds them, so the sum is whole.
Tensor hooks on the weight (`register_hook`) see only those other contributions.

On CUDA the fp32 accumulation is one `addmm` with an fp32 output; elsewhere the product is
formed in the inputs' dtype and added (the unfused arithmetic, in one place).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.weak import WeakIdKeyDictionary

_targets: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Parameter -> weak reference to the engine method that returns its `main_grad`."""


def register_main_grad(
    param: torch.nn.Parameter, main_grad_of: Callable[[torch.nn.Parameter], torch.Tensor]
) -> None:
    """Sends the weight gradients of `param` (where a linear layer computes them) into the
    tensor `main_grad_of(param)` returns, while the object `main_grad_of` is bound to lives.

    Args:
        param: a trainable parameter.
        main_grad_of: a bound method (held weakly), called before each fused accumulation; it
            returns a tensor of `param`'s shape, in fp32 or `param`'s dtype, on its device
            (and may first reset it, e.g. where `zero_grad()` dropped a `.grad` it handed out).
    """
    _targets[param] = weakref.WeakMethod(main_grad_of)


def unregister_main_grad(param: torch.nn.Parameter) -> None:
    """Undoes `register_main_grad` (a no-op for a parameter never registered)."""
    _targets.pop(param, None)


def _target(weight: torch.Tensor) -> Callable[[torch.nn.Parameter], torch.Tensor] | None:
    ref = _targets.get(weight)
    return None if ref is None else ref()


def linear(
    input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(input_, weight, bias)`; the weight gradient fused into its registered
    `main_grad` (module docstring) where there is one, outside `torch.compile` (which traces
    `F.linear`, its gradient added by the engine)."""
    if (
        weight.requires_grad
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and _target(weight) is not None
    ):
        return _LinearIntoMainGrad.apply(input_, weight, bias)
    return F.linear(input_, weight, bias)


def weight_grad(
    grad_output: torch.Tensor, input_: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor | None:
    """The gradient of `weight` in `input_ @ weight.T = output`, or None where it went into the
    weight's registered `main_grad` instead.

    Args:
        grad_output: [..., out].
        input_: [..., in], the same leading shape.
        weight: [out, in].
    """
    grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
    input_2d = input_.reshape(-1, input_.shape[-1])
    main_grad_of = _target(weight)
    if main_grad_of is None or weight.grad is not None:
        return grad_2d.t().matmul(input_2d)
    main_grad = main_grad_of(weight)
    if main_grad.dtype == grad_2d.dtype:
        main_grad.addmm_(grad_2d.t(), input_2d)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_2d.t(), input_2d, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(grad_2d.t().matmul(input_2d))
    return None


class _LinearIntoMainGrad(torch.autograd.Function):
    """`F.linear` whose backward computes the weight gradient with `weight_grad`."""

    @staticmethod
    def forward(
        ctx, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(input_, weight)
        ctx.has_bias = bias is not None
        return F.linear(input_, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        input_, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad(grad_output, input_, weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        return grad_input, grad_weight, grad_bias
