"""The schedules' order of passes against Megatron-LM's, their peak of live activations, and
their exchange plans run by a rendezvous simulation (pure: no processes)."""

from __future__ import annotations

import pytest

from megatron.core.pipeline_parallel.layer_split import PipelineSplit
from megatron.core.pipeline_parallel.schedule_order import (
    Pass,
    Payload,
    check_interleaving,
    communication_plans,
    peak_live_activations,
    pipeline_order,
    schedule_table,
)

# Derived by hand from Megatron-LM's schedules.py (warm-up count from get_pp_rank_microbatches,
# then forward k + warm-up / backward k pairs, then cool-down; interleaved: get_schedule_table
# for the forwards, chunks reversed for the backwards). "F2.1": forward of microbatch 2 through
# chunk 1.
UPSTREAM_ORDERS = {
    # (P, M, V): one order per rank.
    (2, 4, 1): [
        "F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 B3.0",
        "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0",
    ],
    (4, 3, 1): [
        "F0.0 F1.0 F2.0 B0.0 B1.0 B2.0",
        "F0.0 F1.0 F2.0 B0.0 B1.0 B2.0",
        "F0.0 F1.0 B0.0 F2.0 B1.0 B2.0",
        "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0",
    ],
    (2, 4, 2): [
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0",
    ],
    (2, 2, 2): [
        "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0",
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0",
    ],
}


def _order(*args, **kwargs) -> str:
    return " ".join(str(action) for action in pipeline_order(*args, **kwargs))


@pytest.mark.parametrize("shape", sorted(UPSTREAM_ORDERS))
def test_order_is_megatron_lms(shape):
    pp_size, num_microbatches, num_chunks = shape
    for rank, expected in enumerate(UPSTREAM_ORDERS[shape]):
        assert _order(pp_size, rank, num_microbatches, num_chunks) == expected, rank


def test_schedule_table_groups_microbatches_per_chunk():
    # Megatron-LM's docstring example: PP 2, 5 microbatches in groups of 3, 2 chunks.
    table = schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [chunk for _, chunk in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_forward_only_runs_every_forward_in_table_order():
    order = pipeline_order(2, 0, 4, 2, forward_only=True)
    assert [(a.kind, a.microbatch, a.chunk) for a in order] == [
        (Pass.FORWARD, mb, chunk) for mb, chunk in schedule_table(4, 2, 2)
    ]


@pytest.mark.parametrize("pp_size", [2, 3, 4, 8])
@pytest.mark.parametrize("num_microbatches", [1, 3, 8, 16])
def test_1f1b_keeps_at_most_pp_size_minus_rank_activations(pp_size, num_microbatches):
    for rank in range(pp_size):
        order = pipeline_order(pp_size, rank, num_microbatches)
        assert peak_live_activations(order) == min(pp_size - rank, num_microbatches)
        # Every microbatch once forward and once backward, each backward after its forward.
        seen = set()
        for action in order:
            if action.kind is Pass.BACKWARD:
                assert action.microbatch in seen
            else:
                seen.add(action.microbatch)
        assert len(order) == 2 * num_microbatches


def test_interleaving_holds_more_but_bounded_activations():
    # Rank 0 of P=4, V=2, M=8: warm-up (P-1)*2 + (V-1)*P = 10 forwards, one more in steady state.
    assert peak_live_activations(pipeline_order(4, 0, 8, 2)) == 11
    assert peak_live_activations(pipeline_order(4, 3, 8, 2)) == 5


def test_interleaving_refuses_microbatch_counts_upstream_refuses():
    with pytest.raises(ValueError, match="must lie in"):
        check_interleaving(4, 3, 4)
    with pytest.raises(ValueError, match="stall"):
        check_interleaving(4, 9, 4)
    check_interleaving(4, 8, 4)


def _receiver_key(transfer, rank, pp_size):
    """(payload, microbatch, position of the receiving part in the whole model)."""
    position = transfer.chunk * pp_size + rank
    if transfer.send:
        position += 1 if transfer.payload is Payload.ACTIVATION else -1
    return transfer.payload, transfer.microbatch, position


def _simulate(plans, pp_size, num_chunks):
    """Runs the plans with NCCL's semantics: an exchange ends once each of its operations met the
    peer's matching one in the peer's current exchange, in per-pair order. Checks every pass
    finds its input received. Returns whether all ranks finished."""
    position = [0] * pp_size
    pending = [list(plan[0].exchange) for plan in plans]
    received = [set() for _ in range(pp_size)]
    last_part = pp_size * num_chunks - 1
    while True:
        progress = False
        for rank in range(pp_size):
            for send in [t for t in pending[rank] if t.send]:
                peer = send.peer
                if position[peer] == len(plans[peer]):
                    continue
                receives = [t for t in pending[peer] if not t.send and t.peer == rank]
                if receives:  # the first pending receive from `rank`: per-pair order
                    receive = receives[0]
                    assert _receiver_key(receive, peer, pp_size) == _receiver_key(
                        send, rank, pp_size
                    )
                    pending[peer].remove(receive)
                    pending[rank].remove(send)
                    received[peer].add(_receiver_key(receive, peer, pp_size))
                    progress = True
        for rank in range(pp_size):
            while position[rank] < len(plans[rank]) and not pending[rank]:
                action = plans[rank][position[rank]].action
                if action is not None:
                    forward = action.kind is Pass.FORWARD
                    part = action.chunk * pp_size + rank
                    if part != (0 if forward else last_part):
                        payload = Payload.ACTIVATION if forward else Payload.GRADIENT
                        assert (payload, action.microbatch, part) in received[rank], action
                position[rank] += 1
                progress = True
                if position[rank] < len(plans[rank]):
                    pending[rank] = list(plans[rank][position[rank]].exchange)
        if all(p == len(plan) for p, plan in zip(position, plans)):
            return True
        if not progress:
            return False


@pytest.mark.parametrize("pp_size", [2, 3, 4])
@pytest.mark.parametrize("num_chunks", [1, 2, 3])
@pytest.mark.parametrize("forward_only", [False, True])
def test_exchange_plans_run_without_deadlock(pp_size, num_chunks, forward_only):
    ran = 0
    for num_microbatches in range(1, 13):
        if num_chunks > 1 and not pp_size <= num_microbatches:
            continue
        if num_chunks > 1 and 0 < num_microbatches % pp_size < pp_size:
            continue
        plans = communication_plans(pp_size, num_microbatches, num_chunks, None, forward_only)
        for rank, plan in enumerate(plans):
            orders = [s.action for s in plan if s.action is not None]
            assert orders == pipeline_order(
                pp_size, rank, num_microbatches, num_chunks, None, forward_only
            )
        assert _simulate(plans, pp_size, num_chunks), (pp_size, num_microbatches, num_chunks)
        ran += 1
    assert ran > 0


def test_naive_pairing_would_deadlock():
    """The simulation can fail: receiving each input only right before its pass (no receive
    posted early) deadlocks the interleaved schedule, which is why the plan aligns receives
    with the peers' sends."""
    from megatron.core.pipeline_parallel.schedule_order import Step, _input, _output

    pp_size, num_microbatches, num_chunks = 2, 4, 2
    plans = []
    for rank in range(pp_size):
        order = pipeline_order(pp_size, rank, num_microbatches, num_chunks)
        steps, previous = [], None
        for action in order:
            exchange = [t for t in (previous, _input(action, pp_size, rank, num_chunks)) if t]
            steps.append(Step(tuple(exchange), action))
            previous = _output(action, pp_size, rank, num_chunks)
        steps.append(Step(tuple(t for t in (previous,) if t), None))
        plans.append(steps)
    assert not _simulate(plans, pp_size, num_chunks)


def test_layer_split_matches_megatron_lms_examples():
    # Megatron-LM's comment: 8 layers, 2 stages, 2 virtual stages.
    split = PipelineSplit(8, 2, 2)
    assert [list(split.layers(r, v)) for v in range(2) for r in range(2)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    split = PipelineSplit(8, 2, 4)
    assert [list(split.layers(0, v)) for v in range(4)] == [[0], [2], [4], [6]]
    uneven = PipelineSplit(
        10, 3, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2
    )
    assert [list(uneven.layers(r)) for r in range(3)] == [[0, 1], [2, 3, 4, 5, 6, 7], [8, 9]]
    accounted = PipelineSplit(
        6, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True
    )
    assert [len(accounted.layers(r)) for r in range(4)] == [1, 2, 2, 1]


@pytest.mark.parametrize(
    "split, flag",
    [
        (PipelineSplit(3, 2), "--num-layers 3"),
        (PipelineSplit(4, 2, 4), "virtual stages"),
        (PipelineSplit(5, 3, num_layers_in_first_pipeline_stage=2), "split them evenly"),
        (PipelineSplit(4, 1, num_layers_in_first_pipeline_stage=2), "need"),
        (
            PipelineSplit(
                4, 2, num_layers_in_first_pipeline_stage=2, account_for_loss_in_pipeline_split=True
            ),
            "cannot be combined",
        ),
    ],
)
def test_bad_splits_name_the_flag(split, flag):
    with pytest.raises(ValueError, match=flag):
        split.check()
