"""YaRN RoPE in the Hugging Face conversion: a `rope_parameters` (or `rope_scaling`) block of
`rope_type` "yarn" <-> the YaRN flags (`megatron.training.flag_groups.yarn`).

transformers computes YaRN as upstream Megatron-LM does (`_compute_yarn_parameters`): the
frequencies of RoPE base `rope_theta` blended between RoPE's and RoPE's / `factor` over the band
of `beta_fast` .. `beta_slow` rotations in `original_max_position_embeddings` positions (its ends
rounded to whole pairs unless `truncate` is false), and cos and sin multiplied by
`attention_factor`. That factor, where the block leaves it out, is m(`mscale`) /
m(`mscale_all_dim`) when both are given and non-zero, else m(1), with m(x) = 0.1 x ln(factor)
+ 1: the concentration factor of `--mscale` and `--mscale-all-dim` (m(1) is theirs at 1 and 0).
An explicit `attention_factor` converts when it is the one those give.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from megatron.core.transformer.transformer_config import yarn_concentration_factor
from megatron.training.flag_groups.yarn import ROUND_TO_INT, YARN_DEFAULTS
from megatron.training.flag_spelling import given
from megatron.training.hf_conversion.config_fields import HFConversionError

_DEFAULT_COEFFICIENTS = (YARN_DEFAULTS["mscale"], YARN_DEFAULTS["mscale_all_dim"])
"""`--mscale` and `--mscale-all-dim` whose concentration factor is transformers' default one."""


def yarn_args(block: Mapping[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """The YaRN flags' values (by dest) of a `rope_type` "yarn" block.

    Args:
        block: The `rope_parameters` / `rope_scaling` block.
        max_position_embeddings: The config's, which with the original context gives the factor
            where the block leaves it out (as transformers does).

    Raises:
        HFConversionError: a parameter missing or out of range, or an `attention_factor`
            other than the one the block's coefficients give.
    """
    original = block.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise HFConversionError(
            f"yarn rope_parameters' original_max_position_embeddings is {original!r}; "
            "transformers needs a positive integer to load the model."
        )
    factor = block.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    values = {
        "factor": factor,
        "beta_fast": block.get("beta_fast") or 32.0,
        "beta_slow": block.get("beta_slow") or 1.0,
    }
    for key, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise HFConversionError(f"yarn rope_parameters' {key} is {value!r}; above 0 is needed.")
    mscale, mscale_all_dim = block.get("mscale"), block.get("mscale_all_dim")
    coefficients = (
        (float(mscale), float(mscale_all_dim))
        if mscale and mscale_all_dim
        else _DEFAULT_COEFFICIENTS
    )
    concentration = yarn_concentration_factor(float(factor), *coefficients)
    stated = block.get("attention_factor")
    if stated is not None and not math.isclose(stated, concentration, rel_tol=1e-12):
        raise HFConversionError(
            f"yarn rope_parameters' attention_factor {stated} is not the concentration factor "
            f"{concentration:.6g} of its factor {factor} and mscale / mscale_all_dim "
            f"{coefficients}: --mscale and --mscale-all-dim give that one only."
        )
    return {
        "rotary_scaling_factor": float(factor),
        "yarn_original_max_position_embeddings": original,
        "yarn_beta_fast": float(values["beta_fast"]),
        "yarn_beta_slow": float(values["beta_slow"]),
        "mscale": coefficients[0],
        "mscale_all_dim": coefficients[1],
        ROUND_TO_INT: bool(block.get("truncate", True)),
    }


def yarn_flags(args: Mapping[str, Any]) -> list[str]:
    """The YaRN flags for the values `yarn_args` gives, every one spelled out."""
    return [word for dest in YARN_DEFAULTS for word in given(dest, args[dest]).split()]


def yarn_rope_scaling(args: Mapping[str, Any]) -> dict[str, Any]:
    """A `rope_scaling` block of `rope_type` "yarn" for the YaRN flags' values `args` (a
    checkpoint's saved arguments), in the keys transformers 4 and 5 both read (the RoPE base is
    the config's top-level `rope_theta`).

    Raises:
        HFConversionError: `--mscale` and `--mscale-all-dim` that transformers' block cannot
            state without an explicit `attention_factor` (one of them 0, the other not the
            default).
    """
    block: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": args["rotary_scaling_factor"],
        "original_max_position_embeddings": args["yarn_original_max_position_embeddings"],
        "beta_fast": args["yarn_beta_fast"],
        "beta_slow": args["yarn_beta_slow"],
        "truncate": args[ROUND_TO_INT],
    }
    coefficients = (args["mscale"], args["mscale_all_dim"])
    if coefficients == _DEFAULT_COEFFICIENTS:
        return block
    if not all(coefficients):
        raise HFConversionError(
            f"--mscale {coefficients[0]} --mscale-all-dim {coefficients[1]}: transformers takes "
            "the two coefficients only when both are non-zero (otherwise its own default "
            "factor); a config.json cannot state this concentration factor."
        )
    return {**block, "mscale": coefficients[0], "mscale_all_dim": coefficients[1]}
