"""`ReducedLosses`: an iteration's losses are read to the host when asked for, and a read waits
for their copy alone, not for the GPU work queued after them."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.training.loss_reduction import ReducedLosses

LAYOUT = [("lm loss", 2), ("z", 1)]
"""A `[sum, count]` pair, then a mean."""


def test_read_gives_each_sum_over_its_count_and_the_means_once():
    losses = ReducedLosses(torch.tensor([6.0, 4.0, 2.0]), LAYOUT)
    assert not losses.is_read
    values = losses.read()
    assert values == {"lm loss": 1.5, "z": 2.0}
    assert losses.is_read and losses.read() is values


def test_a_pair_without_a_count_reads_as_nan_and_values_on_the_host_read_as_given():
    assert math.isnan(ReducedLosses(torch.tensor([1.0, 0.0, 2.0]), LAYOUT).read()["lm loss"])
    given = {"lm loss": 2.5}
    losses = ReducedLosses(values=given)
    assert losses.is_read and losses.read() == given


@pytest.mark.gpu
def test_a_read_waits_for_the_losses_not_for_the_work_queued_after_them():
    reduced = torch.tensor([6.0, 4.0, 2.0], device="cuda")
    losses = ReducedLosses(reduced, LAYOUT)
    reduced.zero_()  # the copy was taken in stream order, before this
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, queued after the losses
    values = losses.read()
    assert not torch.cuda.current_stream().query()  # the sleep still runs
    assert values == {"lm loss": 1.5, "z": 2.0}
    torch.cuda.synchronize()
