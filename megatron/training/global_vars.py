"""The parsed command-line arguments of the running job, readable from anywhere (`get_args()`),
as in Megatron-LM: model providers and forward-step functions take no `args` parameter."""

from __future__ import annotations

import argparse

_GLOBAL_ARGS: argparse.Namespace | None = None


def get_args() -> argparse.Namespace:
    """The validated arguments `initialize_megatron()` stored.

    Raises:
        RuntimeError: no job has initialised them yet.
    """
    if _GLOBAL_ARGS is None:
        raise RuntimeError(
            "get_args() before initialize_megatron(): call pretrain() or initialize_megatron() "
            "first."
        )
    return _GLOBAL_ARGS


def set_args(args: argparse.Namespace | None) -> None:
    """Stores `args` for `get_args()` (None forgets them)."""
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args
