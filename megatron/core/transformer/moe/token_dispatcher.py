"""Token dispatchers: bring each routed token to the ranks holding its expert, and bring it back.

A dispatcher's `dispatch(hidden_states, probs, routing_map)` returns this rank's expert input:
tokens sorted by local expert, the count per local expert, and each token's routing weight;
`combine(expert_output)` returns the [s, b, h] layer output on the tokens' own rank, each
token's expert outputs summed (the experts have already multiplied them by the weights, as in
Megatron-core). Both run with gloo or NCCL; with one rank per expert group they only sort and
unsort.

Experts are split over two groups (Megatron-core's etp-ep-dp rank order): the expert-parallel
group `ep` splits the experts among its ranks, and the expert tensor-parallel group `expt_tp`
splits each expert's weights (see `experts.py`), so every rank of `expt_tp` must see the same
tokens and its partial outputs are summed. `tp_ep`, the etp x ep ranks of both (index
`ep_rank * etp + etp_rank`), is the group the tokens travel in.

- `MoEAllGatherTokenDispatcher`: every rank all-gathers the tokens (and routing) of its `tp_ep`
  group, keeps those routed to its experts, and the outputs return by a reduce-scatter over
  `tp_ep` (which also sums the expt_tp parts). Simple; communication grows with etp x ep.
- `MoEAlltoAllTokenDispatcher`: each token travels only to the ranks of its experts: an
  all-to-all over `ep` (with per-rank split sizes; each expt_tp rank with its own ep peers),
  then an all-gather over `expt_tp` of the rows received, of different sizes per rank, then a
  sort by local expert. Combine undoes them in reverse, the all-gather becoming a
  reduce-scatter of the same parts (summed in fp32).

The all-gathers and reduce-scatters along dim 0 are `tensor_parallel.mappings`' sequence-parallel
ones, applied to `tp_ep` (equal parts) or to `expt_tp` with split sizes (parts of different
sizes). With tensor + sequence parallelism each tp rank dispatches its own part of the sequence,
exactly as a rank of its own: nothing here depends on the dense tp size.

Both are dropless unless the router applied a capacity. Each forward makes one host
synchronisation: the per-expert token counts of the whole `tp_ep` group are copied to the host
once (they size the exchanges and the expert GEMMs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import (
    all_to_all_first,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.utils import group_rank, group_size
from megatron.core.transformer.transformer_config import TransformerConfig


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` along dim 0 with split sizes; backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        group: dist.ProcessGroup,
        output_splits: list[int],
        input_splits: list[int],
    ) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return all_to_all_first(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = all_to_all_first(grad, ctx.group, ctx.input_splits, ctx.output_splits)
        return out, None, None, None


def all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Differentiable `all_to_all_single` of `x` along dim 0: `input_splits[r]` rows go to rank
    r of `group`, `output_splits[r]` rows come from it."""
    return _AllToAll.apply(x, group, output_splits, input_splits)


def route_order(
    routing_map: torch.Tensor, probs: torch.Tensor, num_out: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The order of `permute`'s rows: `(permuted_probs [num_out], token_index [num_out])`.

    Args:
        routing_map: [T, E] boolean.
        probs: [T, E] routing weights.
        num_out: routing_map.sum(), known on the host (a stable argsort with a fixed-size
            result needs no device-to-host copy, unlike `nonzero`).
    """
    flat = routing_map.t().reshape(-1).to(torch.int8)
    order = torch.argsort(flat, descending=True, stable=True)[:num_out]
    return probs.t().reshape(-1)[order], order % routing_map.shape[0]


def permute(
    tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, num_out: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies each token once per expert it is routed to, grouped by expert.

    Args:
        tokens: [T, h].
        routing_map, probs, num_out: as `route_order`'s.

    Returns:
        `(permuted_tokens [num_out, h], permuted_probs [num_out], token_index [num_out])`:
        expert 0's tokens first, each expert's in token order; `token_index` maps each row back
        to its token.
    """
    permuted_probs, token_index = route_order(routing_map, probs, num_out)
    return tokens.index_select(0, token_index), permuted_probs, token_index


def unpermute(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Inverse of `permute`: sums the rows of each token into [num_tokens, h]."""
    out = rows.new_zeros((num_tokens, rows.shape[-1]))
    return out.index_add(0, token_index, rows)


class _CopyRows(torch.autograd.Function):
    """`tokens[token_index]` where every token has exactly `k` rows (dropless top-k); backward
    sums each token's rows by a gather in token order (`by_token`), not by atomic adds."""

    @staticmethod
    def forward(ctx, tokens, token_index, by_token, k):
        ctx.save_for_backward(by_token)
        ctx.k = k
        return tokens.index_select(0, token_index)

    @staticmethod
    def backward(ctx, grad):
        (by_token,) = ctx.saved_tensors
        summed = grad.index_select(0, by_token).view(-1, ctx.k, grad.shape[-1]).sum(dim=1)
        return summed, None, None, None


class _SumRows(torch.autograd.Function):
    """Inverse of `_CopyRows`: each token's `k` rows summed, gathered in token order
    (`by_token`); backward copies each token's gradient to its rows (`token_index`)."""

    @staticmethod
    def forward(ctx, rows, token_index, by_token, k):
        ctx.save_for_backward(token_index)
        return rows.index_select(0, by_token).view(-1, k, rows.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx, grad):
        (token_index,) = ctx.saved_tensors
        return grad.index_select(0, token_index), None, None, None


def _sort_chunks(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Reorders the chunks of `x` laid out [i][j] by `sizes` [I, J] to [j][i] order."""
    chunks = torch.split(x, sizes.reshape(-1).tolist())
    rows, cols = sizes.shape
    return torch.cat([chunks[i * cols + j] for j in range(cols) for i in range(rows)])


def token_exchange_group(
    ep_group: dist.ProcessGroup | None,
    expt_tp_group: dist.ProcessGroup | None,
    tp_ep_group: dist.ProcessGroup | None,
) -> dist.ProcessGroup | None:
    """The group the tokens travel in: `tp_ep_group`, the etp x ep ranks of one expert group.

    When one of `ep_group` and `expt_tp_group` has a single rank, `tp_ep` is the other one and
    need not be given.

    Raises:
        ValueError: `tp_ep_group` is missing while both groups have several ranks, or its size
            is not their product, or this rank's place in it is not the etp-ep order's.
    """
    etp, ep = group_size(expt_tp_group), group_size(ep_group)
    if tp_ep_group is None:
        if etp == 1:
            return ep_group
        if ep == 1:
            return expt_tp_group
        raise ValueError(
            f"expert tensor parallelism {etp} with expert parallelism {ep} needs the tp_ep "
            "group (the etp x ep ranks exchanging tokens, in etp-ep order); pass it as "
            "ProcessGroupCollection(tp_ep=...) or initialise parallel_state."
        )
    if group_size(tp_ep_group) != etp * ep:
        raise ValueError(
            f"the tp_ep group has {group_size(tp_ep_group)} ranks, but the expert tensor-parallel "
            f"({etp}) x expert-parallel ({ep}) groups make {etp * ep}; pass the tp_ep group of "
            "the same layout (etp-ep order) as the expt_tp and ep groups."
        )
    # The dispatch reads the gathered counts as [ep, etp]: this rank must sit at
    # ep_rank * etp + etp_rank.
    expected = group_rank(ep_group) * etp + group_rank(expt_tp_group)
    if group_rank(tp_ep_group) != expected:
        raise ValueError(
            f"this rank is {group_rank(tp_ep_group)} in the tp_ep group but {expected} in etp-ep "
            "order (ep rank x expert tensor-parallel size + expt_tp rank); build tp_ep in that "
            "order, as parallel_state does."
        )
    return tp_ep_group


class MoETokenDispatcher:
    """State shared by the dispatchers: the expert groups and this rank's experts.

    Args:
        config: The transformer configuration.
        ep_group: The expert-parallel group, or None for EP 1.
        expt_tp_group: The expert tensor-parallel group (the ranks holding the other parts of
            this rank's experts), or None for ETP 1.
        tp_ep_group: The etp x ep ranks of both, with index `ep_rank * etp + etp_rank`; may be
            None when ETP or EP is 1 (see `token_exchange_group`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        ep_group: dist.ProcessGroup | None,
        expt_tp_group: dist.ProcessGroup | None = None,
        tp_ep_group: dist.ProcessGroup | None = None,
    ):
        self.config = config
        self.ep_group = ep_group
        self.expt_tp_group = expt_tp_group
        self.tp_ep_group = token_exchange_group(ep_group, expt_tp_group, tp_ep_group)
        self.ep_size, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        self.etp_size, self.etp_rank = group_size(expt_tp_group), group_rank(expt_tp_group)
        self.num_local_experts = config.num_moe_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather dispatch, reduce-scatter combine (see the module docstring). Every rank of the
    tp_ep group must hold the same number of tokens."""

    def dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns `(expert_input, tokens_per_expert, expert_probs)`, the counts on the host."""
        self.hidden_shape = hidden_states.shape
        self.probs_dtype = probs.dtype
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        # The gathered tokens feed this rank's experts (or their parts) only: their gradient is
        # summed back (identities for a group of one rank).
        tokens = gather_from_sequence_parallel_region(tokens, self.tp_ep_group)
        probs = gather_from_sequence_parallel_region(probs, self.tp_ep_group)
        routing_map = gather_from_sequence_parallel_region(routing_map, self.tp_ep_group)
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        local_map = routing_map[:, local]
        tokens_per_expert = local_map.sum(dim=0).cpu()
        self.num_gathered = tokens.shape[0]
        expert_input, expert_probs, self.token_index = permute(
            tokens, local_map, probs[:, local], int(tokens_per_expert.sum())
        )
        return expert_input, tokens_per_expert, expert_probs

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Returns the [s, b, h] sum of each token's expert outputs."""
        output = unpermute(expert_output, self.token_index, self.num_gathered)
        if group_size(self.tp_ep_group) > 1:
            # Summed in the routing weights' precision (fp32 with moe_router_dtype), as
            # Megatron-core does.
            dtype = output.dtype
            output = reduce_scatter_to_sequence_parallel_region(
                output.to(self.probs_dtype), self.tp_ep_group
            )
            output = output.to(dtype)
        return output.view(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """All-to-all dispatch and combine (see the module docstring)."""

    def dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns `(expert_input, tokens_per_expert, expert_probs)`, the counts on the host."""
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        counts = gather_from_sequence_parallel_region(routing_map.sum(dim=0), self.tp_ep_group)
        topk = self.config.moe_router_topk
        # Whether every token has exactly k rows (capacity drops and pads rows, and callers may
        # pass any map): read in the same host synchronisation as the counts.
        exact = routing_map.sum(dim=1).eq(topk).all().to(counts.dtype).view(1)
        # The host synchronisation: [ep source, etp source, global expert] counts of tp_ep.
        host = torch.cat([counts, exact]).cpu()
        counts = host[:-1].view(self.ep_size, self.etp_size, -1)
        every_token_k = bool(host[-1])
        own = counts[self.ep_rank, self.etp_rank]
        local = counts[..., self.first_expert : self.first_expert + self.num_local_experts]
        self.input_splits = own.view(self.ep_size, -1).sum(dim=1).tolist()
        # From each ep peer with this expt_tp rank, then the rows each expt_tp rank received.
        self.output_splits = local[:, self.etp_rank].sum(dim=1).tolist()
        self.etp_splits = local.sum(dim=(0, 2)).tolist()
        # After the expt_tp gather the rows come by expt_tp source, ep source, local expert.
        self.local_counts = local.transpose(0, 1).reshape(-1, self.num_local_experts)
        self.num_tokens = tokens.shape[0]
        num_rows = int(own.sum())
        expert_probs, self.token_index = route_order(routing_map, probs, num_rows)
        self.by_token = None
        if every_token_k:
            # Copying tokens to rows and summing them back are then gathers (index_add's
            # atomics cost ~10% of a step on GPU). A row count of T * k would not say so: with
            # capacity, some tokens lose rows and others gain padding rows.
            self.by_token = torch.argsort(self.token_index, stable=True)
            expert_input = _CopyRows.apply(tokens, self.token_index, self.by_token, topk)
        else:
            expert_input = tokens.index_select(0, self.token_index)
        if self.ep_size > 1:
            expert_input = all_to_all(
                expert_input, self.ep_group, self.output_splits, self.input_splits
            )
            expert_probs = all_to_all(
                expert_probs, self.ep_group, self.output_splits, self.input_splits
            )
        # Every expt_tp rank computes its part of every row received, so each row's gradient is
        # partial there and summed back (the default tensor_parallel_output_grad).
        expert_input = gather_from_sequence_parallel_region(
            expert_input, self.expt_tp_group, output_split_sizes=self.etp_splits
        )
        expert_probs = gather_from_sequence_parallel_region(
            expert_probs, self.expt_tp_group, output_split_sizes=self.etp_splits
        )
        if self._sorts():
            # Received by source rank, then expert; the experts want expert, then rank.
            expert_input = _sort_chunks(expert_input, self.local_counts)
            expert_probs = _sort_chunks(expert_probs, self.local_counts)
        return expert_input, self.local_counts.sum(dim=0), expert_probs

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Returns the [s, b, h] sum of each token's expert outputs."""
        if self._sorts():
            expert_output = _sort_chunks(expert_output, self.local_counts.t())
        expert_output = reduce_scatter_to_sequence_parallel_region(
            expert_output, self.expt_tp_group, input_split_sizes=self.etp_splits
        )
        if self.ep_size > 1:
            expert_output = all_to_all(
                expert_output, self.ep_group, self.input_splits, self.output_splits
            )
        if self.by_token is None:
            output = unpermute(expert_output, self.token_index, self.num_tokens)
        else:
            output = _SumRows.apply(
                expert_output, self.token_index, self.by_token, self.config.moe_router_topk
            )
        return output.view(self.hidden_shape)

    def _sorts(self) -> bool:
        """Whether rows from several ranks for several local experts need regrouping."""
        return self.num_local_experts > 1 and self.local_counts.shape[0] > 1
