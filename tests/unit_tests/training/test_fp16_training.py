"""`pretrain()` with `--fp16` (a world of one): overflowed steps are skipped, counted and logged,
leave the learning-rate schedule where it was, and halve the loss scale."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training.training import pretrain
from tests.unit_tests.training.log_capture import capture_training_log

INITIAL_SCALE = 2.0**40
FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 8 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 24 --lr 1e-2 --mock-data "
    "--vocab-size 64 --eval-iters 0 --num-workers 0 --distributed-backend gloo "
    "--lr-warmup-iters 20 --log-interval 24 --fp16 --hysteresis 1 "
    f"--initial-loss-scale {INITIAL_SCALE}"
).split()
"""2**40 times the gradients overflows fp16 (max 65504): the first steps are skipped."""


def test_overflowed_steps_are_skipped_counted_and_keep_the_schedule(world_of_one):
    with capture_training_log() as messages:
        history = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            argv=FLAGS,
        )
    skipped = set(history.skipped_iterations)
    iterations = range(1, 25)
    assert 1 in skipped and len(skipped) < 24  # some overflow, then training goes on
    # Hysteresis 1, window 1000: every overflow halves the scale, nothing grows it.
    for i, scale in zip(iterations, history.loss_scales, strict=True):
        halvings = sum(1 for j in skipped if j <= i)
        assert scale == INITIAL_SCALE * 0.5**halvings
    previous_lr = 0.0  # linear warmup from 0
    for i, lr, norm in zip(iterations, history.learning_rates, history.grad_norms, strict=True):
        if i in skipped:
            assert lr == previous_lr and norm is None  # the schedule did not move
        else:
            assert lr > previous_lr and norm is not None  # one warmup step further
        previous_lr = lr
    steps_taken = 24 - len(skipped)
    assert history.learning_rates[-1] == pytest.approx(1e-2 * steps_taken / 20)
    # Each skip names the scale the step ran at: the one left by the steps before it.
    for i in sorted(skipped):
        at = INITIAL_SCALE * 0.5 ** sum(1 for j in skipped if j < i)
        assert any(
            m.startswith(f"iteration {i}: skipped") and f"scale {at:g} " in m for m in messages
        )
    (line,) = [m for m in messages if m.startswith("iteration       24/")]
    assert f"loss scale: {history.loss_scales[-1]:.1f} |" in line
    assert f"number of skipped iterations: {len(skipped):3d} |" in line
    assert not dist.is_initialized()
