"""`TrainState`, the run's progress, and `ReadOnlyArguments`: the state advances as the loop
does, goes through a checkpoint exactly (a resumed run ends with the uninterrupted run's
counts, its FLOPs so far included), loads from a checkpoint saved before its newer entries
existed, and `pretrain()` leaves the arguments as setup made them."""

from __future__ import annotations

import copy
import pickle
import shutil
from typing import Any
from unittest import mock

import pytest

import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training import training
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.checkpoint_layout import checkpoint_dir, read_common
from megatron.training.flops import num_floating_point_operations
from megatron.training.global_vars import get_args
from megatron.training.read_only_args import ReadOnlyArguments
from megatron.training.train_state import TrainState
from tests.unit_tests.training.checkpoint_checks import edit_common

NEW_KEYS = ("num_skipped_iterations", "num_nan_iterations", "num_floating_point_operations_so_far")
"""The entries of a checkpoint's training state that older checkpoints lack."""


def test_state_advances_with_iterations_and_evaluations():
    state = TrainState()
    state.record_iteration(1, 4, 100.0)
    state.record_iteration(2, 8, 200.0)
    state.record_skipped_step({"lm loss": float("nan")})
    state.record_iteration(3, 8, 200.0)
    state.record_skipped_step({"lm loss": 1.0})  # the gradient alone was not finite
    state.record_evaluation(4)
    assert state == TrainState(
        iteration=3,
        consumed_train_samples=20,
        consumed_valid_samples=4,
        num_skipped_iterations=2,
        num_nan_iterations=1,
        num_floating_point_operations_so_far=500.0,
    )
    with pytest.raises(ValueError, match="at iteration 3, so the next is 4, not 5"):
        state.record_iteration(5, 4, 1.0)


def test_state_dict_round_trips_and_older_entries_default_to_zero():
    state = TrainState(7, 56, 8, 1, 1, 1.5e12)
    assert TrainState.from_state_dict(state.state_dict()) == state
    assert set(state.state_dict()) == {
        "iteration",
        "consumed_train_samples",
        "consumed_valid_samples",
        *NEW_KEYS,
    }
    old = {"iteration": 7, "consumed_train_samples": 56, "consumed_valid_samples": 8, "args": {}}
    assert TrainState.from_state_dict(old) == TrainState(7, 56, 8)
    with pytest.raises(ValueError, match=r"lacks \['consumed_valid_samples'\]"):
        TrainState.from_state_dict({"iteration": 7, "consumed_train_samples": 56})


def test_read_only_arguments_refuse_writes_after_freeze():
    args = ReadOnlyArguments(lr=1e-2, seq_length=16)
    args.lr = 2e-2  # before freeze(): a namespace as any
    args.freeze()
    with pytest.raises(AttributeError, match="Cannot set args.iteration: the arguments are read"):
        args.iteration = 3
    with pytest.raises(AttributeError, match="Cannot delete args.lr"):
        del args.lr
    assert vars(args) == {"lr": 2e-2, "seq_length": 16}  # the mark is no flag
    for other in (copy.copy(args), copy.deepcopy(args), pickle.loads(pickle.dumps(args))):
        assert vars(other) == vars(args) and other.frozen
        with pytest.raises(AttributeError):
            other.lr = 1.0


FLAGS = (
    "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data --vocab-size 32 "
    "--eval-iters 1 --eval-interval 2 --num-workers 0 --distributed-backend gloo "
    "--no-check-for-nan-in-loss-and-grad --log-interval 10"
).split()
"""A world of one; 2 microbatches an iteration, 4 validation samples every 2 iterations."""


def _pretrain(flags: list[str], inf_first_loss: bool) -> dict[str, Any]:
    """Runs `pretrain()` in this process; what `load_checkpoint()` returned, the arguments
    (`get_args()`) and their values when the model was built and at the last forward step.
    `inf_first_loss`: the first microbatch's loss is infinite (a skipped, nan iteration)."""
    seen: dict[str, Any] = {"loaded": None, "forward_steps": 0}
    original_load = training.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        loaded = original_load(*args, **kwargs)
        seen["loaded"] = copy.copy(loaded)  # as loaded: the loop advances `loaded`
        return loaded

    def model_provider(**kwargs):
        seen["args"] = get_args()
        seen["at_setup"] = dict(vars(get_args()))
        return pretrain_gpt.model_provider(**kwargs)

    def forward_step(data_iterator, model):
        output_tensor, loss_func = pretrain_gpt.forward_step(data_iterator, model)
        if inf_first_loss and seen["forward_steps"] == 0:
            output_tensor = output_tensor * float("inf")
        seen["forward_steps"] += 1
        seen["at_end"] = dict(vars(get_args()))
        return output_tensor, loss_func

    with mock.patch.object(training, "load_checkpoint", load_checkpoint):
        seen["history"] = training.pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            model_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            argv=[*FLAGS, *flags],
        )
    return seen


def _saved_state(root: str, iteration: int) -> TrainState:
    return TrainState.from_state_dict(read_common(checkpoint_dir(root, iteration)))


def test_resume_continues_the_counts_and_args_stay_as_set_up(world_of_one, tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run = _pretrain(["--train-iters", "4", "--save", straight], inf_first_loss=True)
    assert run["history"].skipped_iterations == [1]

    # pretrain() reads the arguments only: as set up when the model was built, frozen.
    args = run["args"]
    assert isinstance(args, ReadOnlyArguments) and args.frozen
    assert run["at_end"] == run["at_setup"] == vars(args)
    assert not {"iteration", "consumed_train_samples", "consumed_valid_samples"} & set(vars(args))
    with pytest.raises(AttributeError, match="read-only after initialize_megatron"):
        args.train_iters = 8

    per_iteration = num_floating_point_operations(
        core_transformer_config_from_args(args), args.padded_vocab_size, 8, 4
    )
    expected = TrainState(
        iteration=4,
        consumed_train_samples=16,
        consumed_valid_samples=8,  # evaluations after iterations 2 and 4
        num_skipped_iterations=1,
        num_nan_iterations=1,
        num_floating_point_operations_so_far=4 * per_iteration,
    )
    assert _saved_state(straight, 4) == expected

    _pretrain(["--train-iters", "4", "--exit-interval", "2", "--save", split], True)
    older = str(tmp_path / "older")
    shutil.copytree(split, older)
    resumed = _pretrain(["--train-iters", "4", "--load", split, "--save", split], False)
    assert resumed["loaded"] == TrainState(2, 8, 4, 1, 1, 2 * per_iteration)
    assert _saved_state(split, 4) == expected  # exactly: the FLOPs are summed in one order

    # A checkpoint saved before the newer entries existed loads, those starting at 0.
    edit_common(checkpoint_dir(older, 2), lambda common: [common.pop(k) for k in NEW_KEYS])
    flags = ["--train-iters", "4", "--exit-interval", "3", "--load", older, "--save", older]
    from_older = _pretrain(flags, inf_first_loss=False)
    assert from_older["loaded"] == TrainState(2, 8, 4)
    assert _saved_state(older, 3) == TrainState(3, 12, 4, 0, 0, per_iteration)
