"""`OptimizerParamScheduler` against values worked out by hand from Megatron-LM's formulas."""

from __future__ import annotations

import math
import re

import pytest
import torch

from megatron.core.optimizer_param_scheduler import (
    _CHECKED_FLAGS,
    _STATE_KEYS,
    OptimizerParamScheduler,
)

INIT_LR, MAX_LR, MIN_LR = 1e-4, 1e-3, 1e-5
WARMUP, DECAY = 10, 110  # the decay phase spans steps 10..110: 100 steps
DELTA = MAX_LR - MIN_LR


def _optimizer() -> torch.optim.Optimizer:
    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    return torch.optim.SGD(
        [{"params": [weight], "wd_mult": 1.0}, {"params": [bias], "wd_mult": 0.0}], lr=1.0
    )


def _scheduler(
    style: str = "linear", optimizer: torch.optim.Optimizer | None = None, **kwargs
) -> OptimizerParamScheduler:
    args = dict(
        init_lr=INIT_LR,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        lr_warmup_steps=WARMUP,
        lr_decay_steps=DECAY,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=100,
        wd_incr_style="linear",
    )
    args.update(kwargs)
    return OptimizerParamScheduler(optimizer or _optimizer(), **args)


def _lr_at(scheduler: OptimizerParamScheduler, step: int) -> float:
    scheduler.step(step - scheduler.num_steps)
    return scheduler.get_lr()


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_linear_warmup_from_init_lr(style):
    scheduler = _scheduler(style)
    assert scheduler.get_lr() == pytest.approx(INIT_LR)
    assert _lr_at(scheduler, 5) == pytest.approx(5.5e-4)  # 1e-4 + 9e-4 * 5/10
    assert _lr_at(scheduler, WARMUP) == pytest.approx(MAX_LR)


@pytest.mark.parametrize(
    "style, step, expected",
    [
        ("constant", 60, MAX_LR),
        ("constant", 500, MAX_LR),  # no floor: constant never decays
        ("linear", 60, MIN_LR + 0.5 * DELTA),  # half-way through decay
        ("linear", 85, MIN_LR + 0.25 * DELTA),
        ("linear", DECAY, MIN_LR),
        ("cosine", 60, MIN_LR + 0.5 * DELTA),  # cos(pi / 2) = 0
        ("cosine", 35, MIN_LR + (1 + math.sqrt(0.5)) / 2 * DELTA),  # cos(pi / 4)
        ("cosine", DECAY, MIN_LR),
        ("inverse-square-root", 40, 5e-4),  # 1e-3 * sqrt(10 / 40)
        ("inverse-square-root", 90, 1e-3 / 3),  # 1e-3 * sqrt(10 / 90)
    ],
)
def test_decay_styles(style, step, expected):
    assert _lr_at(_scheduler(style), step) == pytest.approx(expected)


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root"])
def test_min_lr_after_decay(style):
    scheduler = _scheduler(style)
    assert _lr_at(scheduler, DECAY + 1) == MIN_LR
    assert _lr_at(scheduler, 10 * DECAY) == MIN_LR


def test_inverse_square_root_floors_at_min_lr():
    scheduler = _scheduler("inverse-square-root", min_lr=4e-4)
    assert _lr_at(scheduler, 40) == pytest.approx(5e-4)
    assert _lr_at(scheduler, 90) == pytest.approx(4e-4)  # 3.33e-4 is below the floor


@pytest.mark.parametrize(
    "wsd_style, coeff_at_half",
    [
        ("linear", 0.5),
        ("cosine", 0.5),
        ("exponential", math.sqrt(2) - 1),  # 2 * 0.5**0.5 - 1
        ("minus_sqrt", 1 - math.sqrt(0.5)),
    ],
)
def test_wsd_is_stable_then_decays_over_its_last_steps(wsd_style, coeff_at_half):
    # Anneals over the last 20 steps before step 110: steps 90..110.
    scheduler = _scheduler("WSD", wsd_decay_steps=20, lr_wsd_decay_style=wsd_style)
    assert _lr_at(scheduler, 30) == pytest.approx(MAX_LR)
    assert _lr_at(scheduler, 90) == pytest.approx(MAX_LR)
    assert _lr_at(scheduler, 100) == pytest.approx(MIN_LR + coeff_at_half * DELTA)
    assert _lr_at(scheduler, DECAY) == pytest.approx(MIN_LR)
    assert _lr_at(scheduler, DECAY + 5) == MIN_LR


@pytest.mark.parametrize(
    "style, step, expected",
    [
        ("linear", 25, 0.025),
        ("linear", 100, 0.1),
        ("cosine", 50, 0.05),  # cos(pi / 2) = 0
        ("cosine", 25, 0.1 * (1 - math.sqrt(0.5)) / 2),  # cos(3 pi / 4)
        ("cosine", 150, 0.1),
    ],
)
def test_weight_decay_increment(style, step, expected):
    scheduler = _scheduler(wd_incr_style=style)
    scheduler.step(step)
    assert scheduler.get_wd() == pytest.approx(expected)


def test_constant_weight_decay():
    scheduler = _scheduler(start_wd=0.05, end_wd=0.05, wd_incr_style="constant")
    scheduler.step(50)
    assert scheduler.get_wd() == 0.05


def test_param_groups_get_lr_and_wd_times_wd_mult():
    scheduler = _scheduler()
    scheduler.step(60)
    weights, biases = scheduler.optimizer.param_groups
    assert weights["lr"] == biases["lr"] == pytest.approx(MIN_LR + 0.5 * DELTA)
    assert weights["weight_decay"] == pytest.approx(0.06)
    assert biases["weight_decay"] == 0.0


def test_state_dict_round_trip():
    scheduler = _scheduler("cosine")
    scheduler.step(37)
    state = scheduler.state_dict()
    restored = _scheduler("cosine")
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert restored.get_lr() == scheduler.get_lr()
    assert restored.optimizer.param_groups[0]["lr"] == scheduler.get_lr()
    scheduler.step(1)
    restored.step(1)
    assert restored.get_lr() == scheduler.get_lr()
    assert restored.get_wd() == scheduler.get_wd()
    del state["num_steps"]
    with pytest.raises(ValueError, match="num_steps"):
        restored.load_state_dict(state)


def test_loading_another_schedule_needs_a_choice():
    """Megatron-LM's rule: a checkpoint's schedule that differs from the arguments is an error
    unless the checkpoint's is taken or the arguments' kept explicitly."""
    saved = _scheduler("cosine")
    saved.step(37)
    state = saved.state_dict()
    with pytest.raises(ValueError, match=r"lr_decay_style \(--lr-decay-style\): 'linear' here"):
        _scheduler("linear", max_lr=5e-3, min_lr=0.0).load_state_dict(state)
    taken = _scheduler("linear", max_lr=5e-3, min_lr=0.0, use_checkpoint_opt_param_scheduler=True)
    taken.load_state_dict(state)
    assert taken.state_dict() == state and taken.get_lr() == saved.get_lr()
    kept = _scheduler("linear", max_lr=5e-3, min_lr=0.0, override_opt_param_scheduler=True)
    kept.load_state_dict(state)
    assert (kept.num_steps, kept.lr_decay_style, kept.max_lr) == (37, "linear", 5e-3)
    with pytest.raises(ValueError, match="both"):
        _scheduler(use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=True)


def test_every_saved_value_but_the_free_ones_is_checked_on_resume():
    """A value added to the state dict is compared with the checkpoint's unless it is one of
    those a resumed run may change (the step count, the WSD decay), as Megatron-LM."""
    free = {"num_steps", "wsd_decay_steps", "lr_wsd_decay_style"}
    assert set(_CHECKED_FLAGS) | free == set(_STATE_KEYS)
    assert not set(_CHECKED_FLAGS) & free


def test_a_resumed_wsd_run_may_choose_its_decay():
    """As Megatron-LM (which saves neither): the WSD decay's length and style are this run's,
    and they never matter to another decay style. Before: refused without a flag."""
    saved = _scheduler("WSD", wsd_decay_steps=20, lr_wsd_decay_style="linear")
    saved.step(50)
    state = saved.state_dict()
    resumed = _scheduler("WSD", wsd_decay_steps=40, lr_wsd_decay_style="cosine")
    resumed.load_state_dict(state)
    assert (resumed.wsd_decay_steps, resumed.lr_wsd_decay_style) == (40, "cosine")
    assert resumed.get_lr() == MAX_LR  # still stable at step 50 of 110
    assert _lr_at(resumed, 90) == pytest.approx(MIN_LR + DELTA * 0.5 * (1 + math.cos(math.pi / 2)))
    cosine = _scheduler("cosine")
    cosine.step(5)
    _scheduler("cosine", wsd_decay_steps=8, lr_wsd_decay_style="linear").load_state_dict(
        cosine.state_dict()
    )


def _decoupled_scheduler(bounds: dict, **kwargs) -> OptimizerParamScheduler:
    """A scheduler over a plain group and a group with its own `bounds` (--decoupled-lr's)."""
    weight, embedding = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD(
        [{"params": [weight], "wd_mult": 1.0}, {"params": [embedding], "wd_mult": 1.0, **bounds}],
        lr=1.0,
    )
    return _scheduler("cosine", optimizer=optimizer, **kwargs)


def _saved_groups(scheduler: OptimizerParamScheduler) -> list[dict]:
    return [
        {k: v for k, v in group.items() if k != "params"}
        for group in scheduler.optimizer.param_groups
    ]


def test_loading_other_decoupled_bounds_needs_a_choice():
    """A group's own bounds are part of the schedule: changed, they are refused naming the
    flag and both values, unless the arguments' are kept (override) or the checkpoint's taken."""
    saved = _decoupled_scheduler({"max_lr": 2e-2, "min_lr": 2e-3})
    saved.step(37)
    state, groups = saved.state_dict(), _saved_groups(saved)
    changed = {"max_lr": 5e-2}
    with pytest.raises(ValueError) as error:
        _decoupled_scheduler(changed).load_state_dict(state, groups)
    message = str(error.value)
    assert "--decoupled-lr: 0.05 here, 0.02 in the checkpoint" in message
    # No --decoupled-min-lr: the group follows --min-lr.
    assert f"--decoupled-min-lr: {MIN_LR!r} here, 0.002 in the checkpoint" in message
    assert "--override-opt_param-scheduler" in message
    assert "--use-checkpoint-opt_param-scheduler" in message
    kept = _decoupled_scheduler(changed, override_opt_param_scheduler=True)
    kept.load_state_dict(state, groups)
    group = kept.optimizer.param_groups[1]
    assert (group["max_lr"], "min_lr" in group) == (5e-2, False)
    assert group["lr"] == pytest.approx(kept.get_lr(group)) and kept.get_lr(group) > 2e-2
    taken = _decoupled_scheduler(changed, use_checkpoint_opt_param_scheduler=True)
    taken.load_state_dict(state, groups)
    group = taken.optimizer.param_groups[1]
    assert (group["max_lr"], group["min_lr"]) == (2e-2, 2e-3)
    assert group["lr"] == saved.optimizer.param_groups[1]["lr"]


def test_a_decoupled_min_lr_equal_to_min_lr_is_no_change():
    saved = _decoupled_scheduler({"max_lr": 2e-2})
    state, groups = saved.state_dict(), _saved_groups(saved)
    _decoupled_scheduler({"max_lr": 2e-2, "min_lr": MIN_LR}).load_state_dict(state, groups)
    with pytest.raises(ValueError, match="--decoupled-min-lr: 0.0002 here, 1e-05 in the"):
        _decoupled_scheduler({"max_lr": 2e-2, "min_lr": 2e-4}).load_state_dict(state, groups)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr_warmup_steps=DECAY), "lr_warmup_steps"),
        (dict(min_lr=2e-3), "min_lr"),
        (dict(init_lr=2e-3), "init_lr"),
        (dict(lr_decay_style="step"), "lr_decay_style='step'"),
        (dict(lr_decay_style="WSD", lr_wsd_decay_style="linear"), "wsd_decay_steps"),
        (dict(lr_decay_style="WSD", wsd_decay_steps=5), "lr_wsd_decay_style=None"),
        (dict(wd_incr_style="constant"), "start_wd == end_wd"),
        (dict(start_wd=0.2), "start_wd"),
        (dict(wd_incr_steps=0), "wd_incr_steps > 0"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _scheduler(**kwargs)
