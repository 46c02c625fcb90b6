"""Checkpoint flags: where to save and load, and what."""

from __future__ import annotations

import argparse

from megatron.training.arguments_validation import CKPT_FORMATS


def add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    """The "checkpointing" group."""
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", help="Checkpoint directory to save to.")
    group.add_argument(
        "--save-interval", type=int, help="Iterations between saves (and one at the end)."
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
        "--finetune",
        action="store_true",
        help="Load the weights only and start at iteration 0 (a new run from them).",
    )
    group.add_argument(
        "--ckpt-format",
        default="torch_dist",
        choices=CKPT_FORMATS,
        help="Checkpoint format: fsdp_dtensor (Megatron-FSDP) or torch_dist; both are "
        "torch.distributed.checkpoint directories.",
    )
