"""`MoEMetricsTracker.report`: the mean over MoE layers, scaled by the microbatches, averaged over
the data-parallel ranks, each layer's value, and cleared; the layer pattern it divides by."""

from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.moe.moe_config import layer_pattern
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from tests.unit_tests.distributed_harness import run_distributed


@pytest.fixture(autouse=True)
def fresh_tracker():
    destroy_moe_metrics_tracker()
    yield
    destroy_moe_metrics_tracker()


def _record(values: dict[int, float], name: str = "load_balancing_loss", layers: int = 4) -> None:
    for layer, value in values.items():
        get_moe_metrics_tracker().record(name, torch.tensor(value), layer, layers)


@pytest.mark.parametrize(
    ("num_layers", "experts", "freq", "expected"),
    [
        (4, 8, 1, [1, 1, 1, 1]),
        (4, 8, 2, [1, 0, 1, 0]),
        (5, 8, 2, [1, 0, 1, 0, 1]),
        (4, 8, [0, 1, 1, 0], [0, 1, 1, 0]),
        (4, None, 1, [0, 0, 0, 0]),
    ],
)
def test_layer_pattern_follows_moe_layer_freq(num_layers, experts, freq, expected):
    """An int N: layers 0, N, 2N, ... (upstream's rule); a list: its 1s; no experts: none."""
    assert layer_pattern(num_layers, experts, freq) == [bool(v) for v in expected]


def test_report_averages_over_moe_layers_and_microbatches_then_clears():
    # Layers 1 and 3 are the MoE layers of --moe-layer-freq 2; two microbatches each recorded.
    _record({1: 1.0 + 3.0, 3: 2.0 + 2.0})
    means, per_layer = get_moe_metrics_tracker().report(
        ["load_balancing_loss", "z_loss"], num_layers=4, num_moe_layers=2, loss_scale=1 / 2
    )
    mean = (4.0 + 4.0) / 2 / 2  # summed microbatches / 2 microbatches / 2 MoE layers
    assert means == pytest.approx({"load_balancing_loss": mean, "z_loss": 0.0})
    # One approx per metric: pytest.approx compares no nested containers (a TypeError from 9.2 on).
    assert per_layer.keys() == {"load_balancing_loss", "z_loss"}
    assert per_layer["load_balancing_loss"] == pytest.approx([2.0, 0.0, 2.0, 0.0])
    assert per_layer["z_loss"] == pytest.approx([0.0] * 4)
    assert all(torch.all(values == 0) for values in get_moe_metrics_tracker().metrics.values())


def test_report_of_no_metric_clears_the_recorded_ones():
    _record({1: 2.0})
    assert get_moe_metrics_tracker().report([], 4, 4, loss_scale=1.0) == ({}, {})
    assert torch.all(get_moe_metrics_tracker().metrics["load_balancing_loss"] == 0)


def _report_on_rank(recording_ranks: tuple[int, ...]) -> dict[str, float]:
    """Rank r records 1 + 2r on both layers if it is one of `recording_ranks`, then reports."""
    destroy_moe_metrics_tracker()
    rank = torch.distributed.get_rank()
    if rank in recording_ranks:
        _record({1: 1.0 + 2 * rank, 2: 1.0 + 2 * rank}, layers=2)
    means, _ = get_moe_metrics_tracker().report(
        ["load_balancing_loss"], num_layers=2, num_moe_layers=2, loss_scale=1.0
    )
    return means


@pytest.mark.parametrize(("recording_ranks", "mean"), [((0, 1), (1.0 + 3.0) / 2), ((0,), 0.5)])
def test_report_is_the_mean_over_data_parallel_ranks(recording_ranks, mean):
    """A rank that recorded nothing reduces zeros, so the collectives match and nothing hangs."""
    ranks = run_distributed(_report_on_rank, 2, recording_ranks)
    assert ranks[0] == ranks[1] == pytest.approx({"load_balancing_loss": mean})


def test_a_model_of_other_depth_records_afresh():
    # The tracker is process-wide: a second model (here one layer deeper) in the same process
    # must not index the first one's buffers.
    destroy_moe_metrics_tracker()
    tracker = get_moe_metrics_tracker()
    tracker.record("load_balancing_loss", torch.tensor(1.0), layer_number=2, num_layers=2)
    tracker.record("load_balancing_loss", torch.tensor(5.0), layer_number=3, num_layers=3)
    assert tracker.metrics["load_balancing_loss"].tolist() == [0.0, 0.0, 5.0]


def test_a_model_on_another_device_records_afresh():
    # A CPU model followed by one on another device (a GPU; here `meta`) in the same process.
    destroy_moe_metrics_tracker()
    tracker = get_moe_metrics_tracker()
    tracker.record("load_balancing_loss", torch.tensor(1.0), layer_number=1, num_layers=2)
    tracker.record("load_balancing_loss", torch.tensor(5.0, device="meta"), 2, num_layers=2)
    assert tracker.metrics["load_balancing_loss"].device == torch.device("meta")
