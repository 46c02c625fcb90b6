"""`MoEMetricsTracker.report`: the mean over MoE layers, scaled by the microbatches, averaged over
the data-parallel ranks, written as scalars (and per layer), handed to the training log's losses,
and cleared; and the training log's MoE fields."""

from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.moe.moe_logging import (
    count_moe_layers,
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from tests.unit_tests.distributed_harness import run_distributed


class _FakeWriter:
    """SummaryWriter's `add_scalar` and a wandb run's `log`, kept in one list."""

    def __init__(self):
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.scalars.append((tag, scalar_value, global_step))

    def log(self, data: dict[str, float], step: int) -> None:
        self.scalars.extend((tag, value, step) for tag, value in data.items())


@pytest.fixture(autouse=True)
def fresh_tracker():
    destroy_moe_metrics_tracker()
    yield
    destroy_moe_metrics_tracker()


def _record(values: dict[int, float], name: str = "load_balancing_loss", layers: int = 4) -> None:
    for layer, value in values.items():
        get_moe_metrics_tracker().record(name, torch.tensor(value), layer, layers)


@pytest.mark.parametrize(
    ("num_layers", "freq", "expected"),
    [(4, 1, 4), (4, 2, 2), (5, 2, 3), (4, [0, 1, 1, 0], 2), (4, None, 4)],
)
def test_count_moe_layers_follows_the_layer_pattern(num_layers, freq, expected):
    """An int N: layers 0, N, 2N, ... (upstream's rule); a list: its 1s; None: every layer."""
    assert count_moe_layers(num_layers, freq) == expected


def test_report_averages_over_moe_layers_and_microbatches_then_clears():
    # Layers 1 and 3 are the MoE layers of --moe-layer-freq 2; two microbatches each recorded.
    _record({1: 1.0 + 3.0, 3: 2.0 + 2.0})
    losses: dict[str, float] = {}
    tensorboard, wandb = _FakeWriter(), _FakeWriter()
    console = get_moe_metrics_tracker().report(
        loss_scale=1 / 2,
        iteration=7,
        writer=tensorboard,
        wandb_writer=wandb,
        track_names=["load_balancing_loss", "z_loss"],
        num_layers=4,
        moe_layer_freq=2,
        total_loss_dict=losses,
    )
    mean = (4.0 + 4.0) / 2 / 2  # summed microbatches / 2 microbatches / 2 MoE layers
    assert losses == pytest.approx({"load_balancing_loss": mean, "z_loss": 0.0})
    assert console == ""  # losses go to the log line with the other losses
    expected = [("load_balancing_loss", mean, 7), ("z_loss", 0.0, 7)]
    assert tensorboard.scalars == pytest.approx(expected)
    assert wandb.scalars == pytest.approx(expected)
    assert all(torch.all(entry.values == 0) for entry in get_moe_metrics_tracker().metrics.values())


def test_report_accumulates_into_the_loss_dict_and_prints_other_metrics():
    _record({1: 2.0})
    _record({1: 0.5, 2: 1.5}, name="load_imbalance")
    losses = {"load_balancing_loss": 1.0}
    console = get_moe_metrics_tracker().report(
        loss_scale=1.0, iteration=1, num_layers=4, total_loss_dict=losses
    )
    assert losses == pytest.approx({"load_balancing_loss": 1.0 + 2.0 / 4})
    assert console == f" load_imbalance: {2.0 / 4:.2f} |"


def test_per_layer_logging_writes_each_layer_scaled():
    _record({1: 2.0, 2: 4.0}, layers=2)
    tensorboard = _FakeWriter()
    get_moe_metrics_tracker().report(
        loss_scale=0.25,
        iteration=3,
        writer=tensorboard,
        per_layer_logging=True,
        track_names=["load_balancing_loss"],
        num_layers=2,
    )
    assert tensorboard.scalars == pytest.approx(
        [
            ("load_balancing_loss", (2.0 + 4.0) * 0.25 / 2, 3),
            ("moe/load_balancing_loss_layer_0", 0.5, 3),
            ("moe/load_balancing_loss_layer_1", 1.0, 3),
        ]
    )


def test_tracked_names_need_the_layer_count():
    with pytest.raises(ValueError, match="num_layers"):
        get_moe_metrics_tracker().report(loss_scale=1.0, iteration=1, track_names=["z_loss"])


def _report_on_rank(recording_ranks: tuple[int, ...]) -> dict[str, float]:
    """Rank r records 1 + 2r on both layers if it is one of `recording_ranks`, then reports."""
    destroy_moe_metrics_tracker()
    rank = torch.distributed.get_rank()
    if rank in recording_ranks:
        _record({1: 1.0 + 2 * rank, 2: 1.0 + 2 * rank}, layers=2)
    losses: dict[str, float] = {}
    get_moe_metrics_tracker().report(
        loss_scale=1.0,
        iteration=1,
        track_names=["load_balancing_loss"],
        num_layers=2,
        total_loss_dict=losses,
    )
    return losses


@pytest.mark.parametrize(("recording_ranks", "mean"), [((0, 1), (1.0 + 3.0) / 2), ((0,), 0.5)])
def test_report_is_the_mean_over_data_parallel_ranks(recording_ranks, mean):
    """A rank that recorded nothing reduces zeros, so the collectives match and nothing hangs."""
    ranks = run_distributed(_report_on_rank, 2, recording_ranks)
    assert ranks[0] == ranks[1] == pytest.approx({"load_balancing_loss": mean})
