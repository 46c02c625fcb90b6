"""The range of every float flag, checked before any other check of `validate_args()`.

`FLOAT_FLAG_RANGES` gives each float flag of the parser the values it may take: all finite (NaN
and infinities are refused everywhere, also where a comparison such as `value < 0` would let NaN
through) and within the flag's meaningful range. `check_float_flags()` refuses any other value
naming the flag, the value and the range; None, the "off" of the flags whose default is None,
passes. A float flag added to the parser without an entry here fails `test_flag_ranges.py`.
Checks that relate two flags (`--min-lr` <= `--lr`, ...) stay with their flag groups.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from megatron.training.configs_from_args import flag


@dataclass(frozen=True)
class Range:
    """The finite numbers between `low` and `high` (None: unbounded on that side), each bound
    included unless `low_open` / `high_open`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {opening}{self.low:g}, {self.high:g}{closing}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g} and finite"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g} and finite"
        return "finite"


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
PROBABILITY = Range(0, 1, high_open=True)
"""[0, 1): dropout probabilities, Adam's betas, the warmup's share of the decay."""

FLOAT_FLAG_RANGES: dict[str, Range] = {
    # network size and initialisation
    "rotary_percent": Range(0, 1, low_open=True),
    "rope_scaling_factor": POSITIVE,
    "layernorm_epsilon": POSITIVE,
    "init_method_std": POSITIVE,
    # regularisation and the optimizer
    "attention_dropout": PROBABILITY,
    "hidden_dropout": PROBABILITY,
    "weight_decay": NON_NEGATIVE,
    "start_weight_decay": NON_NEGATIVE,
    "end_weight_decay": NON_NEGATIVE,
    "clip_grad": NON_NEGATIVE,
    "adam_beta1": PROBABILITY,
    "adam_beta2": PROBABILITY,
    "adam_eps": POSITIVE,
    "sgd_momentum": NON_NEGATIVE,
    # learning rate
    "lr": NON_NEGATIVE,
    "lr_warmup_fraction": PROBABILITY,
    "lr_warmup_init": NON_NEGATIVE,
    "min_lr": NON_NEGATIVE,
    "decoupled_lr": NON_NEGATIVE,
    "decoupled_min_lr": NON_NEGATIVE,
    # mixed precision
    "loss_scale": POSITIVE,
    "initial_loss_scale": POSITIVE,
    "min_loss_scale": POSITIVE,
    "loss_scale_window": Range(1),
    # data
    "mid_level_dataset_surplus": NON_NEGATIVE,
    # Mixture of Experts
    "moe_router_topk_scaling_factor": POSITIVE,
    "moe_router_bias_update_rate": POSITIVE,
    "moe_aux_loss_coeff": NON_NEGATIVE,
    "moe_z_loss_coeff": POSITIVE,
    "moe_input_jitter_eps": Range(0, 1, low_open=True, high_open=True),
    "moe_expert_capacity_factor": POSITIVE,
}
"""Each float flag's destination and its range."""

_FLAG_NAMES = {"layernorm_epsilon": "--norm-epsilon"}
"""The float flags whose names are not their destinations'."""


def check_float_flags(args: argparse.Namespace) -> None:
    """Refuses a float flag outside its range (`FLOAT_FLAG_RANGES`); None passes.

    Raises:
        ValueError: naming the flag, its value and the range.
    """
    for dest, allowed in FLOAT_FLAG_RANGES.items():
        value = getattr(args, dest)
        # `nargs="+"` flags (--moe-aux-loss-coeff) hold a list until validation takes its value.
        for item in value if isinstance(value, list) else [value]:
            if item is not None and item not in allowed:
                name = _FLAG_NAMES.get(dest, flag(dest))
                raise ValueError(f"{name} {item} must be {allowed}.")
