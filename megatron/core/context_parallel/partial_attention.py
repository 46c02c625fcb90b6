"""Attention of a block of queries over a block of keys, with the log-sum-exp of each query's
scores: the unit of work the context-parallel attentions cut attention into, its backward, and
the merge of partial results.

Softmax attention over the union of key blocks B1, B2, ... is recovered exactly from each block's
output O_i and log-sum-exp L_i = log sum_j exp(s_j) over that block's scores:

    L = log(exp(L1) + exp(L2)),   O = exp(L1 - L) O1 + exp(L2 - L) O2

(`merge_partial`). In backward, a block's gradients need only the final O and L: with
P = exp(S - L) the block's share of the softmax and D = rowsum(dO * O), dS = P * (dO V^T - D),
which is what a fused attention kernel's backward computes from (O, L) (FlashAttention-2's
recomputation). So each block runs the kernel's own backward, given the merged O and L.

`BlockAttention` runs one block with the kernel `select_block_kernel` picks, never with a dense
mask on the fused kernels: a block is either fully visible or the causal diagonal block (square,
so the kernel's own `is_causal`). The kernels are PyTorch's SDPA kernels that return the
log-sum-exp (`torch.ops.aten`, the same in torch 2.11 to 2.13):

- `FLASH`: `_scaled_dot_product_flash_attention` (CUDA, fp16/bf16, heads up to 256 wide);
- `EFFICIENT`: `_scaled_dot_product_efficient_attention` (CUDA, any float dtype; its log-sum-exp
  is padded to a multiple of 32 queries);
- `CPU_FLASH`: `_scaled_dot_product_flash_attention_for_cpu`;
- `MATH`: explicit scores in fp32 (the `local` and `unfused` attention backends).

Grouped-query attention: keys and values come with their own (fewer) heads and are expanded to
one per query head for the kernel; their gradients are summed back. The flash kernels need
queries, keys and values of one width: narrower ones are zero-padded (multi-latent attention's
values), which changes neither the scores nor the kept part of the output.
"""

from __future__ import annotations

import enum
import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten

FLASH_MAX_HEAD_DIM = 256
"""The widest head the CUDA flash kernel takes."""

EFFICIENT_LSE_ALIGNMENT = 32
"""The memory-efficient kernel's log-sum-exp holds a multiple of this many queries."""


class BlockKernel(enum.Enum):
    """The kernel that computes a block's attention and log-sum-exp (see the module's list)."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    CPU_FLASH = "cpu_flash"
    MATH = "math"


def select_block_kernel(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    explicit_scores: bool = False,
    flash_only: bool = False,
) -> BlockKernel:
    """The block kernel for `dtype` queries `head_dim` wide on `device`.

    Args:
        device: Where the attention runs.
        dtype: The queries' dtype.
        head_dim: The widest of the query and value heads.
        explicit_scores: Compute the scores explicitly (`MATH`: the `local` and `unfused`
            attention backends).
        flash_only: The flash kernel or nothing (the `flash` attention backend).

    Returns:
        `MATH` with `explicit_scores`; else on the CPU `CPU_FLASH`; on CUDA `FLASH` where it
        applies (fp16/bf16, heads up to 256 wide), `EFFICIENT` otherwise.

    Raises:
        ValueError: `flash_only` where the CUDA flash kernel does not apply.
    """
    if explicit_scores or device.type not in ("cpu", "cuda"):
        return BlockKernel.MATH
    if device.type == "cpu":
        return BlockKernel.CPU_FLASH
    flash_fits = dtype in (torch.float16, torch.bfloat16) and head_dim <= FLASH_MAX_HEAD_DIM
    if flash_only and not flash_fits:
        raise ValueError(
            f"attention_backend=flash: the CUDA flash kernel takes fp16/bf16 heads up to "
            f"{FLASH_MAX_HEAD_DIM} wide, got {dtype} heads {head_dim} wide; use "
            "--attention-backend auto (the memory-efficient kernel then)."
        )
    return BlockKernel.FLASH if flash_fits else BlockKernel.EFFICIENT


def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merges a block's partial result into the running one, in place.

    Args:
        out: [b, n, s, dv] float32 running output (or a view of its rows).
        lse: [b, n, s] float32 running log-sum-exp (the same rows).
        block_out: [b, n, s, dv] the block's output.
        block_lse: [b, n, s] the block's log-sum-exp.
    """
    # O - sigmoid(L_b - L) (O - O_b) is exp(L - L') O + exp(L_b - L') O_b without the overflow
    # of the exponentials; L' = L - logsigmoid(L - L_b).
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    out.sub_(weight * (out - block_out.float()))
    lse.sub_(F.logsigmoid(lse - block_lse))


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, s, d] -> [b, heads, s, d]: query head h reads head h // (heads / g)."""
    groups = t.shape[1]
    if groups == heads:
        return t
    b, _, s, d = t.shape
    return t.unsqueeze(2).expand(b, groups, heads // groups, s, d).reshape(b, heads, s, d)


def _sum_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of `_expand_heads` for gradients: [b, n, s, d] -> [b, groups, s, d]."""
    if grad.shape[1] == groups:
        return grad
    b, n, s, d = grad.shape
    return grad.view(b, groups, n // groups, s, d).sum(dim=2)


def _bmhk_layout(t: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] laid out as [b, s, n, d] in memory, as the memory-efficient kernel's forward
    returns its output: its fp16/bf16 backward computes wrong query and key gradients from an
    output laid out [b, n, s, d] (seen on H100, torch 2.11; fp32 is unaffected)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _pad_width(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


class BlockAttention:
    """One block of queries over one block of keys: output and log-sum-exp, and the block's
    gradients given the merged output and log-sum-exp.

    Args:
        kernel: The kernel (`select_block_kernel`).
        scale: The scores' scale; None means 1 / sqrt(query width).
    """

    def __init__(self, kernel: BlockKernel, scale: float | None):
        self.kernel = kernel
        self.scale = scale

    def _scale(self, query: torch.Tensor) -> float:
        return 1.0 / math.sqrt(query.shape[-1]) if self.scale is None else self.scale

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """The block's attention.

        Args:
            query: [b, n, sq, d].
            key: [b, g, sk, d], g dividing n (Megatron's grouping).
            value: [b, g, sk, dv].
            causal: Query i sees keys 0..i only (a diagonal block: sq == sk); else all keys.

        Returns:
            `(output [b, n, sq, dv] in the query's dtype, log-sum-exp [b, n, sq] float32
            contiguous, what `backward` needs of this call besides its tensors)`.
        """
        scale, heads = self._scale(query), query.shape[1]
        key, value = _expand_heads(key, heads), _expand_heads(value, heads)
        if self.kernel == BlockKernel.MATH:
            return (*_math_forward(query, key, value, causal, scale), ())
        if self.kernel == BlockKernel.EFFICIENT:
            out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                query, key, value, None, True, 0.0, causal, scale=scale
            )
            return out, lse[..., : query.shape[2]].contiguous(), (seed, offset, lse.shape[-1])
        width, value_width = max(query.shape[-1], value.shape[-1]), value.shape[-1]
        query, key, value = (_pad_width(t, width) for t in (query, key, value))
        if self.kernel == BlockKernel.CPU_FLASH:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, causal, scale=scale
            )
            saved = ()
        else:
            out, lse, *saved = aten._scaled_dot_product_flash_attention(
                query, key, value, 0.0, causal, False, scale=scale
            )
            saved = tuple(saved[:6])  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed, offset
        return out[..., :value_width], lse.float().contiguous(), saved

    def backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        saved: tuple,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's gradients.

        Args:
            grad_out: [b, n, sq, dv] the gradient of the merged output of these queries.
            query, key, value, causal: As in `forward`.
            out: [b, n, sq, dv] the merged output of these queries (query dtype).
            lse: [b, n, sq] float32 their merged log-sum-exp, contiguous.
            saved: What `forward` returned for this block.

        Returns:
            `(grad_query [b, n, sq, d], grad_key [b, g, sk, d], grad_value [b, g, sk, dv])`.
        """
        scale, heads, groups = self._scale(query), query.shape[1], key.shape[1]
        key, value = _expand_heads(key, heads), _expand_heads(value, heads)
        if self.kernel == BlockKernel.MATH:
            dq, dk, dv = _math_backward(grad_out, query, key, value, out, lse, causal, scale)
        elif self.kernel == BlockKernel.EFFICIENT:
            seed, offset, lse_len = saved
            padded_lse = F.pad(lse, (0, lse_len - lse.shape[-1])).contiguous()
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                _bmhk_layout(grad_out),
                query,
                key,
                value,
                None,
                _bmhk_layout(out),
                padded_lse,
                seed,
                offset,
                0.0,
                [True, True, True, False],
                causal,
                scale=scale,
            )
        else:
            dq, dk, dv = self._flash_backward(grad_out, query, key, value, out, lse, causal, saved)
        return dq, _sum_heads(dk, groups), _sum_heads(dv, groups)

    def forward_rows(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        rows: slice,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        causal: bool,
        first: bool,
    ) -> tuple:
        """Attention of the query positions `rows` over a block of keys, written into (`first`)
        or merged with (`merge_partial`) those rows of the running `out` and `lse`.

        Args:
            out: [b, n, s, dv] float32 running output of all the rank's queries.
            lse: [b, n, s] float32 running log-sum-exp.
            rows: The query positions (dim 2) the block computes.
            query: [b, n, s, d] all the rank's queries.
            key, value, causal: The block's keys and values, as in `forward`.
            first: The first block of these rows (nothing to merge with yet).

        Returns:
            What `backward_rows` needs of this call besides its tensors.
        """
        block_out, block_lse, saved = self.forward(query[:, :, rows], key, value, causal)
        if first:
            out[:, :, rows] = block_out
            lse[:, :, rows] = block_lse
        else:
            merge_partial(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        return saved

    def backward_rows(
        self,
        rows: slice,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        saved: tuple,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`backward` of a `forward_rows` block, given the merged output and log-sum-exp of all
        the rank's queries (`grad_out`, `query`, `out`, `lse` whole; `key`, `value` the
        block's). Returns the gradients of the rows' queries and of the block's keys and
        values."""
        return self.backward(
            grad_out[:, :, rows],
            query[:, :, rows],
            key,
            value,
            out[:, :, rows],
            lse[:, :, rows].contiguous(),
            causal,
            saved,
        )

    def _flash_backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        saved: tuple,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = self._scale(query)
        query_width, value_width = query.shape[-1], value.shape[-1]
        width = max(query_width, value_width)
        # Zero-padded output and gradient columns leave rowsum(dO * O) unchanged.
        query, key, value, out, grad_out = (
            _pad_width(t, width) for t in (query, key, value, out, grad_out)
        )
        if self.kernel == BlockKernel.CPU_FLASH:
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, query, key, value, out, lse, 0.0, causal, scale=scale
            )
        else:
            cum_q, cum_k, max_q, max_k, seed, offset = saved
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad_out.contiguous(),
                query,
                key,
                value,
                out.contiguous(),
                lse,
                cum_q,
                cum_k,
                max_q,
                max_k,
                0.0,
                causal,
                seed,
                offset,
                scale=scale,
            )
        return dq[..., :query_width], dk[..., :query_width], dv[..., :value_width]


def _causal_mask(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    return torch.ones(rows, cols, dtype=torch.bool, device=device).triu(1)


def _math_scores(
    query: torch.Tensor, key: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scale
    if causal:
        scores.masked_fill_(_causal_mask(*scores.shape[-2:], scores.device), float("-inf"))
    return scores


def _math_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _math_scores(query, key, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, value.float()).to(query.dtype), lse


def _math_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    probs = torch.exp(_math_scores(query, key, causal, scale) - lse.unsqueeze(-1))
    grad_out = grad_out.float()
    grad_value = torch.matmul(probs.transpose(-2, -1), grad_out)
    grad_probs = torch.matmul(grad_out, value.float().transpose(-2, -1))
    row_dot = (grad_out * out.float()).sum(dim=-1, keepdim=True)
    grad_scores = probs * (grad_probs - row_dot) * scale
    grad_query = torch.matmul(grad_scores, key.float())
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), query.float())
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)
