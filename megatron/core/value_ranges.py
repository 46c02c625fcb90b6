"""The values a float config field may take, declared once on the field.

A config dataclass declares a float field's range as field metadata (`ranged(default, ...)`) and
checks its fields with `check_ranges` in `__post_init__`; the training flags of the same name are
checked against the same ranges before anything else (`megatron.training.flag_ranges`), so that
one declaration serves the library's configs and the command line. Every range is of finite
numbers: NaN and the infinities are refused everywhere, also where a comparison such as
`value < 0` would let NaN through. None, the "off" of the fields whose default is None, passes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

RANGE_KEY = "range"
"""The field-metadata key of a float field's `Range`."""


@dataclasses.dataclass(frozen=True)
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


FINITE = Range()
POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
PROBABILITY = Range(0, 1, high_open=True)
"""[0, 1): dropout probabilities, Adam's betas, the warmup's share of the decay."""


def ranged(default: float | None, allowed: Range) -> Any:
    """A dataclass field with `default` whose values must lie in `allowed` (or be None)."""
    return dataclasses.field(default=default, metadata={RANGE_KEY: allowed})


def field_ranges(config_class: type) -> dict[str, Range]:
    """Each ranged field of the dataclass `config_class` and its range."""
    return {
        field.name: field.metadata[RANGE_KEY]
        for field in dataclasses.fields(config_class)
        if RANGE_KEY in field.metadata
    }


def check_ranges(config: Any, prefix: str = "") -> None:
    """Refuses a ranged field of the dataclass instance `config` outside its range.

    Args:
        config: a dataclass instance whose float fields are declared with `ranged`.
        prefix: put before the field's name in the message (e.g. "OptimizerConfig.").

    Raises:
        ValueError: `{prefix}{field}={value} must be {range}.`
    """
    for name, allowed in field_ranges(type(config)).items():
        value = getattr(config, name)
        if value is not None and value not in allowed:
            raise ValueError(f"{prefix}{name}={value} must be {allowed}.")
