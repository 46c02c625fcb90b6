"""How a flag is spelled on the command line, from its `argparse` destination and value: what
error messages name, so that a user finds the flag they typed."""

from __future__ import annotations

from typing import Any


def flag(dest: str) -> str:
    """The command-line flag whose destination is `dest`."""
    return "--" + dest.replace("_", "-")


def given(dest: str, value: Any) -> str:
    """How the user spelled a flag that set `dest` to `value`."""
    if value is True:
        return flag(dest)
    if value is False:
        return "--no-" + flag(dest)[2:]
    return f"{flag(dest)} {value}"
