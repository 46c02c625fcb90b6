"""The sequence-parallel gather and reduce-scatter with parts of different sizes per rank
(`output_split_sizes` / `input_split_sizes`, as the MoE all-to-all dispatcher uses them over the
expert tensor-parallel group): forward values and gradients, in fp32 and bf16, against the same
computed from every rank's whole tensors (which each rank rebuilds from the seeds). Runs on the
4-rank pool as two groups of 2 ranks with different sizes per group, one part empty, and as
one group of 4. Also: equal sizes give what the even path (sizes None) gives, and sizes that
do not fit raise on every rank."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from tests.unit_tests.distributed_harness import run_distributed

WORLD, HIDDEN = 4, 3
PAIR_SIZES = ([3, 0], [2, 5])  # rows of each rank's part, per group of 2 ranks
WORLD_SIZES = [2, 0, 3, 1]


def _tensor(rows: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HIDDEN, generator=generator).to(dtype)


def _gather(x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int] | None, tp_grad: bool):
    return gather_from_sequence_parallel_region(
        x, group, tensor_parallel_output_grad=tp_grad, output_split_sizes=sizes
    )


def _run(fn, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _check_group(group: dist.ProcessGroup, sizes: list[int], dtype: torch.dtype) -> None:
    """Every rank of `group` checks its own results; seeds are the group's global ranks."""
    me, total = group.rank(), sum(sizes)
    first = [sum(sizes[:r]) for r in range(len(sizes))]
    seeds = [dist.get_global_rank(group, r) for r in range(len(sizes))]

    def mine(whole: torch.Tensor) -> torch.Tensor:
        return whole.narrow(0, first[me], sizes[me])

    # Gather: rank r holds part r; each rank's output gradient is its own.
    parts = [_tensor(n, seed, dtype) for n, seed in zip(sizes, seeds)]
    grads = [_tensor(total, 10 + seed, dtype) for seed in seeds]
    gathered, dx = _run(lambda t: _gather(t, group, sizes, True), parts[me], grads[me])
    assert torch.equal(gathered, torch.cat(parts))
    # A tp region follows: the partial gradients are summed in fp32.
    assert torch.equal(dx, mine(sum(g.float() for g in grads)).to(dtype))
    gathered, dx = _run(lambda t: _gather(t, group, sizes, False), parts[me], grads[me])
    assert torch.equal(gathered, torch.cat(parts))
    assert torch.equal(dx, mine(grads[me]))  # a replicated consumer: this rank's rows only

    # Reduce-scatter: every rank holds an addend of the whole; the sum is taken in fp32.
    addends = [_tensor(total, 20 + seed, dtype) for seed in seeds]
    grads = [_tensor(n, 30 + seed, dtype) for n, seed in zip(sizes, seeds)]

    def reduce_scatter(t: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sequence_parallel_region(t, group, input_split_sizes=sizes)

    reduced, dy = _run(reduce_scatter, addends[me], grads[me])
    assert reduced.dtype == dtype
    assert torch.equal(reduced, mine(sum(a.float() for a in addends)).to(dtype))
    assert torch.equal(dy, torch.cat(grads))


def _check_equal_sizes_match_the_even_path(group: dist.ProcessGroup, dtype: torch.dtype) -> None:
    """On a group of 2 (where the order of a sum does not matter) sizes all equal give exactly
    the even collectives' values and gradients."""
    seed, ranks = dist.get_rank(), group.size()
    x, whole = _tensor(2, seed, dtype), _tensor(2 * ranks, 40 + seed, dtype)
    equal = [2] * ranks
    for tp_grad in (True, False):
        even = _run(partial(_gather, group=group, sizes=None, tp_grad=tp_grad), x, whole)
        split = _run(partial(_gather, group=group, sizes=equal, tp_grad=tp_grad), x, whole)
        assert all(torch.equal(a, b) for a, b in zip(even, split))
    even = _run(lambda t: reduce_scatter_to_sequence_parallel_region(t, group), whole, x)
    split = _run(
        lambda t: reduce_scatter_to_sequence_parallel_region(t, group, input_split_sizes=equal),
        whole,
        x,
    )
    assert all(torch.equal(a, b) for a, b in zip(even, split))


def _check(dtype: torch.dtype) -> None:
    rank = dist.get_rank()
    pairs = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    _check_group(pairs[rank // 2], PAIR_SIZES[rank // 2], dtype)
    _check_group(dist.group.WORLD, WORLD_SIZES, dtype)
    _check_equal_sizes_match_the_even_path(pairs[rank // 2], dtype)

    # Sizes that do not fit are refused before any communication, on every rank.
    x = torch.ones(WORLD_SIZES[rank], HIDDEN)
    with pytest.raises(ValueError, match="one row count .* per rank of the group, which has 4"):
        gather_from_sequence_parallel_region(x, dist.group.WORLD, output_split_sizes=[1, 1])
    with pytest.raises(ValueError, match=r"sum\(input_split_sizes\) is 7"):
        reduce_scatter_to_sequence_parallel_region(
            torch.ones(5, HIDDEN), dist.group.WORLD, input_split_sizes=[1, 2, 3, 1]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_sizes_match_the_whole(dtype):
    run_distributed(_check, WORLD, dtype)


def test_split_sizes_without_a_group():
    x = torch.randn(3, HIDDEN)
    assert gather_from_sequence_parallel_region(x, None, output_split_sizes=[3]) is x
    assert reduce_scatter_to_sequence_parallel_region(x, None, input_split_sizes=[3]) is x
    with pytest.raises(ValueError, match=r"output_split_sizes\[0\] is 2"):
        gather_from_sequence_parallel_region(x, None, output_split_sizes=[2])
    with pytest.raises(ValueError, match="which has 1"):
        reduce_scatter_to_sequence_parallel_region(x, None, input_split_sizes=[1, 2])
