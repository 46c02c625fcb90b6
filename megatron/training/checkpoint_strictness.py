"""`--dist-ckpt-strictness`: what loading does about tensors only the model or only the
checkpoint has.

Megatron-LM's values (`StrictHandling` in its `dist_checkpointing/validation.py`) speak of
"unexpected" keys, the model's tensors the checkpoint lacks, and "missing" keys, the
checkpoint's tensors the model lacks. Each value here says what loading does about each kind:

| value | model's tensors the checkpoint lacks | checkpoint's tensors the model lacks |
|---|---|---|
| `assume_ok_unexpected` (default), `raise_unexpected`, `raise_all` | raise | raise |
| `log_unexpected` | log, keep their values | ignore |
| `log_all` | log, keep their values | log, not read |
| `ignore_all` | keep their values | not read |

The three raising values raise on both kinds, naming them: stricter than Megatron-LM's
`assume_ok_unexpected` and `raise_unexpected`, which pass over tensors only the checkpoint has.
Where a tolerated mismatch exists, the optimizer state does not load (its parameters differ from
the checkpoint's). Tensors both have but in other shapes always raise, as upstream. The
`return_*` values hand the mismatches to a caller of Megatron-core's `dist_checkpointing.load()`,
which a training run does not have: validation refuses them.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping

import torch

from megatron.training.checkpoint_layout import CheckpointError
from megatron.training.utils import print_rank_0


class OnMismatch(enum.Enum):
    """What loading does about the tensors of one kind of mismatch."""

    RAISE = "raise"
    LOG = "log"
    IGNORE = "ignore"


class StrictHandling(enum.Enum):
    """Megatron-LM's `--dist-ckpt-strictness` values."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @property
    def model_only(self) -> OnMismatch:
        """What loading does about the model's tensors that the checkpoint lacks."""
        return self._actions()[0]

    @property
    def checkpoint_only(self) -> OnMismatch:
        """What loading does about the checkpoint's tensors that the model lacks."""
        return self._actions()[1]

    def _actions(self) -> tuple[OnMismatch, OnMismatch]:
        if self not in _ACTIONS:
            raise ValueError(
                f"--dist-ckpt-strictness {self.value} returns the mismatched tensors to a "
                "caller of Megatron-core's dist_checkpointing.load(), which a training run does "
                "not have (Megatron-LM's load_checkpoint cannot take them either). Use log_all "
                "(load what matches, log the rest), log_unexpected or a raising value."
            )
        return _ACTIONS[self]


_ACTIONS = {
    StrictHandling.ASSUME_OK_UNEXPECTED: (OnMismatch.RAISE, OnMismatch.RAISE),
    StrictHandling.RAISE_UNEXPECTED: (OnMismatch.RAISE, OnMismatch.RAISE),
    StrictHandling.RAISE_ALL: (OnMismatch.RAISE, OnMismatch.RAISE),
    StrictHandling.LOG_UNEXPECTED: (OnMismatch.LOG, OnMismatch.IGNORE),
    StrictHandling.LOG_ALL: (OnMismatch.LOG, OnMismatch.LOG),
    StrictHandling.IGNORE_ALL: (OnMismatch.IGNORE, OnMismatch.IGNORE),
}
"""(model-only, checkpoint-only) actions of the values a training run loads with."""


def loading_strictness(value: str) -> StrictHandling:
    """The strictness `--dist-ckpt-strictness value` loads with.

    Raises:
        ValueError: a `return_*` value, which a training run cannot honour.
    """
    strictness = StrictHandling(value)
    strictness._actions()
    return strictness


def check_model_tensors(
    model_shapes: Mapping[str, torch.Size],
    saved: dict[tuple[str, ...], tuple],
    path: str,
    strictness: StrictHandling,
) -> tuple[set[str], set[str]]:
    """Compares the model's tensors with the checkpoint's: shapes must agree, and tensors only one
    of them has are raised on, logged or passed over as `strictness` says.

    Args:
        model_shapes: each tensor of the whole model (every pipeline stage's) -> its shape.
        saved: each tensor of the checkpoint's model, by its path below "model" -> (shape,
            dtype).
        path: the checkpoint's directory, for the messages.
        strictness: what to do about tensors only one side has.

    Returns:
        The model's tensors the checkpoint lacks and the checkpoint's the model lacks, where
        `strictness` tolerates them (empty otherwise).

    Raises:
        CheckpointError: a tensor of another shape (or another number of experts), or tensors
            only one side has that `strictness` does not tolerate.
    """
    expected = dict(model_shapes)
    shapes = {names[0]: size for names, (size, _) in saved.items()}
    reshaped = [
        f"{name}: saved {list(shapes[name])}, model {list(shape)}"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    problems = []
    if reshaped:
        problems.append(f"{len(reshaped)} tensor(s) differ in shape ({'; '.join(reshaped[:3])})")
    experts = [
        (shapes[name][0], shape[0])
        for name, shape in expected.items()
        if ".experts." in name and name in shapes and shapes[name][0] != shape[0]
    ]
    if experts:
        problems.append(
            f"its MoE layers have {experts[0][0]} experts, this model {experts[0][1]} "
            "(--num-experts; the expert-parallel size may differ, the number of experts not)"
        )
    mismatches = {
        "missing from it": (expected.keys() - shapes.keys(), strictness.model_only),
        "not in this model": (shapes.keys() - expected.keys(), strictness.checkpoint_only),
    }
    refused = False
    for what, (names, action) in mismatches.items():
        if not names:
            continue
        listed = sorted(names)
        if action is OnMismatch.RAISE:
            problems.append(f"{what}: {listed[:5]}")
            refused = True
        elif action is OnMismatch.LOG:
            kept = "keep their values" if what == "missing from it" else "are not read"
            print_rank_0(
                f"WARNING: {path}: {len(listed)} tensor(s) {what}, which {kept} "
                f"(--dist-ckpt-strictness {strictness.value}): {listed}",
                logging.WARNING,
            )
    if problems:
        tolerate = (
            " (or pass --dist-ckpt-strictness log_all to load the tensors both hold)"
            if refused and not reshaped and not experts
            else ""
        )
        raise CheckpointError(
            f"{path} does not fit this model: {', '.join(problems)}. Build the model with the "
            f"checkpoint's arguments, or load another checkpoint{tolerate}."
        )
    absent, extra = (names for names, _ in mismatches.values())
    return set(absent), set(extra)
