"""Optimizer, regularization and learning-rate flags."""

from __future__ import annotations

import argparse

from megatron.core.optimizer_param_scheduler import (
    LR_DECAY_STYLES,
    LR_WSD_DECAY_STYLES,
    WD_INCR_STYLES,
)


def add_regularization_args(parser: argparse.ArgumentParser) -> None:
    """The "regularization" group: dropout, weight decay, clipping, optimizer hyper-parameters."""
    group = parser.add_argument_group(title="regularization")
    group.add_argument(
        "--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities."
    )
    group.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.1,
        help="Dropout on embeddings and residual branches.",
    )
    group.add_argument("--weight-decay", type=float, default=0.01, help="Constant weight decay.")
    group.add_argument("--start-weight-decay", type=float, help="Weight decay at iteration 0.")
    group.add_argument("--end-weight-decay", type=float, help="Weight decay at the end.")
    group.add_argument(
        "--weight-decay-incr-style",
        default="constant",
        choices=WD_INCR_STYLES,
        help="From --start- to --end-weight-decay.",
    )
    group.add_argument("--clip-grad", type=float, default=1.0, help="Max global grad norm.")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    group.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")


def add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    """The "learning rate" group: the schedule."""
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, help="Peak learning rate.")
    group.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=LR_DECAY_STYLES,
        help="Decay after warmup.",
    )
    group.add_argument("--lr-decay-iters", type=int, help="None: --train-iters.")
    group.add_argument(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=LR_WSD_DECAY_STYLES,
        help="Decay of the WSD annealing phase.",
    )
    group.add_argument("--lr-wsd-decay-iters", type=int, help="WSD annealing iterations.")
    group.add_argument(
        "--lr-warmup-iters", type=int, default=0, help="Iterations of linear warmup."
    )
    group.add_argument(
        "--lr-warmup-init", type=float, default=0.0, help="Learning rate warmup starts from."
    )
    group.add_argument(
        "--min-lr", type=float, default=0.0, help="Learning rate never decays below this."
    )
    group.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        help="On loading, keep these flags' schedule (the checkpoint's step count only).",
    )
    group.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="On loading, take the checkpoint's schedule over these flags.",
    )
