"""Rotary position embedding of queries and keys in one Triton kernel per direction
(`--no-rope-fusion` turns it off).

The unfused rotation `t * cos + swap(t) * sin` is four elementwise kernels forward and four
backward for each of the queries and the keys of every layer, each reading and writing the whole
tensor in the compute dtype (and the swap, a roll by half the head width, is a slow gather). The
kernel here rotates the queries and the keys of a layer in one launch, reading each element once,
rotating it in fp32 with its pair partner and writing it once; backward is the same kernel
rotating the other way (the rotation's transpose): for output channel j with pair partner p(j)
(the channel `swap` exchanges it with),

    forward:   y[j] = x[j]  * cos[j] + x[p(j)]  * sin[j]
    backward: dx[j] = dy[j] * cos[j] + dy[p(j)] * sin[p(j)]

with `sin` the signed sine table of `rotary_pos_embedding` (each pair's first sine negated).
One launch for both tensors halves the host's launch work, which bounds small-batch steps. Where
its C++ extension builds (`native_rope`), a CUDA kernel with the same arithmetic runs instead,
from a C++ autograd node, which costs the host less than this autograd function and Triton's
launcher. Triton ships with PyTorch's CUDA builds; without it, or off CUDA, callers use the
PyTorch ops.
"""

from __future__ import annotations

import torch

from megatron.core.fusions.native_rope import native_rope
from megatron.core.fusions.triton_launch import TritonLaunch, launches_on
from megatron.core.utils import direct_apply, once_differentiable

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds
    triton = None

_ELEMENTS_PER_PROGRAM = 4096
"""Heads x head width one program rotates at most (32 heads of 128 channels)."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes the kernel rotates (in fp32: float64 keeps the PyTorch ops' precision)."""


def fused_rope_supported(query: torch.Tensor, key: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether `fused_rotary_pos_emb` can rotate `query` and `key` by `freqs`.

    It needs Triton, CUDA tensors on the current device, the shapes of `rope_shapes_fusable`,
    angles that need no gradient (learned angles take the PyTorch ops, which differentiate
    them), and no `torch.compile` tracing (the compiler fuses the PyTorch ops itself).
    """
    return (
        query.device == key.device == freqs.device
        and rope_shapes_fusable(query, key, freqs)
        and not freqs.requires_grad
        and launches_on(query)
    )


def rope_shapes_fusable(query: torch.Tensor, key: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether the kernel covers these shapes and dtypes: `query` [s, b, nq, d] and `key`
    [s, b, nk, d] in fp16, bf16 or fp32, angles [s, 1, 1, rot] shared by the batch and the
    heads, with rot even and at most d."""
    return (
        query.dim() == key.dim() == freqs.dim() == 4
        and query.shape[:2] == key.shape[:2]
        and query.shape[-1] == key.shape[-1]
        and freqs.shape[:3] == (query.shape[0], 1, 1)
        and freqs.shape[-1] % 2 == 0
        and freqs.shape[-1] <= query.shape[-1]
        and query.dtype in _DTYPES
        and key.dtype == query.dtype
    )


def fused_rotary_pos_emb(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`t * cos + swap(t) * sin` on the first `cos.shape[-1]` channels of the queries and the
    keys, in one kernel (and one in backward).

    Args:
        query: [s, b, nq, d], any strides.
        key: [s, b, nk, d], any strides.
        cos: Cosines [s, 1, 1, rot] (rot even, <= d), fp32.
        sin: Signed sines like `cos`.
        interleaved: Pairs are adjacent channels instead of channel i and i + rot / 2.

    Returns:
        The rotated queries and keys, contiguous, in their dtype; channels past `rot` unchanged.
    """
    native = native_rope(query)
    if native is not None:  # the same rotation, as one C++ autograd node
        return tuple(native.rotary(query, key, cos, sin, interleaved))
    return _apply_rotary(query, key, cos, sin, interleaved)


class _FusedRotary(torch.autograd.Function):
    """The rotation forward, its transpose backward (a first derivative only: the kernel is
    not differentiable again)."""

    @staticmethod
    def forward(ctx, query, key, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate(query, key, cos, sin, interleaved, transpose=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_query, grad_key):
        cos, sin = ctx.saved_tensors
        grads = _rotate(grad_query, grad_key, cos, sin, ctx.interleaved, transpose=True)
        return *grads, None, None, None


_apply_rotary = direct_apply(_FusedRotary)


def _rotate(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the kernel on `query` and `key`; `transpose` rotates by the opposite angles
    (backward)."""
    query, key = (_as_kernel_input(t) for t in (query, key))
    seq, batch, q_heads, dim = query.shape
    k_heads = key.shape[2]
    rot_dim = cos.shape[-1]
    cos = cos.reshape(seq, rot_dim).contiguous()
    sin = sin.reshape(seq, rot_dim).contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    # Plain integer arithmetic: triton.next_power_of_2 and triton.cdiv go through Triton's
    # constexpr wrappers, several microseconds of host time per launch.
    block_d = 1 << (dim - 1).bit_length()
    heads_per_program = max(1, _ELEMENTS_PER_PROGRAM // block_d)
    block_n = min(1 << (max(q_heads, k_heads) - 1).bit_length(), heads_per_program)
    q_blocks = (q_heads + block_n - 1) // block_n
    grid = (seq * batch, q_blocks + (k_heads + block_n - 1) // block_n)
    _launch_rotate(
        grid, query, key, q_out, k_out, cos, sin,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        batch, q_heads, k_heads, q_blocks, dim, rot_dim,
        BLOCK_N=block_n, BLOCK_D=block_d, INTERLEAVED=interleaved, TRANSPOSE=transpose,
    )  # fmt: skip
    return q_out, k_out


def _as_kernel_input(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy where the kernel cannot address it: channels must be adjacent,
    and head offsets (int32 in the kernel) below 2**31 elements."""
    if t.stride(-1) == 1 and t.shape[2] * t.stride(2) < 2**31:
        return t
    return t.contiguous()


if triton is not None:

    @triton.jit
    def _rotate_heads(
        x_ptr, out_ptr, cos_ptr, sin_ptr, stride_n, heads, first_head, dim, rot_dim,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        INTERLEAVED: tl.constexpr, TRANSPOSE: tl.constexpr,
    ):  # fmt: skip
        """Rotates heads [first_head, first_head + BLOCK_N) of one (position, batch entry):
        `x_ptr` and `out_ptr` point at its head 0, `cos_ptr` and `sin_ptr` at its position."""
        n = first_head + tl.arange(0, BLOCK_N)[:, None]
        j = tl.arange(0, BLOCK_D)[None, :]
        if INTERLEAVED:
            partner = j ^ 1
        else:
            half = rot_dim // 2
            partner = tl.where(j < half, j + half, j - half)
        rotated = j < rot_dim
        mask = (n < heads) & (j < dim)
        x = tl.load(x_ptr + n * stride_n + j, mask=mask, other=0.0).to(tl.float32)
        x_partner = tl.load(x_ptr + n * stride_n + partner, mask=mask & rotated, other=0.0)
        # Channels past rot_dim pass through: cos 1, sin 0.
        cos = tl.load(cos_ptr + j, mask=rotated, other=1.0)
        if TRANSPOSE:
            sin = tl.load(sin_ptr + partner, mask=rotated, other=0.0)
        else:
            sin = tl.load(sin_ptr + j, mask=rotated, other=0.0)
        y = x * cos + x_partner.to(tl.float32) * sin
        tl.store(out_ptr + n * dim + j, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_kernel(
        q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
        q_stride_s, q_stride_b, q_stride_n, k_stride_s, k_stride_b, k_stride_n,
        batch, q_heads, k_heads, q_blocks, dim, rot_dim,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        INTERLEAVED: tl.constexpr, TRANSPOSE: tl.constexpr,
    ):  # fmt: skip
        """Program (row, block): one (position, batch entry) row of the queries' head blocks,
        then of the keys'."""
        row = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements
        s = row // batch
        b = row % batch
        block = tl.program_id(1)
        cos_ptr += s * rot_dim
        sin_ptr += s * rot_dim
        if block < q_blocks:
            _rotate_heads(
                q_ptr + s * q_stride_s + b * q_stride_b, q_out_ptr + row * q_heads * dim,
                cos_ptr, sin_ptr, q_stride_n, q_heads, block * BLOCK_N, dim, rot_dim,
                BLOCK_N, BLOCK_D, INTERLEAVED, TRANSPOSE,
            )  # fmt: skip
        else:
            _rotate_heads(
                k_ptr + s * k_stride_s + b * k_stride_b, k_out_ptr + row * k_heads * dim,
                cos_ptr, sin_ptr, k_stride_n, k_heads, (block - q_blocks) * BLOCK_N, dim, rot_dim,
                BLOCK_N, BLOCK_D, INTERLEAVED, TRANSPOSE,
            )  # fmt: skip

    _launch_rotate = TritonLaunch(_rotate_kernel)
