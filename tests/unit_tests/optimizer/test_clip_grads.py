"""The global gradient norm over sharded gradients equals the unsharded one, for every
Megatron-FSDP strategy (hybrid ones included) and the DDP engine; clipping reaches `clip_grad`;
a non-finite gradient skips the step on every rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES
from megatron.core.distributed.fsdp import (
    FSDPDistributedIndex,
    fully_shard,
)
from megatron.core.optimizer import (
    OptimizerConfig,
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    get_megatron_optimizer,
)
from tests.unit_tests.distributed.fsdp.fsdp_training import (
    build_model,
    full_state,
    hybrid_groups,
    loss_of,
    make_batches,
    unit_modules,
)
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import build_tiny_gpt, shard_batch, wrap_for_engine


def _local_loss(model: torch.nn.Module, kind: str) -> torch.Tensor:
    """This rank's loss on its slice of the first global batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, labels = make_batches(kind)[0]
    inputs, labels = shard_batch(inputs, rank, world_size), shard_batch(labels, rank, world_size)
    return loss_of(model, inputs, labels, bf16=False)


def _norm_zeros_and_clipped(grads: list[torch.Tensor]) -> tuple[float, int, float, float]:
    norm = get_grad_norm_fp32(grads)
    zeros = count_zeros_fp32(grads)
    max_norm = norm / 3
    clip_grad_by_total_norm_fp32(grads, max_norm, norm)
    return norm, zeros, get_grad_norm_fp32(grads), max_norm


def _fsdp_grad_stats(kind: str, strategy: str, outer: str, num_replicas: int):
    with hybrid_groups(num_replicas) as index:
        model = build_model(kind, bf16=False)
        for module in [*unit_modules(model), model]:
            fully_shard(module, index, sharding_strategy=strategy, outer_dp_sharding_strategy=outer)
        _local_loss(model, kind).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        placements = {tuple(g.placements) for g in grads}
        gathered_zeros = sum(int((g.full_tensor() == 0).sum()) for g in grads)
        return (*_norm_zeros_and_clipped(grads), gathered_zeros, placements)


def _ddp_grad_stats(kind: str):
    model = build_model(kind, bf16=False)
    config = getattr(model, "config", None)  # UnevenNet has no TransformerConfig
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    _local_loss(ddp, kind).backward()
    ddp.finish_grad_sync()
    grads = [p.main_grad for p in model.parameters()]
    local_zeros = sum(int((g == 0).sum()) for g in grads)
    return (*_norm_zeros_and_clipped(grads), local_zeros)


def _reference_norm(kind: str) -> float:
    """Norm of the whole batch's gradient in one process, without sharding."""
    model = build_model(kind, bf16=False)
    inputs, labels = make_batches(kind)[0]
    loss_of(model, inputs.to(current_device()), labels.to(current_device()), False).backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    return torch.linalg.vector_norm(flat).item()


def _check(results, kind: str) -> None:
    expected_norm = _reference_norm(kind)
    for norm, zeros, clipped, max_norm, expected_zeros, *_ in results:
        assert norm == pytest.approx(expected_norm, rel=1e-5)
        # Against the gathered gradient: the reference's can differ where sums cancel exactly.
        assert zeros == expected_zeros
        assert clipped == pytest.approx(max_norm, rel=1e-5)


@pytest.mark.parametrize("kind", ["gpt", "uneven"])
@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_fsdp_norm_matches_unsharded(strategy, kind):
    results = run_distributed(_fsdp_grad_stats, 2, kind, strategy, "no_shard", 1)
    _check(results, kind)
    assert results[0][0] == results[1][0], "ranks disagree on the norm"


# (strategy, outer strategy, replicas) -> the placements of every gradient: what is summed over.
WORLD_SIZE_4_CASES = {
    "zero3-4": ("optim_grads_params", "no_shard", 1, (Shard(0),)),
    "hsdp-no_shard": ("no_shard", "no_shard", 2, (Replicate(), Replicate())),
    "hsdp-optim": ("optim", "no_shard", 2, (Shard(0), Replicate())),
    "hsdp-optim_grads": ("optim_grads", "no_shard", 2, (Shard(0), Replicate())),
    "hsdp-optim_grads_params": ("optim_grads_params", "no_shard", 2, (Shard(0), Replicate())),
    "hfsdp": ("optim_grads_params", "optim", 2, (Shard(0), Shard(0))),
}


@pytest.mark.parametrize("case", WORLD_SIZE_4_CASES)
def test_fsdp_norm_matches_unsharded_at_world_size_4(case):
    strategy, outer, num_replicas, placements = WORLD_SIZE_4_CASES[case]
    # The uneven model's head has 3 rows: some ranks hold empty shards.
    results = run_distributed(_fsdp_grad_stats, 4, "uneven", strategy, outer, num_replicas)
    _check(results, "uneven")
    assert set.union(*(r[-1] for r in results)) == {placements}


class _WithExperts(torch.nn.Module):
    """A dense layer and an `experts` module (expert parameters by name)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(6, 5)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x))
        return sum(expert(h) for expert in self.experts).pow(2).mean()


def _expert_grad_norm(strategy: str) -> tuple[float, float]:
    """(norm over the sharded gradients, norm of the whole batch's gradient in one process)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = current_device()
    inputs = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)).to(device)
    reference = _WithExperts().to(device)
    reference(inputs).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    # Same ranks, another communicator, as expt_dp is when expert parallelism is 1: unused,
    # since experts not split over an ep group are dense parameters.
    expert_group = dist.new_group(list(range(world_size)))
    try:
        index = FSDPDistributedIndex(dist.group.WORLD, expert_shard_group=expert_group)
        model = fully_shard(_WithExperts().to(device), index, sharding_strategy=strategy)
        model(shard_batch(inputs, rank, world_size)).backward()
        meshes = {p.grad.device_mesh.get_group(0) for p in model.parameters()}
        assert len(meshes) == 1, "experts without expert parallelism should be dense"
        return get_grad_norm_fp32([p.grad for p in model.parameters()]), expected.item()
    finally:
        dist.destroy_process_group(expert_group)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_experts_without_expert_parallelism_are_counted_once(strategy):
    for norm, expected in run_distributed(_expert_grad_norm, 2, strategy):
        assert norm == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("kind", ["gpt", "uneven"])
def test_ddp_norm_matches_unsharded(kind):
    _check(run_distributed(_ddp_grad_stats, 2, kind), kind)


def test_plain_tensors_match_torch_and_clip_only_above_max_norm():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]
    expected = torch.nn.utils.get_total_norm(grads).item()
    assert get_grad_norm_fp32(grads) == pytest.approx(expected, rel=1e-6)
    assert get_grad_norm_fp32(g.bfloat16() for g in grads) == pytest.approx(expected, rel=1e-2)
    assert get_grad_norm_fp32([]) == 0.0

    before = [g.clone() for g in grads]
    clip_grad_by_total_norm_fp32(grads, 2 * expected, expected)
    torch.testing.assert_close(grads, before)
    clip_grad_by_total_norm_fp32(grads, expected / 4, expected)
    assert get_grad_norm_fp32(grads) == pytest.approx(expected / 4, rel=1e-5)

    grads[1][2] = float("nan")
    assert math.isnan(get_grad_norm_fp32(grads))
    grads[1][2] = float("inf")
    assert get_grad_norm_fp32(grads) == math.inf


def _step_with_non_finite_grad(engine: str, bad: float, clip_grad: float):
    """Rank 0's loss is non-finite; the reduction spreads it, so every rank must skip (with
    clipping off too: the norm is still taken)."""
    model = build_tiny_gpt()
    wrapper = wrap_for_engine(model, engine)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1, clip_grad=clip_grad), wrapper)
    before = full_state(model)
    loss = _local_loss(wrapper, "gpt")
    if dist.get_rank() == 0:
        loss = loss * bad
    loss.backward()
    wrapper.finish_grad_sync()
    update_successful, grad_norm, _ = optimizer.step()
    after = full_state(model)
    unchanged = all(torch.equal(before[name], after[name]) for name in before)
    return update_successful, grad_norm, unchanged


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize(
    "engine, clip_grad",
    [("ddp", 1.0), ("no_shard", 1.0), ("optim_grads_params", 1.0), ("optim_grads_params", 0.0)],
)
def test_non_finite_grad_skips_step_on_every_rank(engine, clip_grad, bad):
    for update_successful, grad_norm, unchanged in run_distributed(
        _step_with_non_finite_grad, 2, engine, bad, clip_grad
    ):
        assert not update_successful
        assert not math.isfinite(grad_norm)
        assert unchanged


def _norm_groups_follow_each_mesh() -> tuple[bool, bool, bool, bool]:
    """Two meshes over the same ranks (equal as `DeviceMesh`es) on distinct groups: the norm's
    reduction uses each mesh's own group, and a mesh's cached groups go with it."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    from megatron.core.optimizer import clip_grads

    ranks = list(range(dist.get_world_size()))
    device = current_device().type
    first = DeviceMesh.from_group(dist.new_group(ranks), device)
    second = DeviceMesh.from_group(dist.new_group(ranks), device)
    placements = (Shard(0),)
    first_groups = clip_grads._shard_groups(first, placements)
    second_groups = clip_grads._shard_groups(second, placements)
    key = id(second)
    cached = key in clip_grads._GROUPS_OF_MESH
    del second
    gc.collect()
    return (
        first_groups == (first.get_group(0),),
        second_groups[0] is not first_groups[0],
        cached,
        key not in clip_grads._GROUPS_OF_MESH,
    )


def test_norm_groups_are_cached_per_mesh_not_per_equal_mesh():
    for checks in run_distributed(_norm_groups_follow_each_mesh, 2):
        assert checks == (True, True, True, True)
