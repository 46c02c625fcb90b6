"""Checkpoint flags: where to save and load, and what."""

from __future__ import annotations

import argparse

from megatron.training.checkpoint_strictness import StrictHandling, loading_strictness

CKPT_FORMATS = ("fsdp_dtensor", "torch_dist")
"""Checkpoint formats `--ckpt-format` accepts (one layout: `megatron.training.checkpointing`)."""

DIST_CKPT_STRICTNESS = tuple(value.value for value in StrictHandling)
"""Upstream's `--dist-ckpt-strictness` values: what loading does about tensors only the model or
only the checkpoint has (`megatron.training.checkpoint_strictness`)."""


def add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    """The "checkpointing" group."""
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", help="Checkpoint directory to save to.")
    group.add_argument(
        "--save-interval",
        "--persistent-save-interval",  # upstream's alias
        type=int,
        help="Iterations between saves (and one at the end).",
    )
    group.add_argument("--load", help="Checkpoint directory to resume from.")
    group.add_argument(
        "--ckpt-step", type=int, help="Iteration to load; None: the tracker file's (latest)."
    )
    group.add_argument(
        "--no-load-optim", action="store_true", help="Load weights only, no optimizer state."
    )
    group.add_argument(
        "--no-load-rng", action="store_true", help="Keep the seeded RNG states on loading."
    )
    group.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="Stop with an error where --load holds no checkpoint, instead of training from "
        "scratch (the first run of a job whose --load is its --save).",
    )
    group.add_argument(
        "--finetune",
        action="store_true",
        help="Load the weights only and start at iteration 0 (a new run from them).",
    )
    group.add_argument(
        "--pretrained-checkpoint",
        help="Checkpoint directory to finetune from (as --finetune) while --load holds no "
        "checkpoint; once it holds one, a restarted job resumes from --load.",
    )
    group.add_argument(
        "--ckpt-format",
        default="torch_dist",
        choices=CKPT_FORMATS,
        help="Checkpoint format: fsdp_dtensor (Megatron-FSDP) or torch_dist; both are "
        "torch.distributed.checkpoint directories.",
    )
    group.add_argument(
        "--auto-detect-ckpt-format",
        action="store_true",
        help="Load whichever format the checkpoint has (always so here: both formats are one "
        "layout).",
    )
    group.add_argument(
        "--dist-ckpt-strictness",
        default="assume_ok_unexpected",
        choices=DIST_CKPT_STRICTNESS,
        help="Tensors only the model or only the checkpoint has, on loading: raise (the "
        "default and raise_*), log (log_unexpected, log_all: load what matches) or ignore "
        "(ignore_all).",
    )


def validate_checkpointing(args: argparse.Namespace) -> None:
    """Refuses a `--dist-ckpt-strictness` that a training run cannot honour.

    Raises:
        ValueError: a value that returns the mismatches to its caller (`return_*`).
    """
    loading_strictness(args.dist_ckpt_strictness)
