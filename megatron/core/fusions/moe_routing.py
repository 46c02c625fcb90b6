"""The rows of a dropless MoE dispatch, laid out in three small Triton kernels.

A token dispatcher copies each token once per expert it is routed to, the rows grouped by expert
and each expert's in token order, and needs: each row's token (`token_index`), where each row's
routing weight lies in the [T, E] weights (`source_index`), the rows of each token in expert
order (`by_token`: a token's rows are summed back by a gather) and each expert's row count. With
PyTorch's ops that is a transpose copied to be flattened, a cast, a stable argsort of T x E
flags, a remainder, a second stable argsort (of the rows' tokens) and a column sum: ~0.7 ms of
host time per layer on an H200 host, whose GPU work is a few microseconds, in the forward of
every MoE layer, where the host falls behind the GPU. Here each expert's rows are counted per
block of tokens, the counts turned into where each block's rows of each expert start, and each
block's rows written at once: three launches.

Each token must be routed to exactly `topk` experts (the dropless routing the callers use: a
token with fewer rows would leave `by_token` entries unwritten). The rows are those of the
stable argsorts the PyTorch ops make: the same integers. It runs on CUDA with Triton for a
contiguous boolean routing map (`route_rows` says None elsewhere).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron.core.fusions.segment_sum import segments_block
from megatron.core.fusions.triton_launch import TritonLaunch, launches_on

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds
    triton = None

_TILE = 4096
"""Routing-map entries (tokens x experts, the experts' count padded to a power of two) one
program reads: its block of tokens."""

_MAX_EXPERTS = 1024
"""The most experts the kernels take (a block is at least `_TILE / _MAX_EXPERTS` tokens)."""


class RoutedRows(NamedTuple):
    """The dispatch's rows (module docstring), grouped by expert, each expert's in token order.

    Attributes:
        token_index: [T * topk] int64, each row's token.
        source_index: [T * topk] int64, each row's (token, expert) pair as `token * E + expert`:
            where its routing weight lies in the flattened [T, E] weights.
        by_token: [T * topk] int64, the rows of token 0 in expert order, then token 1's, ...
        counts: [E] int64, each expert's rows.
    """

    token_index: torch.Tensor
    source_index: torch.Tensor
    by_token: torch.Tensor
    counts: torch.Tensor


def route_rows(routing_map: torch.Tensor, topk: int) -> RoutedRows | None:
    """The rows of a dispatch where every token is routed to exactly `topk` experts (not
    checked: that would read the map on the host); None where the kernels do not run (module
    docstring).

    Args:
        routing_map: [T, E] boolean, `topk` True per row.
        topk: the experts of each token.
    """
    if (
        routing_map.dim() != 2
        or routing_map.dtype != torch.bool
        or not routing_map.is_contiguous()
        or not launches_on(routing_map)
        or routing_map.shape[1] > _MAX_EXPERTS
    ):
        return None
    tokens, experts = routing_map.shape
    device = routing_map.device
    rows = tokens * topk
    token_index = torch.empty(rows, dtype=torch.int64, device=device)
    source_index = torch.empty(rows, dtype=torch.int64, device=device)
    by_token = torch.empty(rows, dtype=torch.int64, device=device)
    counts = torch.empty(experts, dtype=torch.int64, device=device)
    if tokens == 0:
        counts.zero_()
        return RoutedRows(token_index, source_index, by_token, counts)
    padded_experts = segments_block(experts)  # the experts are the rows' segments
    block = min(_TILE // padded_experts, max(16, 1 << (tokens - 1).bit_length()))
    blocks = -(-tokens // block)
    starts = torch.empty(blocks, experts, dtype=torch.int64, device=device)
    shape = dict(BLOCK=block, EXPERTS=padded_experts)
    _launch_count((blocks,), routing_map, starts, tokens, experts, **shape)
    _launch_starts((1,), starts, counts, blocks, experts, EXPERTS=padded_experts)
    _launch_rows(
        (blocks,), routing_map, starts, token_index, source_index, by_token, tokens, experts,
        TOPK=topk, **shape,
    )  # fmt: skip
    return RoutedRows(token_index, source_index, by_token, counts)


if triton is not None:

    @triton.jit
    def _block_of_map(map_ptr, block, tokens, experts, BLOCK: tl.constexpr, EXPERTS: tl.constexpr):
        """The routing map's rows of token block `block` as 0 / 1 ([BLOCK, EXPERTS], zeros
        past the tokens and the experts), with the tokens and experts indices."""
        token = block * BLOCK + tl.arange(0, BLOCK)
        expert = tl.arange(0, EXPERTS)
        inside = (token < tokens)[:, None] & (expert < experts)[None, :]
        offsets = token.to(tl.int64)[:, None] * experts + expert[None, :]
        routed = tl.load(map_ptr + offsets, mask=inside, other=0).to(tl.int32)
        return routed, token, expert

    @triton.jit
    def _count_kernel(
        map_ptr, starts_ptr, tokens, experts, BLOCK: tl.constexpr, EXPERTS: tl.constexpr
    ):
        """Program b: each expert's routed tokens in token block b, into `starts[b]`."""
        block = tl.program_id(0)
        routed, _, expert = _block_of_map(map_ptr, block, tokens, experts, BLOCK, EXPERTS)
        tl.store(
            starts_ptr + block * experts + expert, tl.sum(routed, axis=0), mask=expert < experts
        )

    @triton.jit
    def _starts_kernel(starts_ptr, counts_ptr, blocks, experts, EXPERTS: tl.constexpr):
        """One program: each expert's rows (`counts`), then, in place of the blocks' counts,
        the row where each block's rows of each expert start (the experts' rows in order, each
        expert's by block)."""
        expert = tl.arange(0, EXPERTS)
        mine = expert < experts
        total = tl.zeros((EXPERTS,), dtype=tl.int64)
        for block in range(blocks):
            total += tl.load(starts_ptr + block * experts + expert, mask=mine, other=0)
        tl.store(counts_ptr + expert, total, mask=mine)
        start = tl.cumsum(total, axis=0) - total
        for block in range(blocks):
            count = tl.load(starts_ptr + block * experts + expert, mask=mine, other=0)
            tl.store(starts_ptr + block * experts + expert, start, mask=mine)
            start += count

    @triton.jit
    def _rows_kernel(
        map_ptr, starts_ptr, token_index_ptr, source_index_ptr, by_token_ptr, tokens, experts,
        TOPK: tl.constexpr, BLOCK: tl.constexpr, EXPERTS: tl.constexpr,
    ):  # fmt: skip
        """Program b: the rows of token block b's routed (token, expert) pairs: the block's
        start for the expert plus the pair's rank among the block's tokens of the expert; and
        each pair's place among its token's rows (its rank among the token's experts)."""
        block = tl.program_id(0)
        routed, token, expert = _block_of_map(map_ptr, block, tokens, experts, BLOCK, EXPERTS)
        start = tl.load(starts_ptr + block * experts + expert, mask=expert < experts, other=0)
        row = start[None, :] + (tl.cumsum(routed, axis=0) - routed)
        place = token.to(tl.int64)[:, None] * TOPK + (tl.cumsum(routed, axis=1) - routed)
        token_rows = token.to(tl.int64)[:, None] + tl.zeros_like(row)
        is_routed = routed != 0
        tl.store(token_index_ptr + row, token_rows, mask=is_routed)
        tl.store(source_index_ptr + row, token_rows * experts + expert[None, :], mask=is_routed)
        tl.store(by_token_ptr + place, row, mask=is_routed)

    _launch_count = TritonLaunch(_count_kernel, num_warps=4)
    _launch_starts = TritonLaunch(_starts_kernel, num_warps=1)
    _launch_rows = TritonLaunch(_rows_kernel, num_warps=4)
