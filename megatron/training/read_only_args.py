"""`ReadOnlyArguments`: the job's arguments once `initialize_megatron()` has validated them and
built the tokenizer. Every later reader (model providers, the loop, checkpoints) sees the same
values; training progress lives in a `TrainState` instead (`megatron.training.train_state`)."""

from __future__ import annotations

import argparse
from typing import Any


class ReadOnlyArguments(argparse.Namespace):
    """An `argparse.Namespace` whose attributes cannot be set or deleted after `freeze()`.

    `vars()` of it holds the flags only (the frozen mark is kept apart), so it saves into a
    checkpoint, prints and compares as the namespace it was made from.
    """

    __slots__ = ("_frozen",)

    def __init__(self, **kwargs: Any):
        object.__setattr__(self, "_frozen", False)
        super().__init__(**kwargs)

    @classmethod
    def frozen_copy(cls, args: argparse.Namespace) -> ReadOnlyArguments:
        """A read-only copy of `args`."""
        copy = cls(**vars(args))
        copy.freeze()
        return copy

    def freeze(self) -> None:
        """Makes every attribute read-only from now on."""
        object.__setattr__(self, "_frozen", True)

    @property
    def frozen(self) -> bool:
        """Whether `freeze()` was called."""
        return getattr(self, "_frozen", False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "_frozen" and self.frozen:
            raise AttributeError(_read_only(name, "set"))
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.frozen:
            raise AttributeError(_read_only(name, "delete"))
        object.__delattr__(self, name)


def _read_only(name: str, what: str) -> str:
    return (
        f"Cannot {what} args.{name}: the arguments are read-only after initialize_megatron(). "
        "Training progress (iteration, consumed samples) lives in the TrainState that "
        "pretrain() passes along (megatron.training.train_state); a value derived from the "
        "flags is set while they are validated (validate_args), before they are frozen."
    )
