"""Per-layer MoE metrics (auxiliary losses, ...) recorded in forward and reported once a step.

The routers `record()` each metric's value of a layer during forward; once per training step the
training loop calls `report()`, which gathers the layers of every pipeline stage (each records
its own layers, zeros stand for the others: a sum over the pipeline group, as Megatron-core's),
averages them over the data-parallel ranks, takes their mean over the MoE layers and clears
them for the next step. The tracker is process-wide, as
Megatron-core's is, because the routers are deep inside the model and the training loop holds no
reference to them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state


class MoEMetricsTracker:
    """The metrics recorded by MoE layers since the last `clear()`."""

    def __init__(self) -> None:
        self._metrics: dict[str, torch.Tensor] = {}

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        """Each metric's [num_layers] sums of the recorded values (index = layer number - 1)."""
        return self._metrics

    def record(self, name: str, value: torch.Tensor, layer_number: int, num_layers: int) -> None:
        """Adds `value` (a scalar tensor, detached) to layer `layer_number` (1-based) of `name`.

        A model with another number of layers, or on another device, than the one that recorded
        `name` before (a new model in the same process) starts the metric afresh.
        """
        values = self._metrics.get(name)
        if values is None or values.numel() != num_layers or values.device != value.device:
            values = self._metrics[name] = torch.zeros(num_layers, device=value.device)
        values[layer_number - 1] += value.detach().float()

    def clear(self) -> None:
        """Zeroes every metric (the buffers stay, to be reused)."""
        for values in self._metrics.values():
            values.zero_()

    def report(
        self,
        names: Sequence[str],
        num_layers: int,
        num_moe_layers: int,
        loss_scale: float,
        device: torch.device | None = None,
    ) -> tuple[dict[str, float], dict[str, list[float]]]:
        """`reduce`'s metrics read to the host: `(means, per_layer)`, each metric's mean over
        the MoE layers and its value for each layer (0 for dense layers); `({}, {})` without
        names."""
        rows = self.reduce(names, num_layers, num_moe_layers, loss_scale, device)
        if rows is None:
            return {}, {}
        values = rows.tolist()  # one host copy for everything
        return (
            {name: row[0] for name, row in zip(names, values)},
            {name: row[1:] for name, row in zip(names, values)},
        )

    def reduce(
        self,
        names: Sequence[str],
        num_layers: int,
        num_moe_layers: int,
        loss_scale: float,
        device: torch.device | None = None,
    ) -> torch.Tensor | None:
        """Gathers `names` over the pipeline stages and averages them over the data-parallel
        ranks, on the device (no host synchronisation), then clears every metric.

        Every rank must call it (or `report`) with the same `names` (it all-reduces once, twice
        with pipeline stages), once per training step, as Megatron-core's training loop does. A
        metric a rank did not record counts as zeros there.

        Args:
            names: The metrics to report.
            num_layers: The transformer layers (the length of each metric).
            num_moe_layers: How many of them are MoE layers (the mean's divisor).
            loss_scale: Multiplies the recorded sums: 1 / the step's microbatches, so that the
                report is the mean over microbatches.
            device: Where a metric no layer recorded is made of zeros (default: CPU).

        Returns:
            `[len(names), 1 + num_layers]`: per metric, its mean over the MoE layers, then its
            value for each layer; None without names.
        """
        if not names:
            self.clear()
            return None
        stacked = torch.stack(
            [
                self._metrics.get(name, torch.zeros(num_layers, device=device)).to(device)
                for name in names
            ]
        )
        self._sum_over_pipeline_stages(stacked)
        self._average_over_data_parallel_ranks(stacked)
        stacked *= loss_scale
        means = stacked.sum(dim=1, keepdim=True) / num_moe_layers
        self.clear()
        return torch.cat([means, stacked], dim=1)

    @staticmethod
    def _sum_over_pipeline_stages(values: torch.Tensor) -> None:
        """Each layer's values from the stage that holds it, on every stage, in place."""
        if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
            return
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())

    @staticmethod
    def _average_over_data_parallel_ranks(values: torch.Tensor) -> None:
        """`values`' mean over the data-parallel ranks (each saw other tokens), in place."""
        if not dist.is_initialized():
            return
        group = (
            parallel_state.get_data_parallel_group()
            if parallel_state.model_parallel_is_initialized()
            else None
        )
        size = dist.get_world_size(group)
        if size > 1:
            dist.all_reduce(values, group=group)  # SUM, then divide: gloo has no ReduceOp.AVG
            values.div_(size)


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
