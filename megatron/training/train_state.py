"""`TrainState`: how far training has come, the values the loop advances and a checkpoint
saves (torchtitan keeps its step and tokens seen the same way).

The arguments (`get_args()`) are read-only once set up (`ReadOnlyArguments`); the progress of
a run lives here and is passed explicitly: `pretrain()` starts a fresh one or takes
`load_checkpoint()`'s, `train()` advances it, `save_checkpoint()` writes it, and the log reads
the consumed samples from it. A checkpoint's `common.pt` holds its entries under the keys of
`TrainState.state_dict()`; the first three (`iteration`, `consumed_train_samples`,
`consumed_valid_samples`) are the ones checkpoints have always held, and the others start at 0
when a checkpoint saved before they existed loads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

REQUIRED_KEYS = ("iteration", "consumed_train_samples", "consumed_valid_samples")
"""The entries every checkpoint's `common.pt` holds."""


@dataclasses.dataclass
class TrainState:
    """The progress of a training run.

    Attributes:
        iteration: the iterations done (the last one's number; 0 before the first).
        consumed_train_samples: the training samples the iterations read, over all ranks: the
            data position a resumed run continues from, and what a batch-size ramp reads.
        consumed_valid_samples: the validation samples the periodic evaluations read.
        num_skipped_iterations: iterations whose optimizer step was skipped (a gradient norm
            that is not finite, or an fp16 overflow).
        num_nan_iterations: of those, the ones whose loss was not finite (the log's "number of
            nan iterations" rule).
        num_floating_point_operations_so_far: the model FLOPs of every iteration so far
            (`megatron.training.flops`, at each iteration's global batch size), as
            Megatron-LM's checkpoints hold it.
    """

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    num_skipped_iterations: int = 0
    num_nan_iterations: int = 0
    num_floating_point_operations_so_far: float = 0.0

    def record_iteration(
        self, iteration: int, global_batch_size: int, floating_point_operations: float
    ) -> None:
        """Advances the state past one training iteration.

        Args:
            iteration: its number (the next one: `self.iteration + 1`).
            global_batch_size: the samples it trained on.
            floating_point_operations: its model FLOPs.

        Raises:
            ValueError: `iteration` is not the one after `self.iteration`.
        """
        if iteration != self.iteration + 1:
            raise ValueError(
                f"TrainState is at iteration {self.iteration}, so the next is "
                f"{self.iteration + 1}, not {iteration}; record the iterations in order."
            )
        self.iteration = iteration
        self.consumed_train_samples += global_batch_size
        self.num_floating_point_operations_so_far += floating_point_operations

    def record_skipped_step(self, losses: Mapping[str, float]) -> None:
        """Counts an iteration whose optimizer step was skipped, and a nan iteration too where
        one of its reported `losses` is not finite (read once the step's outcome is: the loop
        learns it after the iteration)."""
        self.num_skipped_iterations += 1
        if is_nan_iteration(True, losses):
            self.num_nan_iterations += 1

    def record_evaluation(self, samples: int) -> None:
        """Counts the validation samples a periodic evaluation read."""
        self.consumed_valid_samples += samples

    def state_dict(self) -> dict[str, Any]:
        """The entries a checkpoint's `common.pt` holds, under their on-disk keys."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes the values of a checkpoint's `common.pt` (`state_dict()`'s keys; other keys are
        ignored). Entries that a checkpoint saved before they existed lacks start at 0.

        Raises:
            ValueError: `state` lacks one of `REQUIRED_KEYS`.
        """
        missing = [key for key in REQUIRED_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"The training state lacks {missing}, which every checkpoint holds; the "
                "checkpoint's common.pt was not written by a save. Load another checkpoint."
            )
        defaults = TrainState()
        for field in dataclasses.fields(self):
            setattr(self, field.name, state.get(field.name, getattr(defaults, field.name)))

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> TrainState:
        """A state with the values of `state` (see `load_state_dict`)."""
        train_state = cls()
        train_state.load_state_dict(state)
        return train_state


def is_nan_iteration(skipped: bool, losses: Mapping[str, float]) -> bool:
    """Megatron-LM's rule: a skipped iteration whose loss is not finite is a nan iteration."""
    return skipped and not all(math.isfinite(value) for value in losses.values())
