"""The load-balanced split of each sequence over the context-parallel (cp) ranks.

Under causal attention the last positions of a sequence attend to many more keys than the first
ones, so cutting the sequence into N contiguous parts would leave the rank holding the end with
most of the work. As Megatron-LM does, the sequence is cut into 2N equal chunks and cp rank i
holds chunks i and 2N-1-i, one from the front half and its mirror from the back half, so every
rank does the same attention work:

    N = 2, chunks 0 1 2 3:   rank 0 holds [0, 3], rank 1 holds [1, 2]

A rank's tensors hold its two chunks one after the other along the sequence dimension. Gathered
over the cp group in rank order, the chunks come in `rank_chunk_order` ([0, 3, 1, 2] above);
`gather_sequence` puts them back in sequence order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import group_rank, group_size
from megatron.core.utils import all_gather_single


def resolve_cp_group(cp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The context-parallel group to use: `cp_group` when given, else parallel_state's when
    initialised, else None (no context parallelism)."""
    if cp_group is not None:
        return cp_group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_context_parallel_group()
    return None


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2 x `cp_size`) that cp rank `cp_rank` holds, in the order it holds
    them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def rank_chunk_order(cp_size: int) -> list[int]:
    """The chunks of a sequence in the order the cp ranks' parts concatenate (rank 0's two
    chunks, then rank 1's, ...)."""
    return [chunk for rank in range(cp_size) for chunk in chunk_ids(rank, cp_size)]


def check_divisible(seq_len: int, cp_size: int) -> None:
    """Raises `ValueError` unless a sequence of `seq_len` positions splits into 2 x `cp_size`
    equal chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"the sequence length {seq_len} is not divisible by 2 x context-parallel size "
            f"{cp_size} = {2 * cp_size}: each sequence is cut into {2 * cp_size} equal chunks "
            f"(two per rank, for load balancing); use a --seq-length that is a multiple of "
            f"{2 * cp_size}."
        )


def split_sequence(tensor: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This cp rank's two chunks of `tensor` along `seq_dim`, concatenated (a copy; `tensor`
    itself when `cp_size` is 1).

    Args:
        tensor: Holds the whole sequence along `seq_dim`.
        seq_dim: The sequence dimension.
        cp_rank: This rank's index in the cp group.
        cp_size: The cp group's size.

    Raises:
        ValueError: the sequence does not split into 2 x `cp_size` equal chunks.
    """
    if cp_size == 1:
        return tensor
    check_divisible(tensor.shape[seq_dim], cp_size)
    chunks = tensor.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp_size)], dim=seq_dim)


def get_batch_on_this_cp_rank(
    batch: dict[str, torch.Tensor | None], cp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor | None]:
    """This cp rank's part of a micro-batch (Megatron-LM's function of this name): every
    [b, s] tensor (tokens, labels, loss mask, position ids) split along the sequence; None
    values pass through.

    Args:
        batch: name -> [b, s] tensor (or None). An `attention_mask` is refused: an explicit
            mask would need each rank's rows over every rank's columns, which the
            context-parallel attention does not take.
        cp_group: The cp group; None means parallel_state's (or no split without it).

    Returns:
        A new dict; the input itself without context parallelism.

    Raises:
        ValueError: an attention mask is given, or a sequence does not split evenly.
    """
    cp_group = resolve_cp_group(cp_group)
    cp_size = group_size(cp_group)
    if cp_size == 1:
        return batch
    if batch.get("attention_mask") is not None:
        raise ValueError(
            "get_batch_on_this_cp_rank: the batch has an attention_mask, which context-parallel "
            "attention does not take (it computes the causal mask itself); drop "
            "--reset-attention-mask (or --context-parallel-size)."
        )
    cp_rank = group_rank(cp_group)
    return {
        key: None if value is None else split_sequence(value, 1, cp_rank, cp_size)
        for key, value in batch.items()
    }


def local_position_ids(
    seq_len: int, cp_group: dist.ProcessGroup | None, device: torch.device | None = None
) -> torch.Tensor:
    """The positions in the whole sequence of a rank's `seq_len` local positions, [1, seq_len]
    (0 .. seq_len - 1 without context parallelism).

    Args:
        seq_len: Positions this rank holds (the whole sequence / cp size).
        cp_group: The cp group (None: no context parallelism).
        device: Where to build them.
    """
    cp_size = group_size(cp_group)
    positions = torch.arange(seq_len * cp_size, device=device)
    return split_sequence(positions, 0, group_rank(cp_group), cp_size).unsqueeze(0)


def gather_sequence(
    tensor: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The whole sequence of `tensor`, gathered from every cp rank's part and put back in
    sequence order (not differentiable: for token ids, labels, masks).

    Args:
        tensor: This rank's part (its two chunks) along `seq_dim`.
        seq_dim: The sequence dimension.
        cp_group: The cp group (None or size 1: `tensor` itself).
    """
    cp_size = group_size(cp_group)
    if cp_size == 1:
        return tensor
    moved = tensor.movedim(seq_dim, 0).contiguous()
    gathered = moved.new_empty((cp_size * moved.shape[0], *moved.shape[1:]))
    all_gather_single(gathered, moved, group=cp_group)
    return to_sequence_order(gathered, cp_size).movedim(0, seq_dim)


def to_sequence_order(tensor: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Dim 0 of `tensor` from the ranks' chunk order (`rank_chunk_order`) to sequence order
    (differentiable; host-side indices only, so nothing is copied to the device)."""
    chunks = tensor.chunk(2 * cp_size)
    where = {chunk: i for i, chunk in enumerate(rank_chunk_order(cp_size))}
    return torch.cat([chunks[where[chunk]] for chunk in range(2 * cp_size)])


def to_rank_chunk_order(tensor: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Dim 0 of `tensor` from sequence order to the ranks' chunk order (inverse of
    `to_sequence_order`, likewise differentiable)."""
    chunks = tensor.chunk(2 * cp_size)
    return torch.cat([chunks[chunk] for chunk in rank_chunk_order(cp_size)])
