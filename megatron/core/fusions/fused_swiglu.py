"""SwiGLU, `silu(gate) * linear` over the halves `[gate | linear]` of fc1's output, in one Triton
kernel per direction (the config's `bias_activation_fusion`; `--no-bias-swiglu-fusion` turns it
off).

The PyTorch ops take a kernel for the SiLU and one for the product forward, and backward one per
factor of the product, one for the SiLU's derivative and one to concatenate the halves' gradients:
each a full pass over an activation of the MLP's width, the widest tensor of the layer. They also
keep the SiLU's output for backward. The kernels here read each input element once and write each
output element once, computing in fp32 and rounding once, and backward needs only the input,
which the layer keeps anyway (its halves are what the unfused ops save too). With `g` the gate,
`l` the linear half, `s = sigmoid(g)` and `dy` the output gradient:

    forward:   y = g * s * l
    backward: dg = dy * l * s * (1 + g * (1 - s)),   dl = dy * g * s

Triton ships with PyTorch's CUDA builds; without it, or off CUDA, callers use the PyTorch ops.
"""

from __future__ import annotations

import torch

from megatron.core.fusions.triton_launch import TritonLaunch
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
    return (
        triton is not None
        and x.is_cuda
        and x.dtype in _DTYPES
        and x.dim() >= 1
        and x.shape[-1] % 2 == 0
        and x.device.index == torch.cuda.current_device()  # where Triton launches
        and not torch.compiler.is_compiling()
    )


def fused_swiglu(x: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * linear` for `gate, linear = x.chunk(2, dim=-1)`, one kernel per direction.

    Args:
        x: [..., 2 * ffn] (`fused_swiglu_supported`), any strides.

    Returns:
        [..., ffn], contiguous, in `x`'s dtype.
    """
    return _apply_swiglu(x)


class _FusedSwiGLU(torch.autograd.Function):
    """The gated SiLU forward, its derivative backward (a first derivative only: the kernel is
    not differentiable again)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        ctx.save_for_backward(rows)
        ctx.input_shape = x.shape
        width = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)
        if out.numel():
            _launch_forward(
                (rows.shape[0], -(-width // _BLOCK)),
                rows, out, rows.stride(0), width, BLOCK=_BLOCK,
            )  # fmt: skip
        return out.view(*x.shape[:-1], width)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        (rows,) = ctx.saved_tensors
        width = rows.shape[1] // 2
        grad = _rows(grad_output)
        grad_input = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        if grad_input.numel():
            _launch_backward(
                (rows.shape[0], -(-width // _BLOCK)),
                grad, rows, grad_input, grad.stride(0), rows.stride(0), width, BLOCK=_BLOCK,
            )  # fmt: skip
        return grad_input.view(ctx.input_shape)


_apply_swiglu = direct_apply(_FusedSwiGLU)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 2-D `[rows, width]` tensor the kernels address: adjacent elements along the
    width, any row stride (a copy where that is not a view of `t`)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


if triton is not None:

    @triton.jit
    def _swiglu_forward_kernel(x_ptr, out_ptr, x_row_stride, width, BLOCK: tl.constexpr):
        """Program (row, block): output columns [block * BLOCK, (block + 1) * BLOCK) of a row."""
        row = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = col < width
        x_row = x_ptr + row * x_row_stride
        gate = tl.load(x_row + col, mask=inside, other=0.0).to(tl.float32)
        linear = tl.load(x_row + width + col, mask=inside, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * linear
        tl.store(out_ptr + row * width + col, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _swiglu_backward_kernel(
        grad_ptr, x_ptr, grad_x_ptr, grad_row_stride, x_row_stride, width, BLOCK: tl.constexpr
    ):
        """Program (row, block): the gradients of a row's gate and linear columns
        [block * BLOCK, (block + 1) * BLOCK)."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = col < width
        x_row = x_ptr + row * x_row_stride
        grad = tl.load(grad_ptr + row * grad_row_stride + col, mask=inside, other=0.0)
        grad = grad.to(tl.float32)
        gate = tl.load(x_row + col, mask=inside, other=0.0).to(tl.float32)
        linear = tl.load(x_row + width + col, mask=inside, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        grad_gate = grad * linear * sig * (1.0 + gate * (1.0 - sig))
        grad_linear = grad * gate * sig
        dtype = grad_x_ptr.dtype.element_ty
        grad_x_row = grad_x_ptr + row * 2 * width
        tl.store(grad_x_row + col, grad_gate.to(dtype), mask=inside)
        tl.store(grad_x_row + width + col, grad_linear.to(dtype), mask=inside)

    _launch_forward = TritonLaunch(_swiglu_forward_kernel, num_warps=_WARPS)
    _launch_backward = TritonLaunch(_swiglu_backward_kernel, num_warps=_WARPS)
