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

Both are dropless unless the router applied a capacity. How a dispatcher knows the number of
rows it exchanges and hands the experts is chosen once, at construction (`DispatchSizing`):

- `FIXED` (dropless, one rank per expert group, experts that take the counts on the device):
  T tokens make exactly T * topk rows, known from the shapes; the counts stay on the device.
- `WORST_CASE` (dropless, several ranks, `moe_pad_dispatch_to_worst_case`): every exchange is
  padded to what the counts can be at most (the all-to-all sends each destination T * topk rows,
  the all-gather keeps T_gathered * min(topk, local experts) rows), so its sizes come from the
  shapes too; the counts travel on the device. The rows past the counts' sum are padding, which
  the experts may fill with anything: the combine never reads them and gives them no gradient.
- `HOST` (the default with several ranks, whenever a capacity applies, and for experts that
  read the counts on the host anyway): the per-expert counts of the whole `tp_ep` group are
  copied to the host once per forward; they size the exchanges exactly.

FIXED and WORST_CASE take a dropless routing map, one that routes every token to exactly
`moe_router_topk` experts (what the router gives without a capacity).
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from megatron.core.fusions.moe_routing import route_rows
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


class DispatchSizing(enum.Enum):
    """How a dispatcher sizes its exchanges and the experts' input (module docstring)."""

    FIXED = "fixed"
    """Dropless, one rank per expert group: T * topk rows, no host read."""
    WORST_CASE = "worst_case"
    """Dropless exchanges padded to their largest possible size, no host read."""
    HOST = "host"
    """The counts copied to the host once per forward size everything exactly."""

    @classmethod
    def of(
        cls, config: TransformerConfig, exchange_size: int, experts_read_counts: bool = False
    ) -> DispatchSizing:
        """The sizing of a layer with `config` whose tokens travel among `exchange_size` ranks
        (the etp x ep ranks of an expert group): HOST when the experts read the counts on the
        host anyway (`experts_read_counts`: `SequentialMLP.reads_counts_on_host`), where sizing
        without a host read would save nothing.

        Raises:
            ValueError: `moe_pad_dispatch_to_worst_case` with experts that read the counts on
                the host on this device (grouped FP8 experts where their kernels do not run;
                what the config alone decides, it refuses itself).
        """
        if experts_read_counts and config.moe_pad_dispatch_to_worst_case:
            raise ValueError(
                "moe_pad_dispatch_to_worst_case spares the host read of the token counts, but "
                f"the experts in FP8 ({config.fp8}) read them on the host on this device: their "
                "grouped kernels, which take the counts on the device, need Triton and a GPU of "
                "compute capability 9.0 or later. Drop moe_pad_dispatch_to_worst_case "
                "(--moe-pad-dispatch-to-worst-case) or FP8 (--fp8-format)."
            )
        if config.moe_expert_capacity_factor is not None or experts_read_counts:
            return cls.HOST
        if exchange_size == 1:
            return cls.FIXED
        return cls.WORST_CASE if config.moe_pad_dispatch_to_worst_case else cls.HOST


def route_order(
    routing_map: torch.Tensor, probs: torch.Tensor, num_out: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The order of `permute`'s rows: `(permuted_probs [num_out], token_index [num_out])`.

    Args:
        routing_map: [T, E] boolean.
        probs: [T, E] routing weights.
        num_out: routing_map.sum(), known on the host (a stable argsort with a fixed-size
            result needs no device-to-host copy, unlike `nonzero`); or more: the rows after
            the routed ones are (token, expert) pairs that are not routed, in the same order.
    """
    flat = routing_map.t().reshape(-1).to(torch.int8)
    order = torch.argsort(flat, descending=True, stable=True)[:num_out]
    # `index_select`, not `[order]`: the indices are distinct, so its backward (`index_add`
    # into zeros) gives the same gradient as indexing's (`index_put_` accumulating, which
    # sorts them first on CUDA: a few launches more and ~0.3 ms of host time per layer).
    return probs.t().reshape(-1).index_select(0, order), order % routing_map.shape[0]


def route_every_token_k(
    routing_map: torch.Tensor, probs: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route_order` where every token is routed to exactly `topk` experts (dropless), with
    each token's rows in expert order and each expert's row count: by the kernels of
    `megatron.core.fusions.moe_routing` where they run (the same rows), else by PyTorch's ops.

    Returns:
        `(permuted_probs [T * topk], token_index [T * topk], by_token [T * topk], counts [E])`.
    """
    routes = route_rows(routing_map, topk)
    if routes is None:
        permuted_probs, token_index = route_order(routing_map, probs, routing_map.shape[0] * topk)
        by_token = torch.argsort(token_index, stable=True)
        return permuted_probs, token_index, by_token, routing_map.sum(dim=0)
    permuted_probs = probs.reshape(-1).index_select(0, routes.source_index)
    return permuted_probs, routes.token_index, routes.by_token, routes.counts


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


def _place_rows(x: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`x`'s rows at rows `index` (distinct) of a [num_rows, ...] tensor of zeros; backward
    gives `x` the gradient of those rows only (a gather, no atomic adds)."""
    return x.new_zeros((num_rows, *x.shape[1:])).index_copy(0, index, x)


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


class _WorstCaseExchange:
    """The padded all-to-all of `WORST_CASE` sizing: each rank sends every ep peer a block of
    `capacity` rows (T * topk, all its rows could go to one peer), its rows for that peer's
    experts first, then padding; the blocks received are gathered over `expt_tp` like the
    exact exchange's rows and regrouped by local expert on the device. Combine takes the
    reverse path and reads back only the real rows.

    Every rank of the tp_ep group must route the same number of tokens (the blocks are of
    equal size everywhere).

    Args:
        dispatcher: the dispatcher whose groups and experts it exchanges for.
        capacity: rows per destination block (T * topk).
    """

    def __init__(self, dispatcher: MoEAlltoAllTokenDispatcher, capacity: int):
        self.dispatcher = dispatcher
        self.capacity = capacity

    def dispatch(
        self, rows: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sends `rows` [capacity, h] and `probs`, sorted by global expert (`counts` [E] rows
        each, on the device), to their experts' ranks.

        Returns:
            `(expert_input, tokens_per_expert, expert_probs)`: the rows received, grouped by
            local expert with padding after them, and the device counts per local expert.
        """
        d = self.dispatcher
        ep, etp, experts = d.ep_size, d.etp_size, d.num_local_experts
        capacity = self.capacity
        per_peer = counts.view(ep, experts).sum(dim=1)
        row = torch.arange(capacity, device=rows.device)
        peer = torch.searchsorted(torch.cumsum(per_peer, 0), row, right=True)
        # Where each row sits in the send buffer: its peer's block, after the peer's earlier rows.
        self.send_index = peer * capacity + row - _exclusive_cumsum(per_peer, 0)[peer]
        padded_rows = ep * capacity
        rows = _place_rows(rows, self.send_index, padded_rows)
        probs = _place_rows(probs, self.send_index, padded_rows)
        splits = [capacity] * ep
        rows = all_to_all(rows, d.ep_group, splits, splits)
        probs = all_to_all(probs, d.ep_group, splits, splits)
        self.etp_splits = [padded_rows] * etp
        rows = gather_from_sequence_parallel_region(
            rows, d.expt_tp_group, output_split_sizes=self.etp_splits
        )
        probs = gather_from_sequence_parallel_region(
            probs, d.expt_tp_group, output_split_sizes=self.etp_splits
        )
        # [ep source, etp source, global expert] counts of tp_ep; the blocks now lie by etp
        # source, then ep source, as the exact exchange's rows do.
        group_counts = gather_from_sequence_parallel_region(counts, d.tp_ep_group)
        local = group_counts.view(ep, etp, -1)[..., d.first_expert : d.first_expert + experts]
        block_counts = local.transpose(0, 1).reshape(-1, experts)
        self.expert_index = self._expert_order(block_counts)
        num_rows = rows.shape[0]
        rows = _place_rows(rows, self.expert_index, num_rows)
        probs = _place_rows(probs, self.expert_index, num_rows)
        return rows, block_counts.sum(dim=0), probs

    def _expert_order(self, block_counts: torch.Tensor) -> torch.Tensor:
        """Where each received row goes so that the rows are grouped by local expert (each
        expert's by block, as the exact exchange sorts them), the padding after all of them:
        a permutation of the [blocks * capacity] rows."""
        blocks, experts = block_counts.shape
        ends = torch.cumsum(block_counts, dim=1)  # [B, E] end of each expert's rows in a block
        slot = torch.arange(self.capacity, device=ends.device).expand(blocks, -1).contiguous()
        expert = torch.searchsorted(ends, slot, right=True)  # [B, C]; `experts` for padding
        real = expert < experts
        expert = expert.clamp(max=experts - 1)
        in_block = slot - (ends - block_counts).gather(1, expert)  # rank among its expert's
        expert_start = _exclusive_cumsum(block_counts.sum(dim=0), 0)
        earlier_blocks = _exclusive_cumsum(block_counts, 0).gather(1, expert)
        target = expert_start[expert] + earlier_blocks + in_block
        # Padding goes after the real rows, in the order it comes.
        block_rows = block_counts.sum(dim=1)
        flat = torch.arange(blocks * self.capacity, device=ends.device).view(blocks, -1)
        padding = block_rows.sum() + flat - torch.cumsum(block_rows, 0).unsqueeze(1)
        return torch.where(real, target, padding).reshape(-1)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """The reverse of `dispatch`: [capacity, h] rows in the order `dispatch` took them."""
        d = self.dispatcher
        rows = expert_output.index_select(0, self.expert_index)
        rows = reduce_scatter_to_sequence_parallel_region(
            rows, d.expt_tp_group, input_split_sizes=self.etp_splits
        )
        splits = [self.capacity] * d.ep_size
        rows = all_to_all(rows, d.ep_group, splits, splits)
        return rows.index_select(0, self.send_index)


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
    """State shared by the dispatchers: the expert groups, this rank's experts and the sizing.

    Args:
        config: The transformer configuration.
        ep_group: The expert-parallel group, or None for EP 1.
        expt_tp_group: The expert tensor-parallel group (the ranks holding the other parts of
            this rank's experts), or None for ETP 1.
        tp_ep_group: The etp x ep ranks of both, with index `ep_rank * etp + etp_rank`; may be
            None when ETP or EP is 1 (see `token_exchange_group`).
        sizing: How the exchanges are sized; None: `DispatchSizing.of(config, ...)` for
            experts that read nothing on the host.

    Raises:
        ValueError: `sizing` FIXED with several ranks to exchange tokens with, or FIXED /
            WORST_CASE with a capacity (they need dropless routing).
    """

    def __init__(
        self,
        config: TransformerConfig,
        ep_group: dist.ProcessGroup | None,
        expt_tp_group: dist.ProcessGroup | None = None,
        tp_ep_group: dist.ProcessGroup | None = None,
        sizing: DispatchSizing | None = None,
    ):
        self.config = config
        self.ep_group = ep_group
        self.expt_tp_group = expt_tp_group
        self.tp_ep_group = token_exchange_group(ep_group, expt_tp_group, tp_ep_group)
        self.ep_size, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        self.etp_size, self.etp_rank = group_size(expt_tp_group), group_rank(expt_tp_group)
        self.num_local_experts = config.num_moe_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        exchange_size = group_size(self.tp_ep_group)
        self.sizing = DispatchSizing.of(config, exchange_size) if sizing is None else sizing
        if self.sizing is DispatchSizing.FIXED and exchange_size > 1:
            raise ValueError(
                f"DispatchSizing.FIXED exchanges no tokens, but {exchange_size} ranks share these "
                "experts' tokens; use WORST_CASE or HOST."
            )
        if self.sizing is not DispatchSizing.HOST and config.moe_expert_capacity_factor is not None:
            raise ValueError(
                f"DispatchSizing.{self.sizing.name} needs dropless routing, but "
                f"moe_expert_capacity_factor is {config.moe_expert_capacity_factor}; use HOST "
                "or drop the capacity."
            )


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather dispatch, reduce-scatter combine (see the module docstring). Every rank of the
    tp_ep group must hold the same number of tokens.

    Without a host read (FIXED, WORST_CASE) it keeps `gathered tokens * min(topk, local
    experts)` rows, the most that can be routed here; the padding rows after the routed ones
    read and write a row of zeros past the tokens, so they touch no token's output or gradient.
    """

    def dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns `(expert_input, tokens_per_expert, expert_probs)`: the counts on the host
        with HOST sizing, else on the device (with WORST_CASE the input has padding rows
        after its counts' sum)."""
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
        self.num_gathered = tokens.shape[0]
        tokens_per_expert = local_map.sum(dim=0)
        if self.sizing is DispatchSizing.HOST:
            tokens_per_expert = tokens_per_expert.cpu()
            num_rows = int(tokens_per_expert.sum())
        else:
            # Exactly the routed rows with one rank (FIXED), else the most there can be.
            topk = self.config.moe_router_topk
            num_rows = self.num_gathered * min(topk, self.num_local_experts)
        expert_probs, self.token_index = route_order(local_map, probs[:, local], num_rows)
        if self.sizing is DispatchSizing.WORST_CASE:
            # The padding rows point at a row of zeros after the tokens.
            real = torch.arange(num_rows, device=tokens.device) < tokens_per_expert.sum()
            self.token_index = torch.where(real, self.token_index, self.num_gathered)
            # Weight 0: the experts' padding outputs are unspecified (NaN, say), and 0 x NaN
            # would reach the routing probabilities' gradient.
            expert_probs = torch.where(real, expert_probs, 0)
            tokens = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])
        expert_input = tokens.index_select(0, self.token_index)
        return expert_input, tokens_per_expert, expert_probs

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Returns the [s, b, h] sum of each token's expert outputs."""
        if self.sizing is DispatchSizing.WORST_CASE:
            # The padding rows' outputs land in the row of zeros past the tokens, then dropped.
            output = unpermute(expert_output, self.token_index, self.num_gathered + 1)
            output = output[: self.num_gathered]
        else:
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
        """Returns `(expert_input, tokens_per_expert, expert_probs)`: the counts on the host
        with HOST sizing, else on the device (with WORST_CASE the input has padding rows
        after its counts' sum)."""
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        self.num_tokens = tokens.shape[0]
        if self.sizing is DispatchSizing.HOST:
            return self._dispatch_sized_on_host(tokens, probs, routing_map)
        topk = self.config.moe_router_topk
        # Dropless: every token has exactly topk rows.
        num_rows = self.num_tokens * topk
        expert_probs, self.token_index, self.by_token, counts = route_every_token_k(
            routing_map, probs, topk
        )
        expert_input = _CopyRows.apply(tokens, self.token_index, self.by_token, topk)
        if self.sizing is DispatchSizing.FIXED:
            return expert_input, counts, expert_probs
        self.exchange = _WorstCaseExchange(self, num_rows)
        return self.exchange.dispatch(expert_input, expert_probs, counts)

    def _dispatch_sized_on_host(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        self.by_token = None
        if every_token_k:
            # Copying tokens to rows and summing them back are then gathers (index_add's
            # atomics cost ~10% of a step on GPU). A row count of T * k would not say so: with
            # capacity, some tokens lose rows and others gain padding rows.
            expert_probs, self.token_index, self.by_token, _ = route_every_token_k(
                routing_map, probs, topk
            )
            expert_input = _CopyRows.apply(tokens, self.token_index, self.by_token, topk)
        else:
            num_rows = int(own.sum())
            expert_probs, self.token_index = route_order(routing_map, probs, num_rows)
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
        if self.sizing is DispatchSizing.HOST:
            expert_output = self._combine_sized_on_host(expert_output)
        elif self.sizing is DispatchSizing.WORST_CASE:
            expert_output = self.exchange.combine(expert_output)
        if self.by_token is None:
            output = unpermute(expert_output, self.token_index, self.num_tokens)
        else:
            output = _SumRows.apply(
                expert_output, self.token_index, self.by_token, self.config.moe_router_topk
            )
        return output.view(self.hidden_shape)

    def _combine_sized_on_host(self, expert_output: torch.Tensor) -> torch.Tensor:
        if self._sorts():
            expert_output = _sort_chunks(expert_output, self.local_counts.t())
        expert_output = reduce_scatter_to_sequence_parallel_region(
            expert_output, self.expt_tp_group, input_split_sizes=self.etp_splits
        )
        if self.ep_size > 1:
            expert_output = all_to_all(
                expert_output, self.ep_group, self.input_splits, self.output_splits
            )
        return expert_output

    def _sorts(self) -> bool:
        """Whether rows from several ranks for several local experts need regrouping."""
        return self.num_local_experts > 1 and self.local_counts.shape[0] > 1
