"""The order of a pipeline schedule's forward and backward passes on one rank, and the transfers
between stages around them: pure functions of the pipeline's shape, no tensors, no processes.

`pipeline_order()` gives Megatron-LM's orders (`megatron.core.pipeline_parallel.schedules`):

- 1F1B (`forward_backward_pipelining_without_interleaving`): rank r of P runs
  `min(P - r - 1, M)` warm-up forwards, then alternates one forward and one backward, then runs
  the backwards left (cool-down). At most `P - r` microbatches' activations are alive at once.
- Interleaved (`forward_backward_pipelining_with_interleaving`), V model chunks per rank: the
  forwards visit (microbatch, chunk) in the order of `schedule_table()` (groups of
  `microbatch_group_size_per_vp_stage` microbatches, chunk by chunk); the backwards visit the
  same table with the chunks reversed. Warm-up: `(P - r - 1) * 2 + (V - 1) * group` forwards,
  all of them when that reaches `M * V`.
- Forward only (evaluation): every forward, in table order.

`communication_plan()` pairs every pass with the transfers it needs: before each pass, one
batched exchange sends what the previous pass produced (an activation to the next stage after a
forward, an input gradient to the previous stage after a backward) and receives this pass's
input (an activation before a forward, an output gradient before a backward). The schedules
(`schedules.py`) run exactly this plan, so its order is what the tests check, against tables
derived from Megatron-LM's code and against a simulation of matched sends and receives.
"""

from __future__ import annotations

import dataclasses
import enum


class Pass(enum.Enum):
    """A forward or a backward of one microbatch through one model chunk."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclasses.dataclass(frozen=True)
class Action:
    """One pass of the schedule.

    Attributes:
        kind: forward or backward.
        microbatch: the microbatch, 0 .. M-1.
        chunk: the model chunk (virtual stage) on this rank, 0 .. V-1.
    """

    kind: Pass
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}.{self.chunk}"


class Payload(enum.Enum):
    """What travels between stages."""

    ACTIVATION = "activation"
    GRADIENT = "gradient"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One point-to-point message, seen from this rank.

    Attributes:
        send: True to send, False to receive.
        peer: the other rank's index in the pipeline group.
        payload: an activation (forward) or the gradient of one (backward).
        microbatch: whose.
        chunk: the chunk on this rank that produces (send) or consumes (receive) it.
    """

    send: bool
    peer: int
    payload: Payload
    microbatch: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Step:
    """A batched exchange, then (unless None, at the end) one pass."""

    exchange: tuple[Transfer, ...]
    action: Action | None


def schedule_table(
    num_microbatches: int, num_chunks: int, group_size: int
) -> list[tuple[int, int]]:
    """Megatron-LM's `get_schedule_table`: (microbatch, chunk) in forward order. Microbatches
    go in groups of `group_size` through chunk 0, then chunk 1, ...; the last group takes
    every microbatch left."""
    table = []
    for start in range(0, num_microbatches, group_size):
        end = num_microbatches if start + group_size >= num_microbatches else start + group_size
        table.extend((mb, chunk) for chunk in range(num_chunks) for mb in range(start, end))
    return table


def num_warmup_microbatches(
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    num_chunks: int = 1,
    group_size: int | None = None,
    forward_only: bool = False,
) -> int:
    """Forwards rank `pp_rank` runs before its first backward (Megatron-LM's
    `get_pp_rank_microbatches`); `num_chunks > 1` is the interleaved schedule."""
    total = num_microbatches * num_chunks
    if forward_only:
        return total
    if num_chunks == 1:
        warmup = pp_size - pp_rank - 1
    else:
        warmup = (pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * (group_size or pp_size)
    return min(warmup, total)


def check_interleaving(pp_size: int, num_microbatches: int, group_size: int) -> None:
    """Megatron-LM's conditions on the interleaved schedule's microbatches.

    Raises:
        ValueError: the group size is outside [P, M], or the last group is shorter than P
            (a dependency bubble upstream refuses).
    """
    if not pp_size <= group_size <= num_microbatches:
        raise ValueError(
            f"The interleaved schedule runs microbatches through each virtual stage in groups of "
            f"{group_size} (--microbatch-group-size-per-virtual-pipeline-stage, default the "
            f"pipeline size), which must lie in [pipeline size {pp_size}, microbatches "
            f"{num_microbatches}]; raise the global batch or change the group size."
        )
    remainder = num_microbatches % group_size
    if 0 < remainder < pp_size:
        raise ValueError(
            f"{num_microbatches} microbatches leave a last group of {remainder} < pipeline size "
            f"{pp_size} (groups of {group_size}): the pipeline would stall. Use a multiple of "
            f"{group_size} microbatches, or one leaving at least {pp_size} in the last group."
        )


def pipeline_order(
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    num_chunks: int = 1,
    group_size: int | None = None,
    forward_only: bool = False,
) -> list[Action]:
    """Every pass of one iteration on rank `pp_rank`, in the order the schedule runs them.

    Args:
        pp_size: pipeline ranks P (1: no pipelining, forward then backward per microbatch).
        pp_rank: this rank, 0 .. P-1.
        num_microbatches: M.
        num_chunks: model chunks per rank V; > 1 selects the interleaved schedule.
        group_size: the interleaved schedule's microbatches per group (None: P).
        forward_only: forwards only.
    """
    group_size = group_size or pp_size
    table = schedule_table(num_microbatches, num_chunks, group_size)
    if forward_only:
        return [Action(Pass.FORWARD, mb, chunk) for mb, chunk in table]
    if pp_size == 1 and num_chunks == 1:
        return [Action(kind, mb, 0) for mb in range(num_microbatches) for kind in Pass]
    total = len(table)
    warmup = num_warmup_microbatches(pp_size, pp_rank, num_microbatches, num_chunks, group_size)

    def forward(k: int) -> Action:
        mb, chunk = table[k]
        return Action(Pass.FORWARD, mb, chunk)

    def backward(k: int) -> Action:
        mb, chunk = table[k]
        return Action(Pass.BACKWARD, mb, num_chunks - 1 - chunk)

    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(k + warmup), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def peak_live_activations(order: list[Action]) -> int:
    """The most microbatch-chunk activations held at once: forwards whose backward has not run
    (forward only: none is held past its pass, so 1)."""
    live = peak = 0
    for action in order:
        live += 1 if action.kind is Pass.FORWARD else -1
        peak = max(peak, live)
    return max(peak, 1) if order else 0


def _neighbour(
    pp_size: int, pp_rank: int, chunk: int, num_chunks: int, step: int
) -> tuple[int, int] | None:
    """(rank, chunk) of the model part `step` (+1: next, -1: previous) away, None past the ends."""
    position = chunk * pp_size + pp_rank + step
    if not 0 <= position < pp_size * num_chunks:
        return None
    chunk, rank = divmod(position, pp_size)
    return rank, chunk


def _input(action: Action, pp_size: int, pp_rank: int, num_chunks: int) -> Transfer | None:
    """The receive of `action`'s input (None: it has none to receive)."""
    forward = action.kind is Pass.FORWARD
    source = _neighbour(pp_size, pp_rank, action.chunk, num_chunks, -1 if forward else 1)
    if source is None:
        return None
    payload = Payload.ACTIVATION if forward else Payload.GRADIENT
    return Transfer(False, source[0], payload, action.microbatch, action.chunk)


def _output(action: Action, pp_size: int, pp_rank: int, num_chunks: int) -> Transfer | None:
    """The send of what `action` produces (None: nothing to send)."""
    forward = action.kind is Pass.FORWARD
    target = _neighbour(pp_size, pp_rank, action.chunk, num_chunks, 1 if forward else -1)
    if target is None:
        return None
    payload = Payload.ACTIVATION if forward else Payload.GRADIENT
    return Transfer(True, target[0], payload, action.microbatch, action.chunk)


def communication_plans(
    pp_size: int,
    num_microbatches: int,
    num_chunks: int = 1,
    group_size: int | None = None,
    forward_only: bool = False,
) -> list[list[Step]]:
    """Every rank's passes with the exchanges around them, such that the ranks never wait for
    each other in a cycle.

    Each rank's order is `pipeline_order`'s. Before each pass a rank runs one batched exchange
    (all of its sends and receives issued together, then waited for, as
    `torch.distributed.batch_isend_irecv` with NCCL: an exchange ends only when every peer has
    posted the matching operation). The exchange before a pass sends what the previous pass
    produced. A message is received in the exchange its receiver is in when the sender posts
    it (at the latest, the exchange before the pass that consumes it): the plan comes from
    running all ranks' orders together until each is blocked, then pairing every pending send
    with its receiver's current exchange, which is how Megatron-LM's schedules align their
    receives with their peers' sends (its interleaved schedule receives at rank 0 what rank
    P-1 sends in the same iteration, before rank 0 needs it).

    Returns:
        `plans[rank]`: that rank's steps; the last step has no pass and sends what the last
        pass produced.

    Raises:
        RuntimeError: the orders cannot run without a cycle of waits (an internal error: the
            orders are Megatron-LM's, which never do).
    """
    orders = [
        pipeline_order(pp_size, rank, num_microbatches, num_chunks, group_size, forward_only)
        for rank in range(pp_size)
    ]
    # Per rank: the exchange built so far for each step (sends fixed now, receives added as
    # they are paired), and the message each pass consumes.
    sends: list[list[list[Transfer]]] = []
    needs: list[list[Transfer | None]] = []
    for rank, order in enumerate(orders):
        outputs = [_output(a, pp_size, rank, num_chunks) for a in order]
        sends.append([[o] if o else [] for o in [None, *outputs]])
        needs.append([_input(a, pp_size, rank, num_chunks) for a in order] + [None])
    exchanges = [[list(step) for step in rank_sends] for rank_sends in sends]
    position = [0] * pp_size  # the step each rank is at
    unmatched = [list(exchanges[rank][0]) for rank in range(pp_size)]
    received: list[set[tuple]] = [set() for _ in range(pp_size)]
    while True:
        progress = True
        while progress:
            progress = False
            for rank in range(pp_size):
                step = position[rank]
                if step == len(exchanges[rank]):
                    continue
                need = needs[rank][step]
                if unmatched[rank] or (need is not None and _key(need) not in received[rank]):
                    continue
                position[rank] += 1
                if position[rank] < len(exchanges[rank]):
                    unmatched[rank] = list(exchanges[rank][position[rank]])
                progress = True
        if all(p == len(e) for p, e in zip(position, exchanges)):
            break
        paired = False
        for rank in range(pp_size):
            for send in [t for t in unmatched[rank] if t.send]:
                peer = send.peer
                if position[peer] == len(exchanges[peer]):
                    break
                receive = _matching_receive(send, rank, pp_size, num_chunks)
                exchanges[peer][position[peer]].append(receive)
                received[peer].add(_key(receive))
                unmatched[rank].remove(send)
                paired = True
        if not paired:
            raise RuntimeError(
                f"pipeline plan for P={pp_size}, M={num_microbatches}, V={num_chunks} "
                f"waits in a cycle at steps {position}"
            )
    return [
        [
            Step(tuple(exchanges[rank][i]), order[i] if i < len(order) else None)
            for i in range(len(order) + 1)
        ]
        for rank, order in enumerate(orders)
    ]


def _key(transfer: Transfer) -> tuple:
    return (transfer.payload, transfer.microbatch, transfer.chunk)


def _matching_receive(send: Transfer, rank: int, pp_size: int, num_chunks: int) -> Transfer:
    """The receive, at `send.peer`, of what `rank` sends."""
    step = 1 if send.payload is Payload.ACTIVATION else -1
    _, chunk = _neighbour(pp_size, rank, send.chunk, num_chunks, step)
    return Transfer(False, rank, send.payload, send.microbatch, chunk)
