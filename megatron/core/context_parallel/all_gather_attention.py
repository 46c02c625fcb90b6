"""All-gather attention (`cp_comm_type="allgather"`): every context-parallel (cp) rank gathers
the whole sequence's keys and values and attends with its own queries.

A rank's two query chunks (`sequence_split`) each attend to the keys before the chunk (a block
with no mask) and to the chunk's own keys (the causal diagonal block); the two partial results
merge with their log-sum-exp (`partial_attention`). Backward gathers the keys and values again
(only this rank's part is kept between forward and backward) and reduce-scatters their
gradients, summed in fp32, back to the ranks that hold them. The all-gather is not overlapped
with computation: `p2p` (ring attention) hides its transfers behind attention, this exchanges
once per layer with the simplest pattern.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.context_parallel.partial_attention import BlockAttention
from megatron.core.context_parallel.sequence_split import (
    chunk_ids,
    to_rank_chunk_order,
    to_sequence_order,
)
from megatron.core.utils import all_gather_single, reduce_scatter_single


def _gather_sequence_dim2(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, g, s/N, d] from every rank -> [b, g, s, d] in sequence order."""
    size = group.size()
    local = x.movedim(2, 0).contiguous()
    gathered = local.new_empty((size * local.shape[0], *local.shape[1:]))
    all_gather_single(gathered, local, group=group)
    return to_sequence_order(gathered, size).movedim(0, 2)


def _reduce_scatter_sequence_dim2(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `_gather_sequence_dim2` for gradients: [b, g, s, d], summed over the ranks,
    this rank's chunks [b, g, s/N, d]."""
    size = group.size()
    ordered = to_rank_chunk_order(x.movedim(2, 0), size).contiguous()
    out = ordered.new_empty((ordered.shape[0] // size, *ordered.shape[1:]))
    reduce_scatter_single(out, ordered, group=group)
    return out.movedim(0, 2)


def _chunk_blocks(chunk: int, chunk_len: int) -> list[tuple[slice, bool]]:
    """The key blocks of query chunk `chunk` (positions, causal?): its own keys causally, and
    the keys before it (if any) with no mask."""
    start = chunk * chunk_len
    blocks = [(slice(start, start + chunk_len), True)]
    if start:
        blocks.append((slice(0, start), False))
    return blocks


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        block: BlockAttention,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        whole_key = _gather_sequence_dim2(key, group)
        whole_value = _gather_sequence_dim2(value, group)
        chunk_len = query.shape[2] // 2
        out = query.new_empty((*query.shape[:3], value.shape[-1]), dtype=torch.float32)
        lse = query.new_empty(query.shape[:3], dtype=torch.float32)
        saved = []
        for which, chunk in enumerate(chunk_ids(group.rank(), group.size())):
            rows = slice(which * chunk_len, (which + 1) * chunk_len)
            for index, (keys, causal) in enumerate(_chunk_blocks(chunk, chunk_len)):
                saved.append(
                    block.forward_rows(
                        out,
                        lse,
                        rows,
                        query,
                        whole_key[:, :, keys],
                        whole_value[:, :, keys],
                        causal,
                        first=index == 0,
                    )
                )
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.block, ctx.group, ctx.saved = block, group, saved
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        block, group = ctx.block, ctx.group
        whole_key = _gather_sequence_dim2(key, group)
        whole_value = _gather_sequence_dim2(value, group)
        grad_query = torch.zeros_like(query, dtype=torch.float32)
        grad_key = torch.zeros_like(whole_key, dtype=torch.float32)
        grad_value = torch.zeros_like(whole_value, dtype=torch.float32)
        chunk_len = query.shape[2] // 2
        saved = iter(ctx.saved)
        for which, chunk in enumerate(chunk_ids(group.rank(), group.size())):
            rows = slice(which * chunk_len, (which + 1) * chunk_len)
            for keys, causal in _chunk_blocks(chunk, chunk_len):
                dq, dk, dv = block.backward_rows(
                    rows,
                    grad_out,
                    query,
                    whole_key[:, :, keys],
                    whole_value[:, :, keys],
                    out,
                    lse,
                    causal,
                    next(saved),
                )
                grad_query[:, :, rows] += dq
                grad_key[:, :, keys] += dk
                grad_value[:, :, keys] += dv
        grad_key = _reduce_scatter_sequence_dim2(grad_key, group)
        grad_value = _reduce_scatter_sequence_dim2(grad_value, group)
        return (
            grad_query.to(query.dtype),
            grad_key.to(key.dtype),
            grad_value.to(value.dtype),
            None,
            None,
        )


def all_gather_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: BlockAttention,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    Args:
        query: [b, n, s/N, d] this rank's two chunks (`sequence_split`).
        key: [b, g, s/N, d], g dividing n.
        value: [b, g, s/N, dv].
        block: The block kernel and scale.
        group: The cp group (N ranks).

    Returns:
        [b, n, s/N, dv] in the query's dtype.
    """
    return _AllGatherAttention.apply(query, key, value, block, group)
