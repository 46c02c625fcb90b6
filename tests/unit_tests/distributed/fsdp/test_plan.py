"""`GroupPlan`: the reductions finalising a step runs, chosen once per group."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron.core.distributed.fsdp.mixed_precision import ResolvedPrecision
from megatron.core.distributed.fsdp.plan import GroupPlan, InnerReduction, OuterReduction
from megatron.core.distributed.fsdp.strategy import ShardingPolicy


def _plan(
    name: str,
    outer: str = "no_shard",
    *,
    shard_size: int = 2,
    outer_group=None,
    grad_comm: torch.dtype = torch.float32,
    grad_divisor: int = 0,
    average_grads: bool = True,
):
    # GroupPlan.make reads only these of the groups: the shard group's size, whether an outer
    # group exists, and how gradient reductions average.
    groups = SimpleNamespace(
        shard_size=shard_size,
        outer=outer_group,
        grad_divisor=grad_divisor,
        average_grads=average_grads,
    )
    return GroupPlan.make(
        ShardingPolicy(name, outer),
        ResolvedPrecision(torch.float32, torch.float32, grad_comm),
        groups,
        model_dtype=torch.float32,
        requires_grad=True,
    )


def test_finalising_reduces_what_the_strategy_left_unreduced():
    """ZeRO-2/3 reduce in each backward, ZeRO-1 reduce-scatters the local sums, no sharding
    (or a shard group of one) all-reduces them; the outer group all-reduces (HSDP) or
    reduce-scatters (HFSDP)."""
    inner, outer = InnerReduction, OuterReduction
    replicas = object()  # an outer group
    cases = [
        (_plan("no_shard"), inner.ALL_REDUCE, outer.NONE),
        (_plan("optim"), inner.REDUCE_SCATTER, outer.NONE),
        (_plan("optim", shard_size=1), inner.ALL_REDUCE, outer.NONE),
        (_plan("optim_grads"), inner.DONE, outer.NONE),
        (_plan("optim_grads_params"), inner.DONE, outer.NONE),
        (_plan("no_shard", outer_group=replicas), inner.ALL_REDUCE, outer.ALL_REDUCE),
        (_plan("optim", outer_group=replicas), inner.REDUCE_SCATTER, outer.ALL_REDUCE),
        (_plan("optim_grads_params", outer_group=replicas), inner.DONE, outer.ALL_REDUCE),
        (
            _plan("optim_grads_params", "optim", outer_group=replicas),
            inner.DONE,
            outer.REDUCE_SCATTER,
        ),
    ]
    for index, (plan, inner_reduction, outer_reduction) in enumerate(cases):
        assert (plan.inner_reduction, plan.outer_reduction) == (
            inner_reduction,
            outer_reduction,
        ), index


def test_gradients_skip_a_reduction_that_would_only_copy():
    """Sharded gradients over one rank with no cast go straight into `main_grad`, also where
    they are averaged over more ranks (expert gradients: divided there); a reduction dtype of
    its own, more than one rank, or unsharded gradients keep the reduction."""
    cases = [
        (_plan("optim_grads_params", shard_size=1), True),
        (_plan("optim_grads", shard_size=1), True),
        (_plan("optim_grads_params", shard_size=1, grad_divisor=1), True),
        (_plan("optim_grads_params", shard_size=1, grad_divisor=2, average_grads=False), True),
        (_plan("optim_grads_params", "optim", shard_size=1, outer_group=object()), True),
        (_plan("optim_grads_params", shard_size=1, grad_divisor=2), True),
        (_plan("optim_grads_params", shard_size=1, grad_comm=torch.bfloat16), False),
        (_plan("optim_grads_params"), False),
        (_plan("optim", shard_size=1), False),
        (_plan("no_shard", shard_size=1), False),
    ]
    for index, (plan, direct) in enumerate(cases):
        assert plan.direct_grads is direct, index
