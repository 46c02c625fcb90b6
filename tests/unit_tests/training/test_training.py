"""`pretrain()` in this process, as a world of one: datasets shorter than the run needs are
refused, and an error anywhere leaves no process group and no data-loader worker behind (the
original error is raised even when tearing down fails too)."""

from __future__ import annotations

import itertools
import multiprocessing

import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.core import parallel_state
from megatron.core.datasets import MockGPTDataset
from megatron.core.enums import ModelType
from megatron.training import initialize, training, training_loop
from megatron.training.arguments import parse_args, validate_args
from megatron.training.training import build_train_valid_test_data_iterators, pretrain
from tests.unit_tests.training.log_capture import capture_training_log

FLAGS = (
    "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-2 --mock-data "
    "--vocab-size 32 --eval-iters 1 --eval-interval 2 --num-workers 0 --distributed-backend gloo"
).split()
"""Needs 12 train, 2 x 1 x 4 = 8 validation and 4 test samples."""


@pytest.mark.parametrize(
    "sizes, message",
    [
        ((11, 8, 4), "The train dataset has 11 samples, but the run needs 12 "),
        ((12, 7, 4), r"The validation dataset has 7 samples, but the run needs 8 \(\(--train"),
        ((12, 8, 3), "The test dataset has 3 samples, but the run needs 4 "),
    ],
)
def test_datasets_shorter_than_the_run_are_refused(sizes, message):
    args = validate_args(parse_args(args=FLAGS), world_size=1)
    assert args.train_iters * args.global_batch_size == 12

    def provider(num_samples: list[int]) -> tuple[MockGPTDataset, ...]:
        assert num_samples == [12, 8, 4]
        return tuple(MockGPTDataset(n, args.seq_length, args.vocab_size) for n in sizes)

    with pytest.raises(ValueError, match=message):
        build_train_valid_test_data_iterators(provider, args)


def _pretrain(flags: list[str], forward_step=pretrain_gpt.forward_step, model_provider=None):
    return pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        model_provider or pretrain_gpt.model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        argv=flags,
    )


def test_trains_as_a_world_of_one(world_of_one):
    assert len(_pretrain(FLAGS).losses) == 3
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()


def test_error_in_initialize_leaves_no_process_group(world_of_one, monkeypatch):
    """After the default group exists, before training: the group must not leak."""

    def fail(seed: int) -> None:
        assert dist.is_initialized()
        raise RuntimeError("seeding failed")

    monkeypatch.setattr(initialize, "_set_random_seed", fail)
    with pytest.raises(RuntimeError, match="seeding failed"):
        _pretrain(FLAGS)
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()


def test_failing_teardown_is_logged_and_the_original_error_raised(world_of_one, monkeypatch):
    def model_provider(**kwargs):
        raise ValueError("no model")

    def destroy_then_fail(destroy_default_group: bool) -> None:
        initialize.destroy_megatron(destroy_default_group)
        raise RuntimeError("teardown failed")

    monkeypatch.setattr(training, "destroy_megatron", destroy_then_fail)
    with capture_training_log() as messages, pytest.raises(ValueError, match="no model"):
        _pretrain(FLAGS, model_provider=model_provider)
    assert any("tearing down after an error failed too" in m for m in messages), messages
    assert not dist.is_initialized()


def test_error_in_training_stops_the_data_loader_workers(world_of_one):
    calls = itertools.count()

    def forward_step(data_iterator, model):
        if next(calls) == 2:
            raise RuntimeError("forward failed")
        return pretrain_gpt.forward_step(data_iterator, model)

    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="forward failed") as error:
        _pretrain([*FLAGS, "--num-workers", "1"], forward_step)
    # The error came out of the training loop, and `error` still holds its traceback, whose frames
    # reference the loop's iterators: the workers must have been stopped explicitly, not by
    # garbage collection.
    assert any(entry.name == "train" for entry in error.traceback)
    leftover = set(multiprocessing.active_children()) - before
    assert not leftover, f"data-loader workers still running: {leftover}"


@pytest.mark.parametrize("where", ["data", "exit-check"])
def test_an_error_after_a_step_read_later_leaves_the_schedule_level_with_the_state(
    world_of_one, monkeypatch, where
):
    """The loop reads an optimizer step's outcome at the next iteration, stepping the schedule
    then. An error before that read still leaves the schedule stepped for every iteration the
    state counts, for a caller that catches it and saves: iteration 3's data failing after
    iteration 2's step (the first read later), or iteration 2's exit check failing before
    iteration 2 is recorded."""
    made = {}

    def setup_model_and_optimizer(*args, **kwargs):
        made["model"], made["optimizer"], made["scheduler"] = setup(*args, **kwargs)
        return made["model"], made["optimizer"], made["scheduler"]

    def training_log(args, config, device, train_state):
        made["state"] = train_state
        return log_class(args, config, device, train_state)

    setup, log_class = training.setup_model_and_optimizer, training.TrainingLog
    monkeypatch.setattr(training, "setup_model_and_optimizer", setup_model_and_optimizer)
    monkeypatch.setattr(training, "TrainingLog", training_log)
    calls = itertools.count()

    def forward_step(data_iterator, model):
        if next(calls) == 4 and where == "data":  # iteration 3's first microbatch of 2
            raise ValueError("a bad batch")
        return pretrain_gpt.forward_step(data_iterator, model)

    def exit_reason(loop, iteration):
        if iteration == 2:
            raise ValueError("a failed exit check")
        return exit_check(loop, iteration)

    exit_check = training_loop._TrainingLoop.exit_reason
    if where == "exit-check":
        monkeypatch.setattr(training_loop._TrainingLoop, "exit_reason", exit_reason)
    with pytest.raises(ValueError, match="a bad batch|a failed exit check"):
        _pretrain([*FLAGS, "--eval-iters", "0"], forward_step)
    assert made["optimizer"].steps_without_host_sync  # iteration 2's step was read later
    state, scheduler = made["state"], made["scheduler"]
    assert state.iteration == 2
    assert scheduler.num_steps == state.consumed_train_samples == 8
