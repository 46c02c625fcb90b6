"""Flat buffers (`ShardLayout`, `DBuffer`), strategies and `FSDPDistributedIndex`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp import FSDPDistributedIndex, ShardingStrategy
from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import (
    DBuffer,
    ShardLayout,
    chunk_targets,
    copy_chunks_in,
    copy_chunks_out,
)
from megatron.core.distributed.fsdp.strategy import ShardingPolicy
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.distributed_harness import current_device, run_distributed

SHAPES = [torch.Size((7, 15)), torch.Size((3,)), torch.Size((4, 2)), torch.Size((1, 5))]


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_layout_chunks_like_torch_chunk_and_round_trips(num_shards):
    layout = ShardLayout(SHAPES, num_shards)
    tensors = _tensors()
    assert layout.numel == num_shards * layout.shard_numel
    gathered = DBuffer(layout, torch.float32, torch.device("cpu"), sharded=False, rank=0)
    copy_chunks_in(tensors, gathered.full, layout)
    for i, tensor in enumerate(tensors):
        pieces = []
        for shard in range(num_shards):
            start, end = layout.shard_range(shard)
            view = layout.local_views(gathered.full[start:end], shard)[i]
            expected = dict(enumerate(torch.chunk(tensor, num_shards)))
            reference = expected.get(shard, tensor[:0])
            assert view.shape == reference.shape == layout.local_shape(i, shard)
            pieces.append(view)
        assert torch.equal(torch.cat(pieces), tensor)
    unsharded = DBuffer(
        layout.unsharded(), torch.float32, torch.device("cpu"), sharded=False, rank=0
    )
    copy_chunks_out(gathered, unsharded)
    for view, tensor in zip(unsharded.tensor_views(), tensors):
        assert torch.equal(view[: tensor.shape[0]], tensor)
    # Padding reads as zero, so reductions over it are harmless: clearing the real rows
    # leaves nothing.
    for shard in range(num_shards):
        start, end = layout.shard_range(shard)
        for view in layout.local_views(gathered.full[start:end], shard):
            view.zero_()
    assert gathered.full.count_nonzero() == 0


@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_packing_lays_out_each_tensors_chunks_by_shard_and_zeroes_the_padding(num_shards):
    # Whatever the dtypes, strides and shapes (chunks that split evenly, a short last chunk,
    # fewer rows than shards, no elements), a packed buffer must equal chunking each tensor
    # and laying the chunks out by shard, cast, with zeros where a chunk is short (the buffer
    # starts as NaN).
    even = [torch.Size((8, 3)), torch.Size((4,)), torch.Size((num_shards, 5))]
    odd = [*SHAPES, torch.Size((num_shards - 1, 4)), torch.Size((0, 3)), torch.Size((5, 0))]
    generator = torch.Generator().manual_seed(1)
    cases = {
        "same dtype": ([torch.randn(s, generator=generator) for s in even], torch.float32),
        "cast": ([torch.randn(s, generator=generator) for s in even], torch.float64),
        "strided": ([torch.randn(s[::-1], generator=generator).t() for s in even], torch.float32),
        "short chunks, cast": ([torch.randn(s, generator=generator) for s in odd], torch.float64),
    }
    for name, (tensors, dtype) in cases.items():
        layout = ShardLayout([t.shape for t in tensors], num_shards)
        expected = torch.zeros(num_shards, layout.shard_numel, dtype=dtype)
        for i, tensor in enumerate(tensors):
            for shard, chunk in enumerate(torch.chunk(tensor, num_shards)):
                start = layout.offsets[i]
                expected[shard, start : start + chunk.numel()] = chunk.reshape(-1).to(dtype)
        out = torch.full((layout.numel,), float("nan"), dtype=dtype)
        copy_chunks_in(tensors, out, layout)
        assert torch.equal(out.view(num_shards, -1), expected), name


def test_layout_rejects_0_dim_tensors():
    with pytest.raises(ValueError, match="shape \\(1,\\)"):
        ShardLayout([torch.Size(())], 2)


def test_sharded_buffer_has_no_full_view():
    layout = ShardLayout(SHAPES, 2)
    buffer = DBuffer(layout, torch.float32, torch.device("cpu"), sharded=True, rank=1)
    assert buffer.shard.numel() == layout.shard_numel
    with pytest.raises(RuntimeError, match="all-gather"):
        _ = buffer.full


def test_chunk_targets_refill_saved_weights_without_bumping_their_versions():
    """Releasing and reallocating keep the views autograd saved valid, and the engine gathers
    weights into `chunk_targets` made once: a refill after a free must restore what autograd
    saved without reading as an in-place modification."""
    layout = ShardLayout(SHAPES, 2)
    buffer = DBuffer(layout.unsharded(), torch.float32, torch.device("cpu"), sharded=False, rank=0)
    targets = chunk_targets(buffer, layout)
    weights = [
        torch.nn.Parameter(view[: shape[0]]) for view, shape in zip(buffer.tensor_views(), SHAPES)
    ]
    values = _tensors(2)

    def refill():
        for target, value, rows in zip(targets, values, layout.chunk_rows):
            padded = torch.zeros(layout.num_shards * rows, *value.shape[1:])
            padded[: value.shape[0]] = value
            target.copy_(padded.view_as(target))

    refill()
    versions = [buffer.data._version, *(weight._version for weight in weights)]
    x = torch.randn(15, requires_grad=True)
    y = (weights[0] @ x).sum()  # saves weights[0] for x's gradient
    buffer.free_storage()
    assert not buffer.is_allocated and buffer.data.untyped_storage().nbytes() == 0
    buffer.reallocate_storage()
    refill()
    assert [buffer.data._version, *(weight._version for weight in weights)] == versions
    for weight, value in zip(weights, values):
        torch.testing.assert_close(weight.detach(), value)
    y.backward()
    torch.testing.assert_close(x.grad, values[0].sum(0))


def _collectives() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    comm = Collectives()
    layout = ShardLayout(SHAPES, world_size)
    device = current_device()
    shard = DBuffer(layout, torch.float32, device, sharded=True, rank=rank)
    full = _tensors()
    for view, tensor in zip(shard.local_views(), full):
        view.copy_(torch.chunk(tensor, world_size)[rank] if view.numel() else view)
    gathered = DBuffer(layout, torch.float32, device, sharded=False, rank=rank)
    pointer = gathered.data.data_ptr()
    comm.all_gather(gathered.full, shard.shard, group)
    unsharded = DBuffer(layout.unsharded(), torch.float32, device, sharded=False, rank=0)
    copy_chunks_out(gathered, unsharded)
    gathered_ok = all(
        torch.equal(v[: t.shape[0]].cpu(), t) for v, t in zip(unsharded.tensor_views(), full)
    )
    # Weights skip the gathered buffer: each tensor's chunks go straight into the tensor.
    direct = DBuffer(layout.unsharded(), torch.float32, device, sharded=False, rank=0)
    outputs = [target.view(-1) for target in chunk_targets(direct, layout)]
    inputs = list(shard.shard.split(layout.chunk_numels))
    comm.all_gather_tensors(outputs, inputs, group)
    gathered_tensorwise_ok = all(
        torch.equal(v[: t.shape[0]].cpu(), t) for v, t in zip(direct.tensor_views(), full)
    )
    # Cast on the way (fp32 shards into bf16 weights), this rank's blocks given by the caller.
    cast = DBuffer(layout.unsharded(), torch.bfloat16, device, sharded=False, rank=0)
    targets = chunk_targets(cast, layout)
    comm.all_gather_tensors(
        [target.view(-1) for target in targets],
        inputs,
        group,
        own_blocks=[target[rank] for target in targets],
    )
    gathered_tensorwise_ok &= all(
        torch.equal(v[: t.shape[0]].cpu(), t.bfloat16()) for v, t in zip(cast.tensor_views(), full)
    )
    # The caller has written its blocks already (one launch on CUDA, `SegmentCopy`): the
    # collective gathers what they hold, copying nothing into them.
    in_place = DBuffer(layout.unsharded(), torch.float32, device, sharded=False, rank=0)
    targets = chunk_targets(in_place, layout)
    for target, chunk in zip(targets, inputs):
        target[rank].copy_(chunk)
    comm.all_gather_tensors(
        [target.view(-1) for target in targets],
        [torch.full_like(chunk, float("nan")) for chunk in inputs],  # not read
        group,
        inputs_in_place=True,
    )
    gathered_tensorwise_ok &= all(
        torch.equal(v[: t.shape[0]].cpu(), t) for v, t in zip(in_place.tensor_views(), full)
    )
    # Each rank contributes (rank + 1) * tensor; the average is (N + 1) / 2 * tensor.
    contribution = DBuffer(layout, torch.float32, device, sharded=False, rank=rank)
    copy_chunks_in([(rank + 1) * t.to(device) for t in full], contribution.full, layout)
    out = torch.empty(layout.shard_numel, device=device)
    comm.reduce_scatter(out, contribution.full, group, average=True)
    scale = (world_size + 1) / 2
    expected = [
        scale * torch.chunk(t, world_size)[rank]
        for t in full
        if rank < len(torch.chunk(t, world_size))
    ]
    reduced = [v.cpu() for v in layout.local_views(out, rank) if v.numel()]
    # Gradients skip the packing: each whole (padded) tensor is reduce-scattered into its
    # chunk of this rank's shard.
    padded = DBuffer(layout.unsharded(), torch.float32, device, sharded=False, rank=0)
    for view, tensor in zip(padded.tensor_views(), full):
        view.zero_()[: tensor.shape[0]].copy_((rank + 1) * tensor)
    tensorwise = torch.empty(layout.shard_numel, device=device)
    comm.reduce_scatter_tensors(
        list(tensorwise.split(layout.chunk_numels)),
        [view.view(-1) for view in padded.tensor_views()],
        group,
        average=True,
    )
    reduced_tensorwise = [v.cpu() for v in layout.local_views(tensorwise, rank) if v.numel()]
    comm.all_reduce(contribution.data, group, average=False)
    total = world_size * (world_size + 1) / 2
    return dict(
        same_storage=gathered.data.data_ptr() == pointer,
        gathered_ok=gathered_ok,
        gathered_tensorwise_ok=gathered_tensorwise_ok,
        reduce_scatter_ok=all(torch.allclose(a, b) for a, b in zip(reduced, expected))
        and len(reduced) == len(expected),
        reduce_scatter_tensorwise_ok=all(
            torch.allclose(a, b) for a, b in zip(reduced_tensorwise, expected)
        )
        and len(reduced_tensorwise) == len(expected),
        all_reduce_ok=torch.allclose(
            contribution.full.cpu().sum(), total * sum(t.sum() for t in full)
        ),
    )


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_collectives_into_preallocated_buffers(world_size):
    for r in run_distributed(_collectives, world_size):
        assert r == dict(
            same_storage=True,
            gathered_ok=True,
            gathered_tensorwise_ok=True,
            reduce_scatter_ok=True,
            reduce_scatter_tensorwise_ok=True,
            all_reduce_ok=True,
        )


def _accumulated_over_one_rank(divisor: int) -> dict:
    """`reduce_scatter_tensors(accumulate=True)` over one rank against plain torch: the
    average of the inputs added to the outputs (as a copy-then-average reduction added would
    be), bit for bit, and refused over a group of several ranks."""
    world = dist.group.WORLD
    # Every rank makes every group (`new_group`'s contract), then keeps its own.
    singles = [dist.new_group([rank]) for rank in range(world.size())] if world.size() > 1 else []
    one = singles[dist.get_rank()] if singles else world
    generator = torch.Generator().manual_seed(dist.get_rank())
    outputs = [torch.randn(n, generator=generator) for n in (5, 3)]
    inputs = [torch.randn(n, generator=generator) for n in (5, 3)]
    expected = []
    for output, send in zip(outputs, inputs):
        reduced = send.clone()
        torch._foreach_div_([reduced], divisor)
        expected.append(output + reduced)
    result = {}
    if world.size() > 1:
        try:
            Collectives().reduce_scatter_tensors(
                outputs, inputs, world, average=True, accumulate=True
            )
        except ValueError as error:
            result["refused"] = str(error)
    Collectives().reduce_scatter_tensors(
        outputs, inputs, one, average=True, divisor=divisor, accumulate=True
    )
    result["equal"] = all(torch.equal(a, b) for a, b in zip(outputs, expected))
    for group in singles:
        dist.destroy_process_group(group)
    return result


def test_accumulating_over_one_rank_adds_the_averaged_inputs():
    assert run_distributed(_accumulated_over_one_rank, 1, 3) == [{"equal": True}]
    for result in run_distributed(_accumulated_over_one_rank, 2, 2):
        assert result["equal"]
        assert "one rank only" in result["refused"] and "2 ranks" in result["refused"]


def _fp16_averages(divisor: int | None) -> list[float]:
    """Averages of fp16 values whose sum over the ranks overflows fp16 (max 65504)."""
    group, comm = dist.group.WORLD, Collectives()
    size = group.size()
    values = [torch.full((2 * size,), 40000.0, dtype=torch.float16) for _ in range(3)]
    outputs = [torch.empty(2, dtype=torch.float16) for _ in range(2)]
    comm.reduce_scatter_tensors(outputs[:1], values[:1], group, average=True, divisor=divisor)
    comm.reduce_scatter(outputs[1], values[1], group, average=True, divisor=divisor)
    comm.all_reduce(values[2], group, average=True, divisor=divisor)
    return [tensor.float().max().item() for tensor in (*outputs, values[2])]


@pytest.mark.parametrize("divisor", [None, 4], ids=["group-size", "larger"])
def test_fp16_averages_do_not_overflow_where_the_sum_would(divisor):
    """gloo sums (it has no average), as NCCL does for a divisor other than the group's size
    (expert gradients): fp16 inputs are divided first."""
    expected = 40000.0 * 2 / (divisor or 2)
    assert run_distributed(_fp16_averages, 2, divisor) == [[expected] * 3] * 2


def test_strategy_flags_and_errors():
    zero3 = ShardingStrategy("optim_grads_params")
    assert (zero3.shards_optimizer, zero3.shards_grads, zero3.shards_params) == (True,) * 3
    zero1 = ShardingStrategy("optim")
    assert (zero1.shards_optimizer, zero1.shards_grads, zero1.shards_params) == (
        True,
        False,
        False,
    )
    with pytest.raises(ValueError, match="'zero3' does not exist"):
        ShardingStrategy("zero3")
    with pytest.raises(ValueError, match="outer_dp_sharding_strategy='replicate' does not"):
        ShardingPolicy("optim_grads_params", "replicate")
    with pytest.raises(ValueError, match="requires data_parallel_sharding_strategy"):
        ShardingPolicy("optim_grads", "optim")
    with pytest.raises(ValueError, match="num_distributed_optimizer_instances > 1"):
        ShardingPolicy("optim_grads_params", "optim").check_outer_group(1)


def _index_groups() -> dict:
    world = dist.group.WORLD
    ranks = list(range(dist.get_world_size()))
    ep = dist.new_group(ranks)
    singles = [dist.new_group([rank]) for rank in ranks]
    expert = singles[dist.get_rank()]
    other_ranks = dist.new_group(ranks[:1])
    index = FSDPDistributedIndex(world, expert_shard_group=expert, expert_model_parallel_group=ep)
    without_ep = FSDPDistributedIndex(world, expert_shard_group=world)
    errors = []
    try:
        FSDPDistributedIndex(world, all_gather_group=other_ranks)
    except ValueError as error:
        errors.append(str(error))
    try:
        FSDPDistributedIndex(world, expert_model_parallel_group=ep).groups(is_expert=True)
    except ValueError as error:
        errors.append(str(error))
    no_expert = FSDPDistributedIndex.from_pg_collection(ProcessGroupCollection(dp_cp=world))
    return dict(
        dense_is_world=index.groups(False).shard is world,
        expert_is_expert=index.groups(True).shard is expert,
        # Experts split over ep divide by the dense dp x cp size, not their shard group's.
        expert_divisor=index.groups(True).grad_divisor == len(ranks),
        experts_without_ep_are_dense=without_ep.groups(True) is without_ep.groups(False),
        all_gather_defaults_to_shard=index.groups(False).all_gather is world,
        cached=index.groups(False) is index.groups(False),
        outer_none=no_expert.outer_group is None,
        errors=errors,
    )


def test_distributed_index_picks_groups_once_and_checks_them():
    r = run_distributed(_index_groups, 2)[0]
    errors = r.pop("errors")
    assert all(r.values()), r
    assert "must be the same ranks" in errors[0]
    assert "no expert shard group" in errors[1]
