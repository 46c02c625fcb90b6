"""The multi-rank harness reports results, propagates failures and bounds hangs."""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.distributed_harness import (
    DistributedTestError,
    current_device,
    run_distributed,
)


def _all_reduce_rank() -> tuple[int, float]:
    value = torch.tensor([float(dist.get_rank() + 1)], device=current_device())
    dist.all_reduce(value)
    return dist.get_rank(), value.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_by_rank(world_size):
    results = run_distributed(_all_reduce_rank, world_size)
    expected_sum = world_size * (world_size + 1) / 2
    assert results == [(rank, expected_sum) for rank in range(world_size)]


def test_failing_rank_traceback_is_raised():
    with pytest.raises(DistributedTestError, match="boom from rank one") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert "rank 1" in str(info.value)
    # The broken pool was discarded: the next call works on fresh processes.
    assert run_distributed(_all_reduce_rank, 2) == [(0, 3.0), (1, 3.0)]


def test_stuck_collective_fails_within_timeout():
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] did not finish"):
        run_distributed(_hang_on_rank_zero, 2, timeout=5)
