"""The range of every float flag, checked before any other check of `validate_args()`.

A flag that sets a config field of its name takes the range the field declares
(`megatron.core.value_ranges`: one declaration for the library and the command line); the other
float flags have theirs here. `check_float_flags()` refuses every value outside, naming the flag,
the value and the range; None, the "off" of the flags whose default is None, passes. A float flag
added to the parser without a range fails `test_flag_ranges.py`. Checks that relate two flags
(`--min-lr` <= `--lr`, ...) stay with their flag groups.
"""

from __future__ import annotations

import argparse

from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.value_ranges import (
    FINITE,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    Range,
    field_ranges,
)
from megatron.training.configs_from_args import flag
from megatron.training.flag_errors import FlagErrors

_FLAG_ONLY_RANGES: dict[str, Range] = {
    "rotary_percent": Range(0, 1, low_open=True),
    "rope_scaling_factor": POSITIVE,
    "start_weight_decay": NON_NEGATIVE,
    "end_weight_decay": NON_NEGATIVE,
    "lr_warmup_fraction": PROBABILITY,
    "lr_warmup_init": NON_NEGATIVE,
    "mid_level_dataset_surplus": NON_NEGATIVE,
    # A negative factor is Megatron-core's dropless, which the config turns into None.
    "moe_expert_capacity_factor": FINITE,
}
"""The float flags that set no config field of their name (or accept more than the field)."""

FLOAT_FLAG_RANGES: dict[str, Range] = {
    **field_ranges(MLATransformerConfig),  # TransformerConfig's fields and MLA's
    **field_ranges(OptimizerConfig),
    **_FLAG_ONLY_RANGES,
}
"""Each float flag's destination and its range (and ranged config fields without a flag, which
`check_float_flags` skips)."""

_FLAG_NAMES = {"layernorm_epsilon": "--norm-epsilon"}
"""The float flags whose names are not their destinations'."""


def check_float_flags(args: argparse.Namespace) -> None:
    """Refuses a float flag outside its range (`FLOAT_FLAG_RANGES`); None passes.

    Raises:
        FlagErrors: a `ValueError` naming each flag out of range, its value and the range.
    """
    messages = []
    for dest, allowed in FLOAT_FLAG_RANGES.items():
        value = getattr(args, dest, None)
        # `nargs="+"` flags (--moe-aux-loss-coeff) hold a list until validation takes its value.
        for item in value if isinstance(value, list) else [value]:
            if item is not None and item not in allowed:
                name = _FLAG_NAMES.get(dest, flag(dest))
                messages.append(f"{name} {item} must be {allowed}.")
    if messages:
        raise FlagErrors(messages)
