"""The all-to-all dispatcher's uneven collectives over the expert tensor-parallel group:
`gather_uneven` and `reduce_scatter_uneven`, forward values and gradients against the same
computed from every rank's whole tensors (which each rank rebuilds from the seeds). Runs on the
4-rank pool as two groups of 2 ranks, with different part sizes per group, one of them empty."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.moe.token_dispatcher import gather_uneven, reduce_scatter_uneven
from tests.unit_tests.distributed_harness import run_distributed

WORLD, HIDDEN = 4, 3
SIZES = ([3, 0], [2, 5])  # rows of each rank's part, per group of 2 ranks


def _tensor(rows: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HIDDEN, generator=generator).to(dtype)


def _check(dtype: torch.dtype) -> None:
    rank = dist.get_rank()
    groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    group, sizes = groups[rank // 2], SIZES[rank // 2]
    me, total = group.rank(), sum(sizes)
    first = [sum(sizes[:r]) for r in range(len(sizes))]
    seeds = [rank - me + r for r in range(len(sizes))]  # the global ranks of the group

    # Gather: rank r holds part r; each rank's output gradient is its own.
    parts = [_tensor(n, seed, dtype) for n, seed in zip(sizes, seeds)]
    grads = [_tensor(total, 10 + seed, dtype) for seed in seeds]
    x = parts[me].clone().requires_grad_()
    gathered = gather_uneven(x, group, sizes)
    assert torch.equal(gathered, torch.cat(parts))
    gathered.backward(grads[me])
    expected = sum(g.float() for g in grads).narrow(0, first[me], sizes[me]).to(dtype)
    torch.testing.assert_close(x.grad, expected)

    # Reduce-scatter: every rank holds an addend of the whole; the sum is taken in fp32.
    addends = [_tensor(total, 20 + seed, dtype) for seed in seeds]
    grads = [_tensor(n, 30 + seed, dtype) for n, seed in zip(sizes, seeds)]
    y = addends[me].clone().requires_grad_()
    reduced = reduce_scatter_uneven(y, group, sizes)
    expected = sum(a.float() for a in addends).narrow(0, first[me], sizes[me]).to(dtype)
    assert reduced.dtype == dtype
    torch.testing.assert_close(reduced, expected, rtol=0, atol=0)
    reduced.backward(grads[me])
    assert torch.equal(y.grad, torch.cat(grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uneven_gather_and_reduce_scatter_match_the_whole(dtype):
    run_distributed(_check, WORLD, dtype)
