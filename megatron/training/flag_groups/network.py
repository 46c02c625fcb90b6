"""Model flags: the network's size and shape, and its initialisation."""

from __future__ import annotations

import argparse

from megatron.core.models.common.embeddings.language_model_embedding import (
    POSITION_EMBEDDING_TYPES,
)
from megatron.core.transformer.transformer_config import NORMALIZATIONS


def add_network_size_args(parser: argparse.ArgumentParser) -> None:
    """The "network size" group: layers, widths, heads, positions, norms."""
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, help="Number of transformer layers.")
    group.add_argument("--hidden-size", type=int, help="Transformer hidden size.")
    group.add_argument(
        "--ffn-hidden-size",
        type=int,
        help="MLP width; None: 4 x hidden, or int(4 x hidden x 2/3 / 64) x 64 with --swiglu.",
    )
    group.add_argument("--num-attention-heads", type=int, help="Number of query heads.")
    group.add_argument("--kv-channels", type=int, help="Head width; None: hidden / heads.")
    group.add_argument("--group-query-attention", action="store_true", help="Use GQA.")
    group.add_argument("--num-query-groups", type=int, help="Key/value heads with GQA.")
    group.add_argument(
        "--max-position-embeddings", type=int, help="Learned position rows; None: --seq-length."
    )
    group.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=POSITION_EMBEDDING_TYPES,
        help="Position encoding.",
    )
    group.add_argument("--rotary-base", type=int, default=10000, help="RoPE base period.")
    group.add_argument(
        "--rotary-percent", type=float, default=1.0, help="Fraction of head channels RoPE rotates."
    )
    group.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128, help="Pad the vocabulary."
    )
    group.add_argument(
        "--normalization", default="LayerNorm", choices=NORMALIZATIONS, help="Norm layers."
    )
    group.add_argument("--norm-epsilon", type=float, default=1e-5, help="Norm epsilon.")
    group.add_argument(
        "--apply-residual-connection-post-layernorm",
        action="store_true",
        help="Residual from the layer norm's output instead of its input.",
    )
    group.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated, SiLU).")
    group.add_argument(
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help="No bias in the linear layers (add_bias_linear, default %(default)s).",
    )
    group.add_argument("--add-qkv-bias", action="store_true", help="Bias in the QKV linear.")
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Own output layer instead of the word embeddings.",
    )
    group.add_argument(
        "--transformer-impl",
        default="local",
        choices=("local", "transformer_engine"),
        help="PyTorch layers, or Transformer Engine's (CUDA).",
    )


def add_initialization_args(parser: argparse.ArgumentParser) -> None:
    """The "initialization" group: seed and weight initialisation."""
    group = parser.add_argument_group(title="initialization")
    group.add_argument("--seed", type=int, default=1234, help="Random seed.")
    group.add_argument(
        "--init-method-std", type=float, default=0.02, help="Std of the normal weight init."
    )
