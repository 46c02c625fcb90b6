"""Per-layer MoE metrics (auxiliary losses, ...) recorded in forward and reported once a step.

The routers `record()` each metric's value of a layer during forward; once per training step the
training loop calls `report()`, which averages them over the data-parallel ranks, takes their
mean over the MoE layers, writes them to TensorBoard / Weights & Biases, and clears them for the
next step. The tracker is process-wide, as Megatron-core's is, because the routers are deep inside
the model and the training loop holds no reference to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megatron.core import parallel_state


class ScalarWriter(Protocol):
    """TensorBoard's `SummaryWriter`, as far as the report uses it."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        """Writes one scalar at a step."""


class WandbRun(Protocol):
    """A Weights & Biases run, as far as the report uses it."""

    def log(self, data: dict[str, float], step: int) -> None:
        """Writes named scalars at a step."""


@dataclass
class MetricEntry:
    """One metric's per-layer sums since the last clear.

    Attributes:
        values: [num_layers] sums of the recorded values (index = layer number - 1).
    """

    values: torch.Tensor


def count_moe_layers(num_layers: int, moe_layer_freq: int | list[int] | None) -> int:
    """How many of `num_layers` layers are MoE layers under `moe_layer_freq`.

    Args:
        num_layers: The transformer layers.
        moe_layer_freq: Every N-th layer from the first (an int N), a 0/1 flag per layer, or
            None (every layer).
    """
    if moe_layer_freq is None:
        return num_layers
    if isinstance(moe_layer_freq, int):
        return len(range(0, num_layers, moe_layer_freq))
    return sum(moe_layer_freq)


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

    def report(
        self,
        loss_scale: float,
        iteration: int,
        writer: ScalarWriter | None = None,
        wandb_writer: WandbRun | None = None,
        per_layer_logging: bool = False,
        track_names: list[str] | None = None,
        num_layers: int | None = None,
        moe_layer_freq: int | list[int] | None = None,
        total_loss_dict: dict[str, float] | None = None,
        device: torch.device | None = None,
    ) -> str:
        """Averages the metrics over the data-parallel ranks, logs their means, and clears them.

        Every rank must call it (it all-reduces), once per training step, as Megatron-core's
        training loop does. Each metric's layers are scaled by `loss_scale`, then summed and
        divided by the number of MoE layers.

        Args:
            loss_scale: Multiplies the recorded sums: 1 / the step's microbatches, so that the
                report is the mean over microbatches.
            iteration: The training iteration (the step the scalars are written at).
            writer: Where the means go as scalars named after the metrics (None: nowhere).
            wandb_writer: Likewise for Weights & Biases.
            per_layer_logging: Also write each layer's value as `moe/<name>_layer_<i>`
                (i from 0).
            track_names: The metrics to report; a missing one is reported as zeros, so every
                rank reduces the same tensors. None: those recorded so far (must then be the
                same on every rank).
            num_layers: The transformer layers (needed with `track_names`).
            moe_layer_freq: Which layers are MoE layers (`count_moe_layers`).
            total_loss_dict: Receives the means of the metrics whose name ends in "loss",
                which are then left out of the returned string (the training log prints them
                with the other losses).
            device: Where a missing tracked metric's zeros are created (default: the device of
                the recorded metrics, else CUDA's current device when available, else CPU).

        Returns:
            The other means as " name: value |" fields for the console line.

        Raises:
            ValueError: `track_names` without `num_layers`.
        """
        names = list(self._metrics) if track_names is None else list(track_names)
        if track_names is not None:
            if num_layers is None:
                raise ValueError("report(track_names=...) needs num_layers.")
            for name in names:
                self._ensure_initialized(name, num_layers, device)
        self._average_over_data_parallel_ranks(names)
        layers = count_moe_layers(
            num_layers if num_layers is not None else self._num_layers(names), moe_layer_freq
        )
        scalars = {
            name: (self._metrics[name].values.sum() * loss_scale / layers).item() for name in names
        }
        for name, value in scalars.items():
            if writer is not None:
                writer.add_scalar(name, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log({name: value}, step=iteration)
        if per_layer_logging:
            self._write_per_layer(names, loss_scale, iteration, writer, wandb_writer)
        console = dict(scalars)
        if total_loss_dict is not None:
            for name in [name for name in scalars if name.lower().endswith("loss")]:
                total_loss_dict[name] = total_loss_dict.get(name, 0.0) + console.pop(name)
        self.clear()
        return "".join(f" {name}: {value:.2f} |" for name, value in console.items())

    def _ensure_initialized(self, name: str, num_layers: int, device: torch.device | None) -> None:
        if name in self._metrics:
            return
        if device is None:
            recorded = next(iter(self._metrics.values()), None)
            if recorded is not None:
                device = recorded.values.device
            else:
                cuda = torch.cuda.is_available()
                device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        self._metrics[name] = MetricEntry(torch.zeros(num_layers, device=device))

    def _num_layers(self, names: list[str]) -> int:
        return max((self._metrics[name].values.numel() for name in names), default=0)

    def _average_over_data_parallel_ranks(self, names: list[str]) -> None:
        """Each metric's mean over the data-parallel ranks (each saw other tokens)."""
        if not dist.is_initialized():
            return
        group = (
            parallel_state.get_data_parallel_group()
            if parallel_state.model_parallel_is_initialized()
            else None
        )
        size = dist.get_world_size(group)
        if size == 1:
            return
        for name in names:
            values = self._metrics[name].values
            # SUM then divide: gloo has no ReduceOp.AVG.
            dist.all_reduce(values, group=group)
            values.div_(size)

    def _write_per_layer(
        self,
        names: list[str],
        loss_scale: float,
        iteration: int,
        writer: ScalarWriter | None,
        wandb_writer: WandbRun | None,
    ) -> None:
        for name in names:
            for layer, value in enumerate((self._metrics[name].values * loss_scale).tolist()):
                tag = f"moe/{name}_layer_{layer}"
                if writer is not None:
                    writer.add_scalar(tag, value, iteration)
                if wandb_writer is not None:
                    wandb_writer.log({tag: value}, step=iteration)


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
