"""`OptimizerParamScheduler`: the learning-rate and weight-decay schedules of Megatron-LM.

Learning rate: a linear warmup from `init_lr` to `max_lr` over `lr_warmup_steps`, then a decay
to `min_lr` by `lr_decay_steps` (constant, linear, cosine, inverse-square-root, or WSD: constant,
then a decay over the last `wsd_decay_steps`); `min_lr` afterwards. Weight decay: from `start_wd`
to `end_wd` over `wd_incr_steps` (constant, linear or cosine), `end_wd` afterwards.

Steps are whatever unit the caller counts in. The training loop counts samples, as Megatron-LM's
(`step(global_batch_size)` after each update, every `*_steps` in samples:
`flag_groups.optimization.lr_schedule_steps`); with a constant global batch size that is the
schedule of counting iterations (`step(1)`, lengths in iterations). A parameter group with its
own `max_lr` / `min_lr` (`--decoupled-lr`) follows the same curve between its own bounds; those
bounds are part of the schedule a checkpoint is checked against and resumes (`load_state_dict`
with the saved parameter groups).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

_STATE_KEYS = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "wsd_decay_steps",
    "lr_wsd_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
    "num_steps",
)

# The checked keys by the flags that set them (steps in samples). Like Megatron-LM, a resumed run
# may change `--lr-wsd-decay-iters` / `--lr-wsd-decay-style` freely (when to start a WSD run's
# decay is often chosen after its stable phase), and `num_steps` is the checkpoint's.
_CHECKED_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters/-samples/-fraction",
    "lr_decay_steps": "--lr-decay-iters/-samples",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--start-weight-decay",
    "end_wd": "--end-weight-decay",
    "wd_incr_steps": "--train-iters/-samples",
    "wd_incr_style": "--weight-decay-incr-style",
}

GROUP_BOUND_FLAGS = {"max_lr": "--decoupled-lr", "min_lr": "--decoupled-min-lr"}
"""The bounds a parameter group may set for itself (Megatron-LM gives them to the word
embeddings' and output layer's groups), by the flag that sets them. A group without one follows
the scheduler's `max_lr` / `min_lr` (`--lr` / `--min-lr`)."""


@dataclasses.dataclass(frozen=True)
class ScheduleDifference:
    """One value of a checkpoint's schedule that differs from the arguments'.

    Attributes:
        key: the state-dict key (`"lr_decay_steps"`), or the bound (`"max_lr"`, `"min_lr"`) of
            a parameter group where `group`.
        flag: the flag(s) that set it (`_CHECKED_FLAGS`, `GROUP_BOUND_FLAGS`).
        here: the arguments' value.
        saved: the checkpoint's value.
        group: a parameter group's own bound rather than the scheduler's value.
    """

    key: str
    flag: str
    here: Any
    saved: Any
    group: bool = False

    def __str__(self) -> str:
        name = self.flag if self.group else f"{self.key} ({self.flag})"
        return f"{name}: {self.here!r} here, {self.saved!r} in the checkpoint"


class ScheduleMismatchError(ValueError):
    """A checkpoint's schedule differs from the arguments' while neither option of the
    constructor chooses one; `differences` says where (a caller that knows the flags behind the
    steps can name them in its own terms).

    Args:
        differences: every value that differs, the scheduler's before the groups'.
    """

    def __init__(self, differences: list[ScheduleDifference]):
        self.differences = differences
        super().__init__(
            f"The checkpoint's learning-rate schedule differs ({'; '.join(map(str, differences))})"
            ". Pass the checkpoint's values to resume its schedule, "
            "--override-opt_param-scheduler to keep the flags' schedule, or "
            "--use-checkpoint-opt_param-scheduler to take the checkpoint's."
        )


class HasParamGroups(Protocol):
    """A torch optimizer or a `MegatronOptimizer`."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class OptimizerParamScheduler:
    """Sets `lr` and `weight_decay` of every parameter group of `optimizer` at each step.

    A group's weight decay is the scheduled value times its `wd_mult` (default 1.0;
    `get_megatron_optimizer` gives biases and norm weights 0.0).

    Args:
        optimizer: what to schedule.
        init_lr: learning rate at step 0 (the start of the warmup).
        max_lr: learning rate at the end of the warmup.
        min_lr: learning rate after `lr_decay_steps`, and the floor of inverse-square-root.
        lr_warmup_steps: steps of linear warmup (0: none).
        lr_decay_steps: the step at which decay ends (counted from 0, warmup included).
        lr_decay_style: one of `LR_DECAY_STYLES`.
        start_wd: weight decay at step 0.
        end_wd: weight decay from `wd_incr_steps` on.
        wd_incr_steps: steps over which the weight decay goes from `start_wd` to `end_wd`.
        wd_incr_style: one of `WD_INCR_STYLES` ("constant" needs `start_wd == end_wd`).
        wsd_decay_steps: WSD only: the last steps before `lr_decay_steps` that decay.
        lr_wsd_decay_style: WSD only: one of `LR_WSD_DECAY_STYLES`.
        use_checkpoint_opt_param_scheduler: `load_state_dict()` takes the checkpoint's
            schedule instead of these arguments.
        override_opt_param_scheduler: `load_state_dict()` keeps these arguments (and takes
            only the step count from the checkpoint).

    Without either, `load_state_dict()` requires the checkpoint's schedule to equal these
    arguments, as Megatron-LM does.

    Raises:
        ValueError: inconsistent arguments (the message names them).
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: float,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
        use_checkpoint_opt_param_scheduler: bool = False,
        override_opt_param_scheduler: bool = False,
    ):
        if use_checkpoint_opt_param_scheduler and override_opt_param_scheduler:
            raise ValueError(
                "use_checkpoint_opt_param_scheduler and override_opt_param_scheduler are both "
                "set: take the checkpoint's schedule or keep the arguments', not both."
            )
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.num_steps = 0
        self._validate()
        self.step(0)

    def _validate(self) -> None:
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"Need 0 <= min_lr ({self.min_lr}) <= max_lr ({self.max_lr}).")
        if not 0.0 <= self.init_lr <= self.max_lr:
            raise ValueError(f"Need 0 <= init_lr ({self.init_lr}) <= max_lr ({self.max_lr}).")
        if not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            raise ValueError(
                f"Need 0 <= lr_warmup_steps ({self.lr_warmup_steps}) < lr_decay_steps "
                f"({self.lr_decay_steps}): the decay period includes the warmup."
            )
        _check_choice("lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        if self.lr_decay_style == "WSD":
            _check_choice("lr_wsd_decay_style", self.lr_wsd_decay_style, LR_WSD_DECAY_STYLES)
            decay_steps = self.wsd_decay_steps
            if decay_steps is None or not 0 < decay_steps <= self.lr_decay_steps:
                raise ValueError(
                    f"lr_decay_style='WSD' needs 0 < wsd_decay_steps ({decay_steps}) <= "
                    f"lr_decay_steps ({self.lr_decay_steps})."
                )
        if not 0.0 <= self.start_wd <= self.end_wd:
            raise ValueError(f"Need 0 <= start_wd ({self.start_wd}) <= end_wd ({self.end_wd}).")
        _check_choice("wd_incr_style", self.wd_incr_style, WD_INCR_STYLES)
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(
                f"wd_incr_style='constant' needs start_wd == end_wd (got {self.start_wd} and "
                f"{self.end_wd}); use 'linear' or 'cosine' to change the weight decay."
            )
        if self.wd_incr_style != "constant" and self.wd_incr_steps <= 0:
            raise ValueError(
                f"wd_incr_style={self.wd_incr_style!r} needs wd_incr_steps > 0, got "
                f"{self.wd_incr_steps}."
            )

    def get_wd(self) -> float:
        """The weight decay at the current step."""
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine: rises slowly, fastest in the middle, slowly again
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict[str, Any] | None = None) -> float:
        """The learning rate at the current step: of `param_group`, whose own `max_lr` and
        `min_lr` (e.g. `--decoupled-lr`'s group) replace the scheduler's, as Megatron-LM's."""
        group = param_group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            progress = self.num_steps / self.lr_warmup_steps
            return self.init_lr + (max_lr - self.init_lr) * progress
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            # Continuous with the warmup's end: max_lr at step lr_warmup_steps.
            warmup, step = max(self.lr_warmup_steps, 1), max(self.num_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warmup / step))
        ratio = (self.num_steps - self.lr_warmup_steps) / (
            self.lr_decay_steps - self.lr_warmup_steps
        )
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff()
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self) -> float:
        """Warmup-stable-decay: 1 until the last `wsd_decay_steps`, then down to 0."""
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= anneal_start:
            return 1.0
        ratio = (self.num_steps - anneal_start) / self.wsd_decay_steps
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - ratio
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "exponential":
            return 2.0 * 0.5**ratio - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt

    def step(self, increment: int) -> None:
        """Advances `increment` steps and writes the new values into every parameter group."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        """The schedule and its position (Megatron-LM's keys, plus the WSD ones)."""
        return {key: getattr(self, key) for key in _STATE_KEYS}

    def check_state_dict(
        self,
        state_dict: dict[str, Any],
        param_groups: list[dict[str, Any]] | None = None,
    ) -> None:
        """Checks that `load_state_dict(state_dict, param_groups)` would succeed, changing
        nothing.

        Args:
            state_dict: a `state_dict()`.
            param_groups: the checkpoint's parameter groups, in the order of the optimizer's
                (`MegatronOptimizer.check_param_groups` checks that they hold the same
                parameters): their own bounds (`GROUP_BOUND_FLAGS`) are compared with the
                optimizer's groups'. None: only the scheduler's values are.

        Raises:
            ValueError: a key is missing.
            ScheduleMismatchError: the checkpoint's schedule (a group's bounds included)
                differs from the arguments (neither option of the constructor set).
        """
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(
                f"Scheduler state dict lacks {missing}; pass one saved by "
                "OptimizerParamScheduler.state_dict()."
            )
        if self.use_checkpoint_opt_param_scheduler or self.override_opt_param_scheduler:
            return
        differ = [
            ScheduleDifference(key, flag, getattr(self, key), state_dict[key])
            for key, flag in _CHECKED_FLAGS.items()
            if getattr(self, key) != state_dict[key]
        ]
        differ += self._group_bound_differences(state_dict, param_groups or [])
        if differ:
            raise ScheduleMismatchError(differ)

    def _group_bound_differences(
        self, state_dict: dict[str, Any], param_groups: list[dict[str, Any]]
    ) -> list[ScheduleDifference]:
        """Each group bound that differs from the checkpoint's, once per flag. A bound a group
        does not set is the scheduler's (the checkpoint's scheduler's for a saved group), so
        that --decoupled-min-lr equal to --min-lr matches a group without it."""
        differ: dict[str, ScheduleDifference] = {}
        for group, saved in zip(self.optimizer.param_groups, param_groups):
            for key, flag in GROUP_BOUND_FLAGS.items():
                if key not in group and key not in saved:
                    continue
                here = group.get(key, getattr(self, key))
                there = saved.get(key, state_dict[key])
                if here != there and flag not in differ:
                    differ[flag] = ScheduleDifference(key, flag, here, there, group=True)
        return list(differ.values())

    def load_state_dict(
        self,
        state_dict: dict[str, Any],
        param_groups: list[dict[str, Any]] | None = None,
    ) -> None:
        """Resumes the schedule of a checkpoint at its step; the parameter groups get that
        step's values. Which schedule: see the constructor's last two arguments. With
        `use_checkpoint_opt_param_scheduler` the optimizer's groups also take the bounds of
        `param_groups` (the checkpoint's, as `check_state_dict` takes them); otherwise they
        keep their own, which are the checkpoint's unless `override_opt_param_scheduler`. The
        WSD decay's length and style are this run's either way but with
        `use_checkpoint_opt_param_scheduler` (Megatron-LM saves neither).

        Raises:
            ValueError: see `check_state_dict`; or the loaded schedule is inconsistent.
        """
        self.check_state_dict(state_dict, param_groups)
        if self.use_checkpoint_opt_param_scheduler:
            for key in _STATE_KEYS:
                setattr(self, key, state_dict[key])
            for group, saved in zip(self.optimizer.param_groups, param_groups or []):
                for key in GROUP_BOUND_FLAGS:
                    if key in saved:
                        group[key] = saved[key]
                    else:
                        group.pop(key, None)
        self.num_steps = state_dict["num_steps"]
        self._validate()
        self.step(0)


def _check_choice(name: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(choices)}.")
