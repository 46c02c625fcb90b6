"""Mixed-precision flags."""

from __future__ import annotations

import argparse


def add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    """The "mixed precision" group."""
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true", help="Not supported yet: use --bf16.")
    group.add_argument("--bf16", action="store_true", help="bf16 parameters and compute.")
    group.add_argument(
        "--grad-reduce-in-fp32",
        action="store_true",
        help="Accumulate and reduce gradients in fp32.",
    )
