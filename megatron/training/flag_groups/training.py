"""Training-loop flags: batch, iterations, recompute, optimizer choice, validation."""

from __future__ import annotations

import argparse

from megatron.core.optimizer.optimizer_config import OPTIMIZERS


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The "training" group: batch sizes, iterations, recompute, optimizer choice."""
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, help="Sequences per rank per forward.")
    group.add_argument(
        "--global-batch-size", type=int, help="Sequences per step; None: micro x data-parallel."
    )
    group.add_argument("--train-iters", type=int, help="Optimizer steps.")
    group.add_argument("--exit-interval", type=int, help="Exit at an iteration divisible by it.")
    group.add_argument(
        "--recompute-granularity", choices=("full", "selective"), help="Activation recompute."
    )
    group.add_argument("--recompute-method", choices=("uniform", "block"), help="Only uniform.")
    group.add_argument("--recompute-num-layers", type=int, help="Layers per chunk; only 1.")
    group.add_argument("--optimizer", default="adam", choices=OPTIMIZERS, help="adam is AdamW.")
    group.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Raise on a NaN/Inf loss or global gradient norm.",
    )


def add_validation_args(parser: argparse.ArgumentParser) -> None:
    """The "validation" group."""
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-iters", type=int, default=100, help="Iterations per eval.")
    group.add_argument(
        "--eval-interval", type=int, default=1000, help="Iterations between evaluations."
    )
