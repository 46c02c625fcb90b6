"""`FsdpContext`: the state shared by every FSDP unit under one root.

The root is the outermost unit: the first whose forward runs (or the one `microbatch()` finds),
and it creates the context lazily. The context holds what concerns the whole model rather than
one unit: the collectives issuer (where the GPU streams will live), the microbatch state that
`microbatch()` sets, and the end-of-backward callback that reduces what the per-parameter hooks
did not (unused parameters, frozen units), frees every unit's whole weights and runs the
reductions deferred to the last microbatch.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.autograd import Variable

from megatron.core.distributed.fsdp.collectives import Collectives

if TYPE_CHECKING:
    from megatron.core.distributed.fsdp.fsdp_module import FsdpUnit


class FsdpContext:
    """Shared by the units of one root (which owns it; the others hold it weakly).

    Attributes:
        comm: the collectives issuer of every unit.
        is_first: inside `microbatch()`, whether this is the step's first microbatch (the only
            one that refreshes model weights from main weights); None outside, where every
            forward refreshes stale weights.
        is_last: whether the end of this backward runs the deferred reductions; True outside
            `microbatch()` / `no_sync()`.
    """

    def __init__(self, units: list[FsdpUnit]):
        self.comm = Collectives()
        self.is_first: bool | None = None
        self.is_last = True
        self._units = [weakref.ref(unit) for unit in units]
        self._callback_task: int | None = None

    def units(self) -> Iterator[FsdpUnit]:
        """The live units, root first, then in module order."""
        for ref in self._units:
            unit = ref()
            if unit is not None:
                yield unit

    @contextlib.contextmanager
    def microbatch_state(self, is_first: bool | None, is_last: bool) -> Iterator[None]:
        """Sets `is_first` / `is_last` for the scope and restores the previous values."""
        previous = self.is_first, self.is_last
        self.is_first, self.is_last = is_first, is_last
        try:
            yield
        finally:
            self.is_first, self.is_last = previous

    @property
    def syncs_weights(self) -> bool:
        """Whether a forward now may refresh model weights (not after the first microbatch)."""
        return self.is_first is not False

    def queue_post_backward(self) -> None:
        """Makes the current backward call `post_backward` once when it finishes."""
        # Keyed by graph task: a backward that raised never ran its callback, and must not stop
        # the next backward from queueing one.
        task = torch._C._current_graph_task_id()
        if self._callback_task == task:
            return
        self._callback_task = task
        context = weakref.ref(self)

        def callback() -> None:
            owner = context()
            if owner is not None:
                owner.post_backward()

        Variable._execution_engine.queue_callback(callback)

    @torch.no_grad()
    def post_backward(self) -> None:
        """End of backward: reduce what no unit's post-backward did (the root, units whose
        inputs need no gradient), free whole weights, register main weights, and on the last
        microbatch run the deferred reductions."""
        self._callback_task = None
        units = list(self.units())
        for unit in units:
            for group in unit.groups:
                if group.awaits_grads:
                    group.reduce_grads()
                group.reshard()
                group.use_dist_params()
        if self.is_last:
            self.finalize_grads(units)

    def finalize_grads(self, units: list[FsdpUnit] | None = None) -> None:
        """Runs every unit's deferred gradient reductions (idempotent)."""
        for unit in units if units is not None else self.units():
            for group in unit.groups:
                if group.requires_grad:
                    group.finalize_grads()
