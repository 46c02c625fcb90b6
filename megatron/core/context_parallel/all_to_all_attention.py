"""All-to-all attention (`cp_comm_type="a2a"`, DeepSpeed-Ulysses): the context-parallel (cp)
ranks trade the sequence split for a head split around the attention.

Before attention one all-to-all over the cp group turns each rank's [s/N, b, n, d] queries, keys
and values (its two chunks of the sequence, all heads) into [s, b, n/N, d]: the whole sequence,
in sequence order, of heads r n/N .. (r + 1) n/N - 1 on cp rank r. Any attention then runs
unchanged on its heads, whole sequences at a time (sliding windows, softmax sinks, dropout and
every kernel included), and a second all-to-all brings the output back to the sequence split.

The head count must be a multiple of N. Keys and values with fewer heads (grouped-query
attention) are repeated to lcm(g, N) heads first (a divisor of n), the fewest that split evenly
while keeping Megatron's grouping: query head h still reads key head h // (n / heads).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.core.context_parallel.sequence_split import to_rank_chunk_order, to_sequence_order
from megatron.core.tensor_parallel.mappings import all_to_all_first


def check_heads_divisible(num_heads: int, cp_size: int, what: str = "attention heads") -> None:
    """Raises `ValueError` unless `num_heads` (this tensor-parallel rank's) split evenly over
    `cp_size` ranks."""
    if num_heads % cp_size:
        raise ValueError(
            f"cp_comm_type a2a splits the {what} over the {cp_size} context-parallel ranks, but "
            f"{num_heads} (per tensor-parallel rank) is not divisible by {cp_size}; choose "
            "--num-attention-heads divisible by --tensor-model-parallel-size x "
            "--context-parallel-size, or --cp-comm-type p2p (ring attention)."
        )


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[s/N, b, n, d] (this rank's chunks, all heads) -> [s, b, n/N, d] (sequence order)."""
    size = group.size()
    parts = x.unflatten(2, (size, -1)).movedim(2, 0)  # [N, s/N, b, n/N, d]: part r to rank r
    received = all_to_all_first(parts, group, [1] * size, [1] * size)
    return to_sequence_order(received.flatten(0, 1), size)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `_sequence_to_heads`: [s, b, n/N, d] -> [s/N, b, n, d]."""
    size = group.size()
    parts = to_rank_chunk_order(x, size).unflatten(0, (size, -1))  # part r: rank r's chunks
    received = all_to_all_first(parts, group, [1] * size, [1] * size)
    return received.movedim(0, 2).flatten(2, 3)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sequence_to_heads(grad, ctx.group), None


def _repeat_kv_heads(t: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[s, b, g, d] -> [s, b, lcm(g, N), d], each head repeated in place."""
    groups = t.shape[2]
    heads = math.lcm(groups, cp_size)
    return t if heads == groups else t.repeat_interleave(heads // groups, dim=2)


def all_to_all_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, slice], torch.Tensor],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Attention over the whole sequence of this rank's share of the heads.

    Args:
        query: [s/N, b, n, d] this rank's two chunks (`sequence_split`), n divisible by N.
        key: [s/N, b, g, d], g dividing n.
        value: [s/N, b, g, dv].
        attend: `(query, key, value, heads) -> [s, b, n/N * dv]`: the attention of whole
            sequences ([s, b, n/N, d] queries, their key heads), given which of the n heads
            they are (`heads`, for per-head parameters such as softmax sinks).
        group: The cp group (N ranks).

    Returns:
        [s/N, b, n * dv], this rank's chunks.

    Raises:
        ValueError: n is not divisible by N.
    """
    size, num_heads = group.size(), query.shape[2]
    check_heads_divisible(num_heads, size)
    key, value = _repeat_kv_heads(key, size), _repeat_kv_heads(value, size)
    query, key, value = (_SequenceToHeads.apply(t, group) for t in (query, key, value))
    local = num_heads // size
    heads = slice(group.rank() * local, (group.rank() + 1) * local)
    context = attend(query, key, value, heads)
    context = context.unflatten(-1, (local, -1))
    return _HeadsToSequence.apply(context, group).flatten(-2)
