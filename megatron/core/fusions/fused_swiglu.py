"""SwiGLU, `silu(gate) * linear` over the halves `[gate | linear]` of fc1's output, in one Triton
kernel per direction (the config's `bias_activation_fusion`; `--no-bias-swiglu-fusion` turns it
off).

The PyTorch ops take a kernel for the SiLU and one for the product forward, and backward one per
factor of the product, one for the SiLU's derivative and one to concatenate the halves' gradients:
each a full pass over an activation of the MLP's width, the widest tensor of the layer. They also
keep the SiLU's output for backward. The kernels here read each input element once and write each
output element once, computing in fp32 and rounding once, and backward needs only the input,
which the layer keeps anyway (its halves are what the unfused ops save too). An MoE expert's
routing weights `w` (one per row) multiply inside the same kernels, where the PyTorch ops make
an fp32 product of the MLP's width and reduce another for `w`'s gradient. With `g` the gate,
`l` the linear half, `s = sigmoid(g)` and `dy` the output gradient:

    forward:   y = g * s * l * w
    backward: dg = dy * w * l * s * (1 + g * (1 - s)),   dl = dy * w * g * s,
              dw = sum over the row of dy * g * s * l

Triton ships with PyTorch's CUDA builds; without it, or off CUDA, callers use the PyTorch ops.
"""

from __future__ import annotations

import math

import torch

from megatron.core.fusions.triton_launch import TritonLaunch, launches_on
from megatron.core.utils import direct_apply, once_differentiable

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds
    triton = None

_BLOCK = 1024
"""Output columns one program computes at most (of one row)."""
_WARPS = 4

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes the kernels take (computing in fp32: float64 keeps the PyTorch ops' precision)."""


def fused_swiglu_supported(x: torch.Tensor) -> bool:
    """Whether `fused_swiglu` can run on `x`: Triton, a CUDA tensor on the current device, fp16,
    bf16 or fp32, an even last dimension, and no `torch.compile` tracing (the compiler fuses the
    PyTorch ops itself)."""
    return x.dtype in _DTYPES and x.dim() >= 1 and x.shape[-1] % 2 == 0 and launches_on(x)


def fused_swiglu(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """`F.silu(gate) * linear` for `gate, linear = x.chunk(2, dim=-1)`, one kernel per direction;
    times `weights` per row where given (an MoE expert's routing weights, Megatron-LM's
    `weighted_bias_swiglu_impl`).

    Args:
        x: [..., 2 * ffn] (`fused_swiglu_supported`), any strides.
        weights: one per row of `x` ([...] or [..., 1]), any floating dtype on `x`'s device;
            their gradient is the row's sum of the output gradient times the SwiGLU, in fp32,
            returned in their dtype.

    Returns:
        [..., ffn], contiguous, in `x`'s dtype.
    """
    if weights is None:
        return _apply_swiglu(x, None)
    if weights.numel() * x.shape[-1] != x.numel() or weights.device != x.device:
        raise ValueError(
            f"fused_swiglu: one weight per row of x {list(x.shape)} on {x.device}, got weights "
            f"{list(weights.shape)} on {weights.device}."
        )
    # The kernels read one weight per row at consecutive addresses.
    return _apply_swiglu(x, weights.reshape(-1).contiguous())


class _FusedSwiGLU(torch.autograd.Function):
    """The gated SiLU (times per-row weights) forward, its derivative backward (a first
    derivative only: the kernel is not differentiable again)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        rows = _rows(x)
        ctx.save_for_backward(rows, weights)
        ctx.input_shape = x.shape
        count, width = rows.shape[0], rows.shape[1] // 2
        out = torch.empty(count, width, dtype=x.dtype, device=x.device)
        if out.numel():
            _launch_forward(
                (count, -(-width // _BLOCK)),
                rows, weights if weights is not None else rows, out, rows.stride(0), width,
                HAS_WEIGHTS=weights is not None, BLOCK=_BLOCK,
            )  # fmt: skip
        return out.view(*x.shape[:-1], width)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, weights = ctx.saved_tensors
        count, width = rows.shape[0], rows.shape[1] // 2
        grad = _rows(grad_output)
        grad_input = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        grad_weights = None
        blocks = -(-width // _BLOCK)
        # A weight's gradient sums its row: one program per row then, looping over the blocks.
        blocks_per_program = 1
        if weights is not None and ctx.needs_input_grad[1]:
            grad_weights = torch.empty_like(weights)
            blocks_per_program = blocks
        if grad_input.numel():
            _launch_backward(
                (count, blocks // blocks_per_program),
                grad, rows, weights if weights is not None else rows, grad_input,
                grad_weights if grad_weights is not None else grad_input,
                grad.stride(0), rows.stride(0), width, blocks_per_program,
                HAS_WEIGHTS=weights is not None, WEIGHTS_GRAD=grad_weights is not None,
                BLOCK=_BLOCK,
            )  # fmt: skip
        elif grad_weights is not None:
            grad_weights.zero_()
        return grad_input.view(ctx.input_shape), grad_weights


_apply_swiglu = direct_apply(_FusedSwiGLU)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 2-D `[rows, width]` tensor the kernels address: adjacent elements along the
    width, any row stride (a copy where that is not a view of `t`)."""
    rows = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # -1 fails for zero width
    return rows if rows.stride(1) == 1 else rows.contiguous()


if triton is not None:

    @triton.jit
    def _swiglu_forward_kernel(
        x_ptr, weights_ptr, out_ptr, x_row_stride, width,
        HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program (row, block): output columns [block * BLOCK, (block + 1) * BLOCK) of a row."""
        row = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = col < width
        x_row = x_ptr + row * x_row_stride
        gate = tl.load(x_row + col, mask=inside, other=0.0).to(tl.float32)
        linear = tl.load(x_row + width + col, mask=inside, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * linear
        if HAS_WEIGHTS:
            out *= tl.load(weights_ptr + row).to(tl.float32)
        tl.store(out_ptr + row * width + col, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _swiglu_backward_kernel(
        grad_ptr, x_ptr, weights_ptr, grad_x_ptr, grad_weights_ptr,
        grad_row_stride, x_row_stride, width, blocks_per_program,
        HAS_WEIGHTS: tl.constexpr, WEIGHTS_GRAD: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program (row, p): the gradients of a row's gate and linear columns in blocks
        [p * blocks_per_program, (p + 1) * blocks_per_program) of BLOCK columns, and with
        WEIGHTS_GRAD (one program per row) the row's weight gradient."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_row_stride
        grad_row = grad_ptr + row * grad_row_stride
        grad_x_row = grad_x_ptr + row * 2 * width
        dtype = grad_x_ptr.dtype.element_ty
        weight = 1.0
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + row).to(tl.float32)
        weight_grad = tl.zeros((BLOCK,), dtype=tl.float32)
        first = tl.program_id(1) * blocks_per_program
        for block in range(first, first + blocks_per_program):
            col = block * BLOCK + tl.arange(0, BLOCK)
            inside = col < width
            grad = tl.load(grad_row + col, mask=inside, other=0.0).to(tl.float32)
            gate = tl.load(x_row + col, mask=inside, other=0.0).to(tl.float32)
            linear = tl.load(x_row + width + col, mask=inside, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            silu = gate * sig
            if WEIGHTS_GRAD:
                weight_grad += grad * silu * linear
            grad = grad * weight
            grad_gate = grad * linear * sig * (1.0 + gate * (1.0 - sig))
            tl.store(grad_x_row + col, grad_gate.to(dtype), mask=inside)
            tl.store(grad_x_row + width + col, (grad * silu).to(dtype), mask=inside)
        if WEIGHTS_GRAD:
            total = tl.sum(weight_grad, axis=0)
            tl.store(grad_weights_ptr + row, total.to(grad_weights_ptr.dtype.element_ty))

    _launch_forward = TritonLaunch(_swiglu_forward_kernel, num_warps=_WARPS)
    _launch_backward = TritonLaunch(_swiglu_backward_kernel, num_warps=_WARPS)
