"""YaRN's flags, with upstream's names and meanings, for standard attention
(`--position-embedding-type yarn`) and multi-latent attention, and upstream's gpt-oss preset
(`--enable-gpt-oss`).

Upstream reads `--rotary-scaling-factor`, `--mscale`, `--mscale-all-dim` and the `--yarn-*`
flags into the `yarn_*` fields of the config for `--position-embedding-type yarn`
(`YARN_CONFIG_FIELDS`), and the first three into multi-latent attention's YaRN, whose band the
`--yarn-*` flags set here too (`MLA_YARN_FIELDS`; upstream leaves MLA's at its config's
defaults). They default to None, and `resolve_positions` fills the values a run that uses YaRN
leaves out with upstream's (`YARN_DEFAULTS`, which are also MLA's here): a flag given is thus
told from one left out, so that `validate_yarn` refuses those that describe nothing this run
builds and `--enable-gpt-oss` those that contradict it.

`--enable-gpt-oss` is the preset of upstream's ModelOpt model builder: YaRN positions with the
parameters of `GPT_OSS_PRESET`, which it sets as if they were given. A flag given with another
value is an error naming both. `--position-embedding-type rope`, which upstream's gpt-oss
example script passes with the preset, is not one: the preset makes that RoPE YaRN (upstream's
builder switches the config's positions to YaRN). The preset sets nothing else; gpt-oss's
sliding windows, sinks and clamped GLU are their own flags, as in upstream's script. Its
original context (131072) is upstream's preset's; the released gpt-oss checkpoints say 4096,
which `tools/convert_hf.py import` gives with the explicit flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from megatron.training.flag_spelling import given
from megatron.training.utils import print_rank_0


@dataclasses.dataclass(frozen=True)
class _YarnFlag:
    option: str
    dest: str
    kind: type
    default: int | float
    help: str


YARN_VALUE_FLAGS = (
    _YarnFlag("--rotary-scaling-factor", "rotary_scaling_factor", float, 1.0, "YaRN's factor s."),
    _YarnFlag(
        "--yarn-original-max-position-embeddings",
        "yarn_original_max_position_embeddings",
        int,
        4096,
        "YaRN's original context.",
    ),
    _YarnFlag("--yarn-beta-fast", "yarn_beta_fast", float, 32.0, "YaRN's band start."),
    _YarnFlag("--yarn-beta-slow", "yarn_beta_slow", float, 1.0, "YaRN's band end."),
    _YarnFlag("--mscale", "mscale", float, 1.0, "YaRN's concentration numerator."),
    _YarnFlag("--mscale-all-dim", "mscale_all_dim", float, 0.0, "Its denominator."),
)
"""YaRN's value flags, each with upstream's default (its parser's, or where that is None what
its training script takes: `_apply_yarn_config_from_args`)."""

ROUND_TO_INT = "yarn_correction_range_round_to_int"
"""The dest of `--yarn-correction-range-round-to-int` and its `--no-` form."""

YARN_DEFAULTS: dict[str, Any] = {
    **{flag.dest: flag.default for flag in YARN_VALUE_FLAGS},
    ROUND_TO_INT: True,
}
"""Each YaRN flag's dest and the value a run that uses YaRN takes where it is left out."""

YARN_CONFIG_FIELDS = {
    "rotary_scaling_factor": "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "yarn_beta_fast": "yarn_beta_fast",
    "yarn_beta_slow": "yarn_beta_slow",
    "mscale": "yarn_mscale",
    "mscale_all_dim": "yarn_mscale_all_dim",
    ROUND_TO_INT: "yarn_correction_range_round_to_int",
}
"""Each YaRN flag's dest and the `TransformerConfig` field it sets for standard attention."""

MLA_YARN_FIELDS = {
    "rotary_scaling_factor": "rotary_scaling_factor",
    "yarn_original_max_position_embeddings": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}
"""Each YaRN value flag's dest and the `MLATransformerConfig` field it sets (multi-latent
attention's YaRN always rounds its band, as upstream's)."""

GPT_OSS_PRESET: dict[str, Any] = {
    "position_embedding_type": "yarn",
    "rotary_scaling_factor": 32.0,
    "yarn_original_max_position_embeddings": 131072,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    ROUND_TO_INT: False,
}
"""What `--enable-gpt-oss` sets (upstream's ModelOpt builder's values, by flag dest)."""


def add_yarn_args(parser: argparse.ArgumentParser) -> None:
    """The "yarn" group: YaRN's flags and `--enable-gpt-oss`."""
    group = parser.add_argument_group(
        title="yarn",
        description="YaRN RoPE: --position-embedding-type yarn, or multi-latent attention's.",
    )
    for yarn_flag in YARN_VALUE_FLAGS:
        group.add_argument(
            yarn_flag.option,
            type=yarn_flag.kind,
            metavar="X" if yarn_flag.kind is float else "N",
            help=f"{yarn_flag.help} None: {yarn_flag.default}.",
        )
    group.add_argument(
        "--yarn-correction-range-round-to-int",
        action="store_true",
        default=None,
        dest=ROUND_TO_INT,
        help="Round YaRN's band to whole channel pairs (None: rounded).",
    )
    group.add_argument(
        "--no-yarn-correction-range-round-to-int",
        action="store_false",
        dest=ROUND_TO_INT,
        help="Do not round it (standard attention only).",
    )
    group.add_argument(
        "--enable-gpt-oss",
        action="store_true",
        help="Upstream's gpt-oss preset: YaRN, factor 32, original 131072, beta 32 / 1, unrounded.",
    )


def resolve_positions(args: argparse.Namespace) -> None:
    """Applies `--enable-gpt-oss` to the flags it sets that are left out (or, for
    `--position-embedding-type`, given as rope), fills `--position-embedding-type` (None:
    learned_absolute) and, for a run that uses YaRN (`--position-embedding-type yarn` or
    `--multi-latent-attention`), the YaRN flags left out (`YARN_DEFAULTS`). Never fails: a
    flag that contradicts the preset keeps its value, which `validate_yarn` refuses."""
    if args.enable_gpt_oss and not args.multi_latent_attention:
        _apply_gpt_oss_preset(args)
    if args.position_embedding_type is None:
        args.position_embedding_type = "learned_absolute"
    if uses_yarn(args):
        for dest, default in YARN_DEFAULTS.items():
            if getattr(args, dest) is None:
                setattr(args, dest, default)


def uses_yarn(args: argparse.Namespace) -> bool:
    """Whether the run's positions are YaRN's (or multi-latent attention's, which reads the YaRN
    flags whatever its `--rope-type`: its softmax scale is YaRN's)."""
    return args.position_embedding_type == "yarn" or args.multi_latent_attention


def validate_yarn(args: argparse.Namespace) -> None:
    """Refuses flags that contradict `--enable-gpt-oss`, and YaRN flags given to a run whose
    positions are not YaRN's (after `resolve_positions`), which upstream would ignore.

    Raises:
        ValueError: the flags, and what to do.
    """
    if args.enable_gpt_oss:
        _check_gpt_oss_preset(args)
        return
    if uses_yarn(args):
        return
    set_flags = [
        given(dest, getattr(args, dest))
        for dest in YARN_DEFAULTS
        if getattr(args, dest) is not None
    ]
    if set_flags:
        raise ValueError(
            f"{', '.join(set_flags)}: these set YaRN, which this run does not use (its "
            f"positions are --position-embedding-type {args.position_embedding_type}); add "
            "--position-embedding-type yarn (or --multi-latent-attention, whose rotary "
            "embedding is YaRN by default), or drop them."
        )


def yarn_config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `TransformerConfig` `yarn_*` fields the validated flags set (empty unless
    `--position-embedding-type yarn`)."""
    if args.position_embedding_type != "yarn":
        return {}
    return {field: getattr(args, dest) for dest, field in YARN_CONFIG_FIELDS.items()}


def _apply_gpt_oss_preset(args: argparse.Namespace) -> None:
    """Sets the preset's values of the flags left out (and makes `rope` YaRN), saying which."""
    applied = []
    for dest, value in GPT_OSS_PRESET.items():
        current = getattr(args, dest)
        if current == value:
            continue
        if current is None or (dest == "position_embedding_type" and current == "rope"):
            setattr(args, dest, value)
            applied.append(given(dest, value))
    if applied:
        print_rank_0(f"> --enable-gpt-oss (upstream's gpt-oss preset) sets {' '.join(applied)}")


def _check_gpt_oss_preset(args: argparse.Namespace) -> None:
    if args.multi_latent_attention:
        raise ValueError(
            "--enable-gpt-oss with --multi-latent-attention: the preset sets YaRN positions for "
            "standard attention (gpt-oss's); multi-latent attention has its own (--rope-type, "
            "and the YaRN flags); drop one of the two."
        )
    contradicting = [
        given(dest, getattr(args, dest))
        for dest, value in GPT_OSS_PRESET.items()
        if getattr(args, dest) != value
    ]
    if contradicting:
        preset = " ".join(given(dest, value) for dest, value in GPT_OSS_PRESET.items())
        raise ValueError(
            f"--enable-gpt-oss sets {preset}, which {', '.join(contradicting)} contradict; drop "
            "--enable-gpt-oss and give the YaRN flags you want, or drop the contradicting flags."
        )
