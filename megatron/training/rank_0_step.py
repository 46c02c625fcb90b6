"""`on_rank_0()`: a step that rank 0 alone takes, whose failure every rank raises."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from megatron.training.checkpoint_layout import CheckpointError


def on_rank_0(step: Callable[[], None], failure: Callable[[Exception], str]) -> None:
    """Runs `step` on rank 0 alone; every rank returns when it is done, or raises the same
    error (rather than waiting at the next collective until the timeout).

    Args:
        step: what rank 0 does.
        failure: the message of the error, from rank 0's exception.

    Raises:
        CheckpointError: `step` raised on rank 0.
    """
    error: Exception | None = None
    outcome: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            step()
        except Exception as raised:  # every kind: all ranks must learn that the step failed
            error = raised
            outcome[0] = failure(raised)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0]) from error
