"""Logging flags: the log line, TensorBoard and Weights & Biases (Megatron-LM's "logging"
group; the flags of its unbuilt features, such as `--log-straggler`, are refused in
`flag_groups.unbuilt`), `validate_logging`, and `set_logging_level`."""

from __future__ import annotations

import argparse
import logging
import os

from megatron.training.utils import logger


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """The "logging" group."""
    group = parser.add_argument_group(title="logging")
    group.add_argument(
        "--log-interval", type=int, default=100, help="Iterations between log lines."
    )
    group.add_argument("--log-throughput", action="store_true", help="TFLOP/s and tokens/s.")
    group.add_argument(
        "--timing-log-level",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="0: iteration time only (the only level built).",
    )
    group.add_argument(
        "--timing-log-option",
        default="minmax",
        choices=("max", "minmax", "all"),
        help="How per-rank timers are reduced; used by timing levels 1 and 2 (not built).",
    )
    group.add_argument("--tensorboard-dir", help="Write TensorBoard event files here.")
    group.add_argument(
        "--tensorboard-log-interval", type=int, default=1, help="Iterations between writes."
    )
    group.add_argument(
        "--tensorboard-queue-size",
        type=int,
        default=1000,
        help="Events TensorBoard's writer queues before it flushes to disk.",
    )
    group.add_argument(
        "--log-timers-to-tensorboard",
        action="store_true",
        help="Write 'iteration-time' (and 'throughput' with --log-throughput).",
    )
    group.add_argument(
        "--no-log-loss-scale-to-tensorboard",
        "--disable-log-loss-scale-to-tensorboard",
        action="store_false",
        dest="log_loss_scale_to_tensorboard",
        help="Do not write 'loss-scale' (always 1.0 here: no loss scaling).",
    )
    group.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Also write '<loss> validation ppl'.",
    )
    group.add_argument(
        "--log-memory-to-tensorboard",
        action="store_true",
        help="Write CUDA allocator statistics ('mem-*'); GPU only.",
    )
    group.add_argument(
        "--log-world-size-to-tensorboard", action="store_true", help="Write 'world-size'."
    )
    group.add_argument(
        "--log-params-norm",
        action="store_true",
        help="Log the main weights' global L2 norm after each step ('params-norm').",
    )
    group.add_argument(
        "--log-num-zeros-in-grad",
        action="store_true",
        help="Log the number of zero gradient elements of each step ('num-zeros').",
    )
    group.add_argument("--wandb-project", help="Needs the wandb package.")
    group.add_argument("--wandb-exp-name", help="Run name.")
    group.add_argument("--wandb-save-dir", help="Where wandb keeps its files locally.")
    group.add_argument("--wandb-entity", help="The wandb team or user owning the project.")
    group.add_argument(
        "--logging-level",
        type=int,
        help="Python logging level of the root logger (10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR).",
    )


def validate_logging(args: argparse.Namespace) -> None:
    """Checks the logging flags (those of unbuilt features are refused in `flag_groups.unbuilt`).

    Raises:
        ValueError: a timing level that is not built, an interval or level out of range, or a
            wandb option without `--wandb-project`.
    """
    if args.timing_log_level != 0:
        raise ValueError(
            f"--timing-log-level {args.timing_log_level}: only level 0 (iteration time) is "
            "built; the per-operation timers of levels 1 and 2 are not. Use --profile with "
            "--use-pytorch-profiler to see where time goes, or drop the flag."
        )
    if args.tensorboard_queue_size < 1:
        raise ValueError(
            f"--tensorboard-queue-size {args.tensorboard_queue_size} must be at least 1."
        )
    if args.logging_level is not None and args.logging_level not in range(0, 51):
        raise ValueError(
            f"--logging-level {args.logging_level}: give a Python logging level from 0 to 50 "
            "(10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR, 50 CRITICAL)."
        )
    if args.wandb_project is None:
        for dest in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
            if getattr(args, dest) is not None:
                flag = "--" + dest.replace("_", "-")
                raise ValueError(f"{flag} needs --wandb-project (the run it configures).")


def set_logging_level(args: argparse.Namespace) -> None:
    """Applies `--logging-level`, else the `MEGATRON_LOGGING_LEVEL` environment variable, to the
    root logger and the training loop's (Megatron-LM's `setup_logging`); without either the
    levels are left as they are. The training report (`report_logger`) keeps its own level:
    Megatron-LM prints it, whatever the level."""
    level = os.environ.get("MEGATRON_LOGGING_LEVEL")
    level = args.logging_level if args.logging_level is not None else level
    if level is None:
        return
    logging.getLogger().setLevel(int(level))
    # Megatron-LM's loggers inherit the root's level; this one has its own (setup_logging).
    logger.setLevel(int(level))
