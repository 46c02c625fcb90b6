"""Logging flags: the log line, TensorBoard and Weights & Biases."""

from __future__ import annotations

import argparse


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """The "logging" group."""
    group = parser.add_argument_group(title="logging")
    group.add_argument(
        "--log-interval", type=int, default=100, help="Iterations between log lines."
    )
    group.add_argument("--log-throughput", action="store_true", help="TFLOP/s and tokens/s.")
    group.add_argument("--tensorboard-dir", help="Needs the tensorboard package.")
    group.add_argument(
        "--tensorboard-log-interval", type=int, default=1, help="Iterations between writes."
    )
    group.add_argument("--wandb-project", help="Needs the wandb package.")
    group.add_argument("--wandb-exp-name", help="Run name.")
