"""An iteration's optimizer step as the training loop takes it (`take_optimizer_step`), and what
it did (`StepOutcome`), read on the host when first asked for (`PendingStep`).

Megatron-LM's step reads the global gradient norm on the host to decide whether to skip the update:
the host waits there for the whole backward before it queues the update and the next iteration, and
the GPU idles while the host catches up. Where the optimizer can skip a step on the device
(`MegatronOptimizer.steps_without_host_sync`: bf16 or fp32 training with torch's fused Adam, the
default, or fused SGD; from the second step on where the optimizer keeps state), the step is queued
without that read, and its outcome (whether it updated, the norm, the zero count) is read one
iteration later, before the next step is taken, the way the loop reads the losses. The schedule's
step waits for that outcome, since a skipped step does not advance it; it still comes before the
next optimizer step is queued, so every step uses the learning rate it would have had, and the
weights are those of a step read at once, bitwise. fp16's loss scaler decides on the host, and its
steps are read at once, as are unfused optimizers' and a first step that makes state (whose skip on
the device would make optimizer state that `step()` does not).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.device_step import DeviceStepResult
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.loss_reduction import ReducedLosses

HostStepResult = tuple[bool, float | None, int | None]
"""(update_successful, grad_norm, num_zeros_in_grad), as `MegatronOptimizer.step()` returns."""


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What an iteration's optimizer step did, read on the host.

    Attributes:
        update_successful: whether the weights were updated (False: the gradient norm was not
            finite, or fp16's loss scaler found an overflow).
        grad_norm: the global gradient norm before clipping (None when the loss scaler skipped
            the step before taking it).
        num_zeros_in_grad: the zero gradient elements (None without
            `--log-num-zeros-in-grad`, or when the loss scaler skipped the step).
        learning_rate: the first parameter group's rate after the schedule's step, i.e. the
            next iteration's (Megatron-LM logs this one).
    """

    update_successful: bool
    grad_norm: float | None
    num_zeros_in_grad: int | None
    learning_rate: float


class PendingStep:
    """An iteration's optimizer step, taken; settled when its outcome is first read (`outcome`).

    Settling reads what the step measured (waiting for its copy to the host where it was left on
    the device), steps the schedule by the iteration's samples after an update, and under
    `--check-for-nan-in-loss-and-grad` raises for a skipped step whose loss or norm is not
    finite. Steps settle in the order they were taken, each before the next one is:
    `take_optimizer_step` settles the one before.

    Args:
        measured: the step's `DeviceStepResult` (left on the device), or `step()`'s result.
        optimizer: the optimizer that took it (read for the learning rate).
        scheduler: stepped after an update.
        args: read for `check_for_nan_in_loss_and_grad`.
        samples: the iteration's global batch, what the schedule advances by.
        losses: the iteration's reported losses (read for the check of a skipped step).
    """

    def __init__(
        self,
        measured: DeviceStepResult | HostStepResult,
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        args: argparse.Namespace,
        samples: int,
        losses: ReducedLosses,
    ) -> None:
        self._measured = measured
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._samples = samples
        self._losses = losses
        self._check_for_nan = args.check_for_nan_in_loss_and_grad
        self._outcome: StepOutcome | None = None

    @property
    def is_read(self) -> bool:
        """Whether `outcome` returns without waiting for the device."""
        return self._outcome is not None

    def outcome(self) -> StepOutcome:
        """What the step did (settles it the first time: see the class).

        Raises:
            RuntimeError: at the first read only: the step was skipped,
                `--check-for-nan-in-loss-and-grad` is on, and a loss or the global gradient
                norm is not finite. Both are the same on every rank (reduced over the
                data-parallel group), so every rank raises.
        """
        if self._outcome is None:
            update_successful, grad_norm, num_zeros = self._read()
            if update_successful:
                # In samples, as Megatron-LM's schedule (get_optimizer_param_scheduler).
                self._scheduler.step(self._samples)
            learning_rate = self._optimizer.param_groups[0]["lr"]
            self._outcome = StepOutcome(update_successful, grad_norm, num_zeros, learning_rate)
            if not update_successful and self._check_for_nan:
                self._check_skipped_step(grad_norm)
        return self._outcome

    def _check_skipped_step(self, grad_norm: float | None) -> None:
        """`--check-for-nan-in-loss-and-grad`'s check of a skipped step.

        Raises:
            RuntimeError: a loss, or else the global gradient norm, is not finite.
        """
        # A non-finite norm usually comes of a non-finite loss: the error to report.
        check_losses_finite(self._losses.read())
        # None: fp16's loss scaler skipped the step (an overflow is its signal).
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise RuntimeError(
                f"The global gradient norm is {grad_norm} though the loss is finite "
                f"({self._losses.read()}; --check-for-nan-in-loss-and-grad). Lower --lr or "
                f"check the model; {_SKIP_INSTEAD}"
            )

    def _read(self) -> HostStepResult:
        if isinstance(self._measured, DeviceStepResult):
            return self._measured.read()
        return self._measured


def take_optimizer_step(
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
    samples: int,
    losses: ReducedLosses,
    previous: PendingStep | None,
) -> PendingStep:
    """Settles `previous`, then takes the optimizer step on the gradients the iteration left,
    reading its outcome later where the optimizer allows it (module docstring), at once
    otherwise.

    Args:
        optimizer: steps the model's main weights.
        scheduler: stepped after an update, once the step is read.
        args: read for `check_for_nan_in_loss_and_grad`.
        samples: the iteration's global batch.
        losses: the iteration's reported losses.
        previous: the step taken before this one (None: none, or settled already).
    """
    if previous is not None:
        previous.outcome()
    deferred = optimizer.steps_without_host_sync
    measured = optimizer.step_without_host_sync() if deferred else optimizer.step()
    step = PendingStep(measured, optimizer, scheduler, args, samples, losses)
    if not deferred:
        step.outcome()  # read already: the schedule need not wait
    return step


_SKIP_INSTEAD = "or pass --no-check-for-nan-in-loss-and-grad to skip such steps and continue."


def check_losses_finite(losses: dict[str, float]) -> None:
    """`--check-for-nan-in-loss-and-grad`'s check of an iteration's reported losses.

    Raises:
        RuntimeError: a loss is not finite.
    """
    if not all(map(math.isfinite, losses.values())):
        raise RuntimeError(
            f"The loss is not finite ({losses}; --check-for-nan-in-loss-and-grad). Lower --lr "
            f"or check the data; {_SKIP_INSTEAD}"
        )
