"""Multi-token prediction flags: Megatron-LM's `--mtp-num-layers` and `--mtp-loss-scaling-factor`
(`TransformerConfig.mtp_num_layers` / `mtp_loss_scaling_factor`, which check them: a depth count
of at least 1; the errors name the flags). The MTP variants not built are refused in
`flag_groups.unbuilt`."""

from __future__ import annotations

import argparse


def add_multi_token_prediction_args(parser: argparse.ArgumentParser) -> None:
    """The "multi-token prediction" group."""
    group = parser.add_argument_group(title="multi-token prediction")
    group.add_argument(
        "--mtp-num-layers",
        type=int,
        help="Multi-token prediction depths (DeepSeek-V3): depth k adds a transformer layer that "
        "predicts the token k + 1 positions ahead, sharing the embedding and the output layer.",
    )
    group.add_argument(
        "--mtp-loss-scaling-factor",
        type=float,
        default=0.1,
        help="Weight of the mean of the depths' losses in the training loss.",
    )
