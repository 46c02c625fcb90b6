"""An MoE expert projection's bias, times each row's routing weight, added to its output in one
Triton kernel per direction.

The experts' rows come grouped by expert (`counts` rows each, on the device), then padding rows,
which get no bias. With PyTorch's ops, `x + bias_rows * weights` repeats the bias over the rows,
multiplies it by the fp32 weights into an fp32 tensor of the output's size, adds, and casts the
sum back; backward casts and multiplies again and reduces two tensors of that size: eight or so
passes over the projection's output. Here forward is one pass (`x + bias[e(r)] * w[r]` in fp32,
rounded once), and backward passes the output gradient through to `x` as it is, takes the
weights' gradient (`sum_j grad[r, j] * bias[e(r), j]`) in one pass and the bias's (each expert's
rows' `grad * w`, summed in order) in another (`segment_sum`). Nothing is read on the host, and
each program finds its row's expert from the counts on the device (`segment_of_row`): the host
launches one kernel per direction and pass, nothing to lay the rows out.
Triton ships with PyTorch's CUDA builds; without it, off CUDA or under `torch.compile`, callers
use the PyTorch ops (`expert_bias_fusable`).
"""

from __future__ import annotations

import torch

from megatron.core.fusions.segment_sum import segment_sum, segments_block
from megatron.core.fusions.triton_launch import TritonLaunch, launches_on
from megatron.core.utils import direct_apply, once_differentiable

try:
    import triton
    import triton.language as tl

    from megatron.core.fusions.segment_sum import segment_of_row
except ImportError:  # CPU-only PyTorch builds
    triton = None

_BLOCK = 1024
_WARPS = 4


def expert_bias_fusable(x: torch.Tensor) -> bool:
    """Whether `add_expert_bias` runs its kernels for `x`: Triton, a 2-D floating CUDA tensor on
    the current device, no `torch.compile` tracing."""
    return (
        x.dim() == 2
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and launches_on(x)
    )


def add_expert_bias(
    x: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """`x + bias_rows * weights`, `bias_rows` each row's expert bias (zero for padding rows).

    Args:
        x: [rows, out] (`expert_bias_fusable`), grouped by expert, padding rows last.
        bias: [experts, out].
        counts: [experts] int64 rows per expert, on `x`'s device (their sum at most `rows`).
        weights: [rows, 1] routing weights on `x`'s device, or None (no factor).

    Returns:
        [rows, out] in `x`'s dtype: `x + b * w` computed in fp32 (as one fused multiply-add,
        so not always the bits of PyTorch's separate product and sum) and rounded once.
        Differentiable once (PyTorch's ops, which `torch.compile` traces instead, twice).
    """
    if weights is not None:
        weights = weights.reshape(-1).contiguous()  # one per row, at consecutive addresses
    return _apply_expert_bias(x, bias, counts, weights)


class _ExpertBias(torch.autograd.Function):
    """The bias added forward; the pass-through, the weights' and the bias's gradients
    backward (a first derivative only)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        bias: torch.Tensor,
        counts: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(bias, counts, weights)
        x = x if x.stride(1) == 1 else x.contiguous()
        bias = bias.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        width = x.shape[1]
        if out.numel():
            _launch_forward(
                (x.shape[0], -(-width // _BLOCK)),
                x, bias, counts, weights if weights is not None else bias, out,
                x.stride(0), width, bias.shape[0],
                HAS_WEIGHTS=weights is not None, BLOCK=_BLOCK,
                SEGMENTS=segments_block(bias.shape[0]),
            )  # fmt: skip
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        bias, counts, weights = ctx.saved_tensors
        grad = grad if grad.stride(1) == 1 else grad.contiguous()
        grad_bias = grad_weights = None
        if ctx.needs_input_grad[1]:
            grad_bias = segment_sum(grad, counts, row_weights=weights, dtype=bias.dtype)
        if weights is not None and ctx.needs_input_grad[3]:
            grad_weights = torch.empty_like(weights)
            if grad.shape[0]:
                _launch_weights_grad(
                    (grad.shape[0],),
                    grad, bias.contiguous(), counts, grad_weights,
                    grad.stride(0), grad.shape[1], bias.shape[0], BLOCK=_BLOCK,
                    SEGMENTS=segments_block(bias.shape[0]),
                )  # fmt: skip
        return grad, grad_bias, None, grad_weights


_apply_expert_bias = direct_apply(_ExpertBias)


if triton is not None:

    @triton.jit
    def _expert_bias_forward_kernel(
        x_ptr, bias_ptr, counts_ptr, weights_ptr, out_ptr, x_row_stride, width, experts,
        HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr, SEGMENTS: tl.constexpr,
    ):  # fmt: skip
        """Program (row, block): columns [block * BLOCK, (block + 1) * BLOCK) of a row."""
        row = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = col < width
        expert = segment_of_row(counts_ptr, experts, row, SEGMENTS)
        real = expert < experts  # padding rows: no bias
        bias = tl.load(bias_ptr + expert * width + col, mask=inside & real, other=0.0)
        bias = bias.to(tl.float32)
        if HAS_WEIGHTS:
            bias = bias * tl.load(weights_ptr + row).to(tl.float32)
        x = tl.load(x_ptr + row * x_row_stride + col, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * width + col, (x + bias).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _expert_bias_weights_grad_kernel(
        grad_ptr, bias_ptr, counts_ptr, grad_weights_ptr, grad_row_stride, width, experts,
        BLOCK: tl.constexpr, SEGMENTS: tl.constexpr,
    ):  # fmt: skip
        """Program row: `sum_j grad[row, j] * bias[e(row), j]` (0 for padding rows)."""
        row = tl.program_id(0).to(tl.int64)
        expert = segment_of_row(counts_ptr, experts, row, SEGMENTS)
        real = expert < experts
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for first in range(0, width, BLOCK):
            col = first + tl.arange(0, BLOCK)
            inside = col < width
            grad = tl.load(grad_ptr + row * grad_row_stride + col, mask=inside, other=0.0)
            bias = tl.load(bias_ptr + expert * width + col, mask=inside & real, other=0.0)
            acc += grad.to(tl.float32) * bias.to(tl.float32)
        total = tl.sum(acc, axis=0)
        tl.store(grad_weights_ptr + row, total.to(grad_weights_ptr.dtype.element_ty))

    _launch_forward = TritonLaunch(_expert_bias_forward_kernel, num_warps=_WARPS)
    _launch_weights_grad = TritonLaunch(_expert_bias_weights_grad_kernel, num_warps=_WARPS)
