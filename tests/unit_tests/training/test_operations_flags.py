"""Operations flags: the profiler writes traces of the given steps on the given ranks, manual
garbage collection runs where Megatron-LM's does, TensorBoard scalars are written under
Megatron-LM's tag names, `--logging-level` applies, and what is not built is refused."""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import logging
import math
import os
import re
from collections.abc import Iterator

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.flag_groups.logs import set_logging_level
from megatron.training.profiling import TrainingOperations
from megatron.training.utils import logger
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.test_pretrain_gpt import TINY, _pretrain


def test_pytorch_profiler_traces_the_given_steps_and_ranks(tmp_path):
    tensorboard = tmp_path / "tb"
    flags = [
        *TINY,
        *"--global-batch-size 8 --train-iters 5 --profile --use-pytorch-profiler".split(),
        *"--profile-step-start 2 --profile-step-end 4 --profile-ranks 1".split(),
        "--tensorboard-dir",
        str(tensorboard),
    ]
    run_distributed(_pretrain, 2, flags)
    traces = tmp_path / "torch_profile"
    assert sorted(os.listdir(traces)) == ["rank-1.json.gz"]
    with gzip.open(traces / "rank-1.json.gz", "rt") as file:
        events = json.load(file)["traceEvents"]
    steps = {
        int(m.group(1))
        for event in events
        if (m := re.fullmatch(r"ProfilerStep#(\d+)", event.get("name", "")))
    }
    # Megatron-LM's schedule: iterations start .. end - 1.
    assert steps == {2, 3}


def _gc_args(**overrides) -> argparse.Namespace:
    args = parse_args(args=[*TINY, "--manual-gc"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@contextlib.contextmanager
def _collections() -> Iterator[list[int]]:
    """The generation of each garbage collection that starts inside the block, in order."""
    collections: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(on_gc)
    try:
        yield collections
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()


def test_manual_gc_collects_at_megatron_points():
    args = _gc_args(manual_gc_interval=2)
    with _collections() as collections:
        with TrainingOperations(args) as operations:
            assert not gc.isenabled()
            assert collections == [2]  # a full collection when training starts
            for iteration in (1, 2, 3):
                operations.before_iteration(iteration)
                operations.after_iteration(iteration, last=False)
            assert collections == [2, 2]  # iteration 2
            with operations.evaluation():
                assert collections == [2, 2, 2]
            assert collections == [2, 2, 2, 0]  # the evaluation's own garbage
        assert gc.isenabled()


def test_manual_gc_eval_can_be_turned_off():
    args = _gc_args(manual_gc_eval=False)
    with _collections() as collections:
        with TrainingOperations(args) as operations:
            with operations.evaluation():
                pass
            operations.after_iteration(4, last=True)
        assert collections == [2]


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--profile", "--profile without --use-pytorch-profiler"),
        # Refused on every rank, not only on the profiled one.
        ("--profile --profile-ranks 1", "--profile without --use-pytorch-profiler"),
        ("--record-memory-history", "--record-memory-history"),
    ],
)
def test_nsys_profile_and_memory_history_need_cuda(flags, message):
    args = parse_args(args=[*TINY, "--distributed-backend", "gloo", *flags.split()])
    with pytest.raises(ValueError, match=message):
        validate_args(args, world_size=2)


def test_tensorboard_scalars_under_megatron_tags(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    flags = [
        *TINY,
        *"--global-batch-size 8 --eval-interval 2 --eval-iters 1".split(),
        *"--log-timers-to-tensorboard --log-validation-ppl-to-tensorboard".split(),
        "--log-world-size-to-tensorboard",
        *"--log-params-norm --log-num-zeros-in-grad".split(),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    ]
    history = run_distributed(_pretrain, 2, flags)[0]["history"]
    accumulator = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()

    def series(tag: str) -> dict[int, float]:
        return {event.step: event.value for event in accumulator.Scalars(tag)}

    iterations = range(1, 5)
    losses = dict(zip(iterations, history.loss_curve()))
    assert series("lm loss") == pytest.approx(losses)
    assert series("lm loss vs samples") == pytest.approx({8 * i: losses[i] for i in iterations})
    assert series("grad-norm") == pytest.approx(dict(zip(iterations, history.grad_norms)))
    assert series("learning-rate") == pytest.approx(dict(zip(iterations, history.learning_rates)))
    assert series("batch-size") == {i: 8 for i in iterations}
    assert series("world-size") == {i: 2 for i in iterations}
    assert series("loss-scale") == {i: 1.0 for i in iterations}
    assert set(series("iteration-time")) == {2, 4}
    # Their values are checked against one process in tests/unit_tests/optimizer.
    assert set(series("params-norm")) == set(series("num-zeros")) == set(iterations)
    assert all(norm > 0 for norm in series("params-norm").values())
    # The periodic evaluations only: the end-of-training one, on other batches, is logged but
    # would be a second point at step 4 (Megatron-LM writes it there too).
    assert history.final_validation_losses != history.validation_losses[4]
    _assert_validation_points(accumulator, history.validation_losses)


def _assert_validation_points(accumulator, expected: dict[int, dict[str, float]]) -> None:
    """Every scalar tag of the event file has one point per step, and the validation tags hold
    `expected` (step -> losses) in step order."""
    for tag in accumulator.Tags()["scalars"]:
        steps = [event.step for event in accumulator.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)

    def events(tag: str) -> list[tuple[int, float]]:
        return [(event.step, event.value) for event in accumulator.Scalars(tag)]

    validation = [(i, losses["lm loss"]) for i, losses in sorted(expected.items())]
    for tag, values in (
        ("lm loss validation", [v for _, v in validation]),
        ("lm loss validation ppl", [math.exp(v) for _, v in validation]),
    ):
        assert [step for step, _ in events(tag)] == [i for i, _ in validation]
        assert [value for _, value in events(tag)] == pytest.approx(values)


def test_end_of_training_validation_is_written_when_the_last_iteration_was_not(tmp_path):
    """--eval-interval 2 of 3 iterations: the point at 3 is the end-of-training validation's."""
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    flags = [
        *TINY,
        *"--global-batch-size 4 --train-iters 3 --eval-interval 2 --eval-iters 1".split(),
        *"--log-validation-ppl-to-tensorboard --tensorboard-dir".split(),
        str(tmp_path / "tb"),
    ]
    history = run_distributed(_pretrain, 1, flags)[0]["history"]
    accumulator = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert list(history.validation_losses) == [2]
    _assert_validation_points(
        accumulator, {**history.validation_losses, 3: history.final_validation_losses}
    )


def _logging_level_run(flags: list[str]) -> tuple[int, list[str]]:
    """The root logger's level after a run, and the run's log. (The training loop's own level
    is seen in the log only: `capture_training_log` restores it when the run ends.)"""
    root_level, own_level = logging.getLogger().level, logger.level
    try:
        log = _pretrain(flags)["log"]
        return logging.getLogger().level, log
    finally:
        logging.getLogger().setLevel(root_level)
        logger.setLevel(own_level)


def test_logging_level_hides_messages_but_not_the_training_report():
    """At --logging-level 40 (ERROR, as upstream's CI configs pass it) the INFO messages are
    hidden, while the report Megatron-LM prints shows: the iteration lines, the periodic and
    end-of-training evaluations."""
    flags = [*TINY, *"--global-batch-size 2 --eval-interval 2 --eval-iters 1".split()]
    root, log = run_distributed(_logging_level_run, 1, [*flags, "--logging-level", "40"])[0]
    assert root == 40
    assert [m.split(" |")[0] for m in log if m.startswith("iteration ")] == [
        f"iteration {i:8d}/       4" for i in (1, 2, 4)
    ]
    assert "lm loss: " in next(m for m in log if m.startswith("iteration "))
    for evaluation in (
        "validation loss at iteration 2",
        "validation loss at iteration 4",
        "validation loss at the end of training",
        "test loss at the end of training",
    ):
        assert sum(f" {evaluation} | lm loss value: " in m for m in log) == 1, (evaluation, log)
    assert not any(m.startswith("> training") for m in log)  # an INFO message
    # Without the flag, the same run shows that INFO message: the level is what hid it.
    _, default_log = run_distributed(_logging_level_run, 1, flags)[0]
    assert "> training ..." in default_log


@pytest.mark.parametrize(
    "flag, environment, expected",
    [("30", None, 30), (None, "10", 10), ("40", "10", 40), (None, None, None)],
)
def test_logging_level_flag_wins_over_the_environment(monkeypatch, flag, environment, expected):
    if environment is None:
        monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", environment)
    args = parse_args(args=[*TINY, *(["--logging-level", flag] if flag else [])])
    root, own = logging.getLogger(), logger
    before = (root.level, own.level)
    try:
        set_logging_level(args)
        assert (root.level, own.level) == (before if expected is None else (expected, expected))
    finally:
        root.setLevel(before[0])
        own.setLevel(before[1])


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--timing-log-level 1", "--timing-log-level 1"),
        ("--tensorboard-queue-size 0", "--tensorboard-queue-size 0"),
        ("--pytorch-profiler-collect-chakra", "--pytorch-profiler-collect-chakra"),
        ("--manual-gc --manual-gc-interval -1", "--manual-gc-interval -1"),
        ("--log-straggler", "--log-straggler"),
        ("--log-progress", "--log-progress"),
        ("--profile --profile-step-start 5 --profile-step-end 5", "--profile-step-start 5"),
        ("--profile --profile-ranks 3", "--profile-ranks 3"),
        ("--manual-gc-interval 5", "--manual-gc-interval needs --manual-gc"),
        ("--nvtx-ranges", "--nvtx-ranges"),
        ("--wandb-entity team", "--wandb-entity needs --wandb-project"),
        ("--logging-level 99", "--logging-level 99"),
    ],
)
def test_bad_or_unbuilt_operations_flags_are_refused(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_args(parse_args(args=[*TINY, *flags.split()]), world_size=1)


def test_upstream_operations_flags_parse_with_upstream_defaults():
    args = parse_args(args=TINY)
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (10, 12, [])
    assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval) == (False, 0, True)
    assert args.empty_unused_memory_level == 0
    assert (args.tensorboard_queue_size, args.timing_log_option) == (1000, "minmax")
    assert args.log_loss_scale_to_tensorboard and args.memory_snapshot_path == "snapshot.pickle"
