"""Multi-latent attention flags (upstream's "mla" group, with its names and defaults) and the
RoPE type.

With `--multi-latent-attention` the model is built from an `MLATransformerConfig`
(`mla_config_fields`): the latent ranks and head widths, and its rotary embedding, YaRN unless
`--rope-type rope`, which the YaRN flags set (`flag_groups/yarn.py`: upstream reads
`--rotary-scaling-factor`, `--mscale` and `--mscale-all-dim` for MLA, and the `--yarn-*` flags
for `--position-embedding-type yarn` only, leaving MLA's band at its config's defaults, which
are those flags' defaults). Without it these flags describe nothing this run builds:
`validate_mla` refuses them when set, rather than ignore them.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from megatron.core.transformer.transformer_config import MLA_ROPE_TYPES, MLATransformerConfig
from megatron.training.flag_groups.yarn import MLA_YARN_FIELDS

MLA_DEFAULT_ROPE_TYPE = next(
    field.default for field in dataclasses.fields(MLATransformerConfig) if field.name == "rope_type"
)
"""`--rope-type` left out with `--multi-latent-attention`: the config's default (YaRN)."""


@dataclasses.dataclass(frozen=True)
class _ValueFlag:
    option: str
    dest: str
    default: int | None
    help: str


MLA_VALUE_FLAGS = (
    _ValueFlag("--q-lora-rank", "q_lora_rank", None, "Query latent rank; None: no compression."),
    _ValueFlag("--kv-lora-rank", "kv_lora_rank", 32, "Key/value latent rank."),
    _ValueFlag("--qk-head-dim", "qk_head_dim", 128, "Unrotated query/key channels per head."),
    _ValueFlag("--qk-pos-emb-head-dim", "qk_pos_emb_head_dim", 64, "Rotated ones (k's shared)."),
    _ValueFlag("--v-head-dim", "v_head_dim", 128, "Value channels per head."),
)
"""The value flags of multi-latent attention, each setting the `MLATransformerConfig` field of
its dest, with upstream's parser defaults (not all the config's: `--kv-lora-rank` 32)."""


def add_mla_args(parser: argparse.ArgumentParser) -> None:
    """The "mla" group: `--multi-latent-attention` and its sizes, `--rope-type` (the YaRN
    flags are `flag_groups/yarn.py`'s)."""
    group = parser.add_argument_group(title="mla")
    group.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="Multi-latent attention (DeepSeek-V2/V3).",
    )
    for value_flag in MLA_VALUE_FLAGS:
        group.add_argument(
            value_flag.option,
            type=int,
            default=value_flag.default,
            metavar="N",
            help=value_flag.help,
        )
    group.add_argument(
        "--rope-type",
        choices=MLA_ROPE_TYPES,
        help="MLA's RoPE; None: yarn (standard attention: rope).",
    )


def validate_mla(args: argparse.Namespace) -> None:
    """Checks the MLA flags; with `--multi-latent-attention` fills `rope_type` left None with
    `MLATransformerConfig`'s default, so that runs spelling it differently compare equal (the
    YaRN flags are filled by `yarn.resolve_positions`).

    Raises:
        ValueError: MLA flags without `--multi-latent-attention`, `--rope-type yarn` for
            standard attention, or with it an option MLA does not combine with.
    """
    if not args.multi_latent_attention:
        _refuse_without_mla(args)
        return
    own_rope = "MLA rotates by its own --rope-type embedding, which this flag does not change"
    refused = {
        "--group-query-attention": (
            args.group_query_attention,
            "MLA has no query groups (upstream refuses it too)",
        ),
        "--use-rope-scaling": (args.use_rope_scaling, own_rope),
        "--rotary-seq-len-interpolation-factor": (
            args.rotary_seq_len_interpolation_factor is not None,
            own_rope,
        ),
        "--transformer-impl transformer_engine": (
            args.transformer_impl == "transformer_engine",
            "MLA is built with the local layers (--transformer-impl local)",
        ),
        "--position-embedding-type yarn": (
            args.position_embedding_type == "yarn",
            "MLA rotates by its own --rope-type embedding (yarn by default, which the YaRN "
            "flags set); use --position-embedding-type rope",
        ),
        "--no-yarn-correction-range-round-to-int": (
            args.yarn_correction_range_round_to_int is False,
            "YaRN without rounding its band's ends is built for standard attention only (MLA's "
            "YaRN rounds them, as upstream's)",
        ),
    }
    messages = [
        f"{option} with --multi-latent-attention: {why}; drop {option}."
        for option, (is_set, why) in refused.items()
        if is_set
    ]
    if messages:
        raise ValueError(" ".join(messages))
    if args.rope_type is None:
        args.rope_type = MLA_DEFAULT_ROPE_TYPE


def _refuse_without_mla(args: argparse.Namespace) -> None:
    given_flags = [
        f"{value_flag.option} {getattr(args, value_flag.dest)}"
        for value_flag in MLA_VALUE_FLAGS
        if getattr(args, value_flag.dest) != value_flag.default
    ]
    if args.rope_type == "yarn":
        given_flags.append("--rope-type yarn")
    messages = []
    if given_flags:
        messages.append(
            f"{', '.join(given_flags)}: these set multi-latent attention, which this run does "
            "not use; add --multi-latent-attention or drop them (YaRN for standard attention is "
            "--position-embedding-type yarn)."
        )
    if args.recompute_modules is not None and "mla_up_proj" in args.recompute_modules:
        messages.append(
            "--recompute-modules mla_up_proj recomputes multi-latent attention's "
            "up-projections, which this run does not have (as upstream, which refuses it too); "
            "add --multi-latent-attention or drop mla_up_proj."
        )
    if messages:
        raise ValueError(" ".join(messages))


def mla_config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `MLATransformerConfig` fields the validated flags set (empty without
    `--multi-latent-attention`)."""
    if not args.multi_latent_attention:
        return {}
    fields = {value_flag.dest: getattr(args, value_flag.dest) for value_flag in MLA_VALUE_FLAGS}
    fields.update({field: getattr(args, dest) for dest, field in MLA_YARN_FIELDS.items()})
    return dict(
        fields,
        rope_type=args.rope_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
    )
