"""`take_optimizer_step` and `PendingStep` on one process: which steps the loop reads later, and
what reading one does (the schedule's step after an update, none after a skip)."""

from __future__ import annotations

import argparse

import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.loss_reduction import ReducedLosses
from megatron.training.optimizer_step import take_optimizer_step
from tests.unit_tests.model_builders import build_tiny_gpt

LR = 1e-2
ARGS = argparse.Namespace(check_for_nan_in_loss_and_grad=False)


def _set_grads(model: torch.nn.Module, finite: bool) -> None:
    for param in model.parameters():
        param.grad = torch.full_like(param, 1e-3 if finite else float("nan"))


def test_the_schedule_steps_when_a_step_is_read_and_a_first_step_is_read_at_once():
    model = build_tiny_gpt()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR, clip_grad=1.0), model)
    scheduler = OptimizerParamScheduler(
        optimizer, 0.0, LR, 0.0, 0, 10, "linear", 0.0, 0.0, 10, "constant"
    )
    losses = ReducedLosses(values={"lm loss": 1.0})
    rate = optimizer.param_groups[0]["lr"]
    # A skipped first step: read at once, with no optimizer state made (as `step()`).
    _set_grads(model, finite=False)
    skipped = take_optimizer_step(optimizer, scheduler, ARGS, 1, losses, previous=None)
    assert skipped.is_read and not skipped.outcome().update_successful
    assert not optimizer.optimizer.state and skipped.outcome().learning_rate == rate
    # The first real step makes the state, still read at once.
    _set_grads(model, finite=True)
    first = take_optimizer_step(optimizer, scheduler, ARGS, 1, losses, previous=skipped)
    assert first.is_read and first.outcome().update_successful
    assert optimizer.optimizer.state and first.outcome().learning_rate < rate
    # From then on a step is read later: the schedule waits for it.
    rate = first.outcome().learning_rate
    _set_grads(model, finite=True)
    later = take_optimizer_step(optimizer, scheduler, ARGS, 1, losses, previous=first)
    assert not later.is_read and optimizer.param_groups[0]["lr"] == rate
    # Taking the next step reads it first.
    _set_grads(model, finite=False)
    last = take_optimizer_step(optimizer, scheduler, ARGS, 1, losses, previous=later)
    assert later.is_read and later.outcome().learning_rate < rate
    assert not last.outcome().update_successful
    assert last.outcome().learning_rate == later.outcome().learning_rate
