"""The tp-region mappings on gloo ranks: each forward and backward against what the collective
means (per-rank inputs and gradients differ, so sums and orders are visible), the identity
without a group, `grad_sum_over_tp`, and the error for a sequence not divisible by T."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    grad_sum_over_tp,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from tests.unit_tests.distributed_harness import run_distributed


def _per_rank(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """One tensor per rank, the same list on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(dist.get_world_size())]


def _run(fn, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = fn(x, dist.group.WORLD)
    y.backward(grad)
    return y.detach(), x.grad


def _check_mappings() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    close = torch.testing.assert_close
    inputs = _per_rank((4 * world, 3, 2 * world), seed=0)
    grads = _per_rank((4 * world, 3, 2 * world), seed=1)
    x, g = inputs[rank], grads[rank]

    y, dx = _run(copy_to_tensor_model_parallel_region, x, g)
    close(y, x)
    close(dx, sum(grads))

    y, dx = _run(reduce_from_tensor_model_parallel_region, x, g)
    close(y, sum(inputs))
    close(dx, g)

    # Split the last dim of a replicated tensor; the gradient is gathered back.
    parts = [grad.chunk(world, -1)[rank] for grad in grads]
    y, dx = _run(scatter_to_tensor_model_parallel_region, inputs[0], parts[rank])
    close(y, inputs[0].chunk(world, -1)[rank])
    close(dx, torch.cat([grads[r].chunk(world, -1)[r] for r in range(world)], -1))

    wide_grad = torch.cat(grads, -1)
    y, dx = _run(gather_from_tensor_model_parallel_region, x, wide_grad)
    close(y, torch.cat(inputs, -1))
    close(dx, wide_grad.chunk(world, -1)[rank])

    y, dx = _run(scatter_to_sequence_parallel_region, inputs[0], g.chunk(world, 0)[rank])
    close(y, inputs[0].chunk(world, 0)[rank])
    close(dx, torch.cat([grads[r].chunk(world, 0)[r] for r in range(world)], 0))

    gathered = torch.cat(inputs, 0)
    big_grads = _per_rank(gathered.shape, seed=2)
    y, dx = _run(gather_from_sequence_parallel_region, x, big_grads[rank])
    close(y, gathered)
    close(dx, sum(big_grads).chunk(world, 0)[rank])  # reduce-scatter: a tp region follows

    def gather_replicated(t, group):
        return gather_from_sequence_parallel_region(t, group, tensor_parallel_output_grad=False)

    y, dx = _run(gather_replicated, x, big_grads[rank])
    close(dx, big_grads[rank].chunk(world, 0)[rank])

    y, dx = _run(reduce_scatter_to_sequence_parallel_region, x, grads[rank][:4])
    close(y, sum(inputs).chunk(world, 0)[rank])
    close(dx, torch.cat([grads[r][:4] for r in range(world)], 0))

    # grad_sum_over_tp: a replicated parameter on different data per rank.
    param = torch.nn.Parameter(torch.ones(2 * world))
    used = grad_sum_over_tp(param, dist.group.WORLD)
    close(used, param.detach())
    (used * x).sum().backward()
    close(param.grad, sum(inputs).sum(dim=(0, 1)))

    with pytest.raises(ValueError, match="multiple of tensor_model_parallel_size"):
        scatter_to_sequence_parallel_region(torch.ones(world + 1, 2), dist.group.WORLD)


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_forward_and_backward(world):
    run_distributed(_check_mappings, world)


def test_no_group_is_the_identity():
    x = torch.randn(4, 3, requires_grad=True)
    for fn in (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        scatter_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
        grad_sum_over_tp,
    ):
        assert fn(x, None) is x
