"""Per-layer MoE metrics (auxiliary losses, ...) recorded in forward and reported once a step.

The routers `record()` each metric's value of a layer during forward; the training loop reduces,
logs and clears them once per step. The tracker is process-wide, as Megatron-core's is, because
the routers are deep inside the model and the training loop holds no reference to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MetricEntry:
    """One metric's per-layer sums since the last clear.

    Attributes:
        values: [num_layers] sums of the recorded values (index = layer number - 1).
    """

    values: torch.Tensor


class MoEMetricsTracker:
    """The metrics recorded by MoE layers since the last `clear()`."""

    def __init__(self) -> None:
        self._metrics: dict[str, MetricEntry] = {}

    @property
    def metrics(self) -> dict[str, MetricEntry]:
        """The entries by metric name."""
        return self._metrics

    def record(self, name: str, value: torch.Tensor, layer_number: int, num_layers: int) -> None:
        """Adds `value` (a scalar tensor, detached) to layer `layer_number` (1-based) of `name`."""
        if name not in self._metrics:
            self._metrics[name] = MetricEntry(torch.zeros(num_layers, device=value.device))
        self._metrics[name].values[layer_number - 1] += value.detach().float()

    def clear(self) -> None:
        """Zeroes every metric (the entries stay, so their buffers are reused)."""
        for entry in self._metrics.values():
            entry.values.zero_()


_TRACKER: MoEMetricsTracker | None = None


def get_moe_metrics_tracker() -> MoEMetricsTracker:
    """The process-wide tracker, created on first use."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = MoEMetricsTracker()
    return _TRACKER


def destroy_moe_metrics_tracker() -> None:
    """Drops the process-wide tracker (tests; a new one is created on next use)."""
    global _TRACKER
    _TRACKER = None
