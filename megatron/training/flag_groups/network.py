"""Model flags: the network's size and shape (sliding-window attention and the MLP activation
among them), and its initialisation.

`validate_network_options` refuses the position encodings and combinations that are not built
or that the model would ignore.
"""

from __future__ import annotations

import argparse

from megatron.core.models.common.embeddings.language_model_embedding import (
    POSITION_EMBEDDING_TYPES,
)
from megatron.core.transformer.transformer_config import NORMALIZATIONS
from megatron.training.flag_groups.moe import moe_layer_freq_type

UPSTREAM_POSITION_EMBEDDING_TYPES = (
    "learned_absolute",
    "rope",
    "yarn",
    "mrope",
    "relative",
    "none",
)
"""`--position-embedding-type` values upstream accepts; those not in `POSITION_EMBEDDING_TYPES`
are refused by `validate_network_options`."""
_UNBUILT_POSITION_EMBEDDINGS = {
    "mrope": "multimodal RoPE",
    "relative": "T5-style relative position buckets (an attention bias)",
}


def window_size_type(text: str) -> tuple[int, ...]:
    """Parses `--window-size` as upstream: ints separated by commas, optionally in parentheses
    ("127,0" or "(127,0)"); `TransformerConfig` checks that there are two.

    Raises:
        argparse.ArgumentTypeError: a part that is not an int.
    """
    try:
        return tuple(int(part) for part in text.strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not two ints LEFT,RIGHT such as 127,0 (-1: unlimited)"
        ) from None


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
    group.add_argument(
        "--num-query-groups",
        type=int,
        default=1,
        help="Key/value heads; read only with --group-query-attention.",
    )
    group.add_argument(
        "--window-size",
        type=window_size_type,
        metavar="LEFT,RIGHT",
        help="Sliding window: LEFT positions before each query (-1: all); RIGHT 0 or -1.",
    )
    group.add_argument(
        "--window-attn-skip-freq",
        type=moe_layer_freq_type,
        metavar="N|LIST",
        help='Full-attention layers: every N-th, or a 0/1 list ("[1,1,0]*2", 1: windowed).',
    )
    group.add_argument(
        "--max-position-embeddings", type=int, help="Learned position rows; None: --seq-length."
    )
    group.add_argument(
        "--position-embedding-type",
        choices=UPSTREAM_POSITION_EMBEDDING_TYPES,
        help="Position encoding (mrope, relative: not built); None: learned_absolute, yarn "
        "with --enable-gpt-oss.",
    )
    group.add_argument(
        "--use-rotary-position-embeddings",
        action="store_const",
        const="rope",
        dest="position_embedding_type",
        help="Deprecated upstream: the same as --position-embedding-type rope.",
    )
    group.add_argument("--rotary-base", type=int, default=10000, help="RoPE base period.")
    group.add_argument(
        "--rotary-percent", type=float, default=1.0, help="Fraction of head channels RoPE rotates."
    )
    group.add_argument(
        "--rotary-seq-len-interpolation-factor",
        type=int,
        help="Divide the RoPE positions by it (linear position interpolation).",
    )
    group.add_argument(
        "--use-rope-scaling", action="store_true", help="Llama 3.x RoPE frequency scaling."
    )
    group.add_argument(
        "--rope-scaling-factor", type=float, default=8.0, help="Llama 3.x RoPE scaling factor."
    )
    group.add_argument(
        "--no-position-embedding",
        action="store_false",
        dest="add_position_embedding",
        help="Deprecated upstream: use --position-embedding-type (accepted with rope only).",
    )
    group.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128, help="Pad the vocabulary."
    )
    group.add_argument(
        "--normalization", default="LayerNorm", choices=NORMALIZATIONS, help="Norm layers."
    )
    group.add_argument(
        "--norm-epsilon",
        type=float,
        default=1e-5,
        dest="layernorm_epsilon",  # upstream's TransformerConfig field
        help="Norm epsilon.",
    )
    group.add_argument(
        "--apply-residual-connection-post-layernorm",
        action="store_true",
        help="Residual from the layer norm's output instead of its input.",
    )
    group.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated, SiLU).")
    group.add_argument(
        "--squared-relu", action="store_true", help="MLP activation relu(x)^2 instead of GeLU."
    )
    group.add_argument(
        "--quick-geglu", action="store_true", help="gpt-oss's GLU: x * sigmoid(1.702 x) gate."
    )
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


def validate_network_options(args: argparse.Namespace) -> None:
    """Checks the position-encoding and activation flags (the sliding window's and the GLU
    options' values are `TransformerConfig`'s to check; `--position-embedding-type` is filled
    in by `yarn.resolve_positions`, which runs first).

    Raises:
        ValueError: an unbuilt position encoding, a RoPE option without RoPE (or, for
            `--rotary-percent`, with YaRN), a deprecated `--no-position-embedding` without RoPE,
            two MLP activations, or `--rotary-base` out of range (the float flags' ranges are
            `flag_ranges.py`'s).
    """
    _validate_ranges(args)
    kind = args.position_embedding_type
    if kind in _UNBUILT_POSITION_EMBEDDINGS:
        raise ValueError(
            f"--position-embedding-type {kind}: {_UNBUILT_POSITION_EMBEDDINGS[kind]} is not "
            f"built; use one of {', '.join(POSITION_EMBEDDING_TYPES)}."
        )
    if not args.add_position_embedding and kind != "rope":
        # Megatron-LM refuses it the same way: the flag predates --position-embedding-type.
        raise ValueError(
            "--no-position-embedding is deprecated; use --position-embedding-type none (or "
            "rope) instead."
        )
    if kind == "yarn" and args.rotary_percent != 1.0:
        # Upstream's YaRN ignores it: every channel of the head is rotated.
        raise ValueError(
            f"--rotary-percent {args.rotary_percent} applies to --position-embedding-type rope; "
            "YaRN rotates every channel of each head (as upstream): drop --rotary-percent."
        )
    for dest, given in (
        ("use_rope_scaling", args.use_rope_scaling),
        ("rotary_seq_len_interpolation_factor", args.rotary_seq_len_interpolation_factor),
    ):
        if given and kind != "rope":
            name = "--" + dest.replace("_", "-")
            raise ValueError(
                f"{name} applies to --position-embedding-type rope, not {kind}; add "
                f"--position-embedding-type rope or drop {name}."
            )
    if args.rotary_seq_len_interpolation_factor is not None:
        if args.rotary_seq_len_interpolation_factor < 1:
            raise ValueError(
                f"--rotary-seq-len-interpolation-factor "
                f"{args.rotary_seq_len_interpolation_factor} must be >= 1."
            )
    activations = {
        "--swiglu": args.swiglu,
        "--squared-relu": args.squared_relu,
        "--quick-geglu": args.quick_geglu,
    }
    chosen = [name for name, given in activations.items() if given]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} are MLP activations; choose one.")


def _validate_ranges(args: argparse.Namespace) -> None:
    # Checked whatever the position encoding: a value no run can use is a mistake either way.
    if args.rotary_base <= 0:
        raise ValueError(
            f"--rotary-base {args.rotary_base} must be > 0 (RoPE's frequencies are powers of "
            "1 / base); the usual value is 10000."
        )
