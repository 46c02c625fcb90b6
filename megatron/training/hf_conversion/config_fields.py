"""The conversion's error, and reading the fields of a Hugging Face `config.json`: what the
dense (`config.py`) and MoE (`moe.py`) parts of the conversion share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron.training.checkpoint_layout import CheckpointError


class HFConversionError(CheckpointError):
    """A Hugging Face checkpoint or config this project cannot convert; the message says why
    and what to do."""


def integer_field(config: Mapping[str, Any], key: str) -> int:
    """The config's `key`, a positive integer.

    Raises:
        HFConversionError: it is missing or not a positive integer.
    """
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HFConversionError(f"config.json's {key} is {value!r}; a positive integer is needed.")
    return value
