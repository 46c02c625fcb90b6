"""`FsdpContext`: the state shared by every FSDP unit under one root.

The root is the outermost unit: the first whose forward runs (or the one `microbatch()` finds),
and it creates the context lazily. The context holds what concerns the whole model rather than
one unit:

- the collectives issuer and, on GPU, the all-gather and reduce-scatter streams;
- which units hold whole weights (ZeRO-3), the events that say when they are ready and when
  their last use is done, and the bound on how many are held at once (delayed release);
- the forward and backward order of the units, recorded in each forward, which prefetching
  follows;
- the reduce-scatters in flight, and the end-of-backward callback that waits for them,
  frees every unit's whole weights, reduces what no unit's post-backward did (the root, units
  whose inputs need no gradient) and runs the reductions deferred to the last microbatch;
- the microbatch state that `microbatch()` sets.

Memory discipline (GPU): whole weights and all-gather staging are allocated and freed on the
all-gather stream, which waits for the event recorded after a unit's last use before freeing it;
reduce-scatter inputs (gradients cast to the reduction dtype) are allocated and freed on the compute
stream, which waits for the reduce-scatter that read them before casting the next. Nothing relies on
`record_stream`. The all-gather stream waits for the compute stream's queued work at the start of
each forward (and in `start_param_sync`) and before the first gather after a step or a load changed
the main weights, not before every gather: all-gathers read the main weights, which change only
between passes, and the memory they reuse is ordered by the events above; in backward each prefetch
also waits, to stay under the unit computing when it is issued. On CPU there are no streams and
every step runs in program order, with identical results.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import torch
from torch.autograd import Variable

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.overlap import CommStreams, OverlapPolicy
from megatron.core.distributed.fsdp.symmetric_memory import (
    SymmetricStaging,
    check_symm_mem_support,
)

if TYPE_CHECKING:
    from megatron.core.distributed.fsdp.fsdp_module import FsdpUnit


class FsdpContext:
    """Shared by the units of one root (which owns it; the others hold it weakly).

    Args:
        units: the root first, then every unit below it in module order.
        policy: the root's communication schedule.
        device: where the units' buffers live.

    Attributes:
        comm: the collectives issuer of every unit.
        streams: the side streams (CUDA only; None on CPU).
        is_first: inside `microbatch()`, whether this is the step's first microbatch (the only
            one that refreshes model weights from main weights); None outside, where every
            forward refreshes stale weights.
        is_last: whether the end of this backward runs the deferred reductions; True outside
            `microbatch()` / `no_sync()`.
    """

    def __init__(self, units: list[FsdpUnit], policy: OverlapPolicy, device: torch.device):
        self.policy = policy
        self.streams = CommStreams(device) if device.type == "cuda" else None
        symmetric = self._symmetric_staging(units, device) if policy.use_symm_mem else None
        self.comm = Collectives(symmetric)
        self.is_first: bool | None = None
        self.is_last = True
        # The root unit owns this context, so units are referred to by their position in
        # `units` (0: the root, `FsdpUnit.position`), which keeps the context from holding the
        # root strongly.
        self._units = [weakref.ref(unit) for unit in units]
        self._callback_task: int | None = None
        # Units holding whole weights (ordered set), those whose last use is done (oldest
        # release first), and those whose gather was not yet waited for.
        self._resident: dict[int, None] = {}
        self._releasable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._ready: set[int] = set()
        # The event after each unit's gather and after its last use (GPU), and one after the
        # last reduce-scatter issued, recorded again at each use: a wait queued on an event is
        # not affected by later records, and every record supersedes the ones it follows on
        # its stream.
        if self.streams is not None:
            self._ready_events = [torch.cuda.Event() for _ in units]
            self._release_events = [torch.cuda.Event() for _ in units]
            self._reduced = torch.cuda.Event()
        # The reduce-scatters of the last unit reduced, in flight on their stream: the tensors
        # they read (kept alive, unwritten, until the compute stream waits for `_reduced`).
        self._reductions: list[list[torch.Tensor]] = []
        # Orders of the last complete forward (initially module order), and the one recording.
        positions = list(range(len(units)))
        self._next_forward = _successors(positions)
        self._next_backward = _successors([0, *reversed(positions[1:])])
        self._first_unit = 0
        self._recording: tuple[list[int], list[int]] | None = None
        self._gathers_ordered = False

    @staticmethod
    def _symmetric_staging(units: list[FsdpUnit], device: torch.device) -> SymmetricStaging:
        requests = [r for unit in units for group in unit.groups for r in group.staging_requests()]
        check_symm_mem_support(device, [group for _, group, _, _ in requests])
        staging = SymmetricStaging(device)
        for request in requests:
            staging.reserve(*request)
        staging.allocate()
        return staging

    def units(self) -> Iterator[FsdpUnit]:
        """The live units, root first, then in module order."""
        for ref in self._units:
            unit = ref()
            if unit is not None:
                yield unit

    # Microbatch state.

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

    # Unit order.

    def record_pre_forward(self, unit: FsdpUnit) -> None:
        """Notes that `unit`'s forward starts (the root's starts a new recording)."""
        position = unit.position
        if position == 0:
            self._recording = ([], [])
        if self._recording is not None:
            self._recording[0].append(position)

    def record_post_forward(self, unit: FsdpUnit) -> None:
        """Notes that `unit`'s forward ended; at the root's, the recorded order takes effect:
        forward prefetching follows the pre-forward order, backward the reversed post-forward
        order (the order the units' backward hooks fire in)."""
        if self._recording is None:
            return
        position = unit.position
        self._recording[1].append(position)
        if position == 0:
            pre, post = self._recording
            self._recording = None
            self._first_unit = pre[0]
            self._next_forward = _successors(pre)
            self._next_backward = _successors(list(reversed(post)))

    # Whole weights: gather, use, release.

    def use(self, unit: FsdpUnit, *, prefetch: Literal["forward", "backward"] | None = None):
        """Makes `unit`'s compute weights whole and ready for the current stream, then (with
        `prefetch` "forward" or "backward" and the policy's prefetch) starts gathering the unit
        that computes next."""
        self.prepare(unit)
        position = unit.position
        if position in self._ready:
            self._ready.remove(position)
            self.streams.current().wait_event(self._ready_events[position])
        if prefetch is None or not self.policy.prefetch:
            return
        successors = self._next_forward if prefetch == "forward" else self._next_backward
        following = successors.get(position)
        if following is None or (unit := self._unit(following)) is None:
            return
        if prefetch == "backward":
            # Keeps the gather under this unit's backward: the first one of a backward has no
            # release event to wait for and would otherwise run at once, under the loss's.
            self.order_gathers()
        self.prepare(unit, prefetch=True)

    def prepare_first_unit(self) -> None:
        """Starts gathering the unit the next forward begins with (`start_param_sync`)."""
        unit = self._unit(self._first_unit)
        if unit is not None:
            self.order_gathers()
            self.prepare(unit)

    def order_gathers(self) -> None:
        """Makes the all-gathers issued from now on run after the current stream's queued work
        (an optimizer step or a load that wrote the main weights). Called where a forward
        starts, before the first gather since the main weights changed, and before each
        backward prefetch; within a pass the main weights do not change, so other gathers need
        no further wait."""
        if self.streams is not None:
            self.streams.all_gather.wait_stream(self.streams.current())
        self._gathers_ordered = True

    def main_weights_changed(self) -> None:
        """An optimizer step or a load wrote the main weights on the current stream: the next
        gather or refresh must follow those writes."""
        self._gathers_ordered = False

    def prepare(self, unit: FsdpUnit, *, prefetch: bool = False) -> None:
        """Starts making `unit`'s compute weights whole: refreshes stale ones (when allowed)
        and all-gathers them, on the all-gather stream. Weights still held from an earlier use
        are kept instead of gathered again. A prefetch is skipped when the bound on held units
        leaves no room (the units held are all in use). Gathers and refreshes are ordered after
        the last `order_gathers()`, which runs first if the main weights changed since."""
        stale = [group for group in unit.groups if group.is_stale] if self.syncs_weights else []
        position = unit.position
        if position in self._resident:
            if not stale:
                self._releasable.pop(position, None)
                return
            self.free(unit)  # out of date
        transient = unit.has_transient_weights
        if not stale and not transient:
            return
        if transient and not self._make_room() and prefetch:
            return
        if not self._gathers_ordered:
            # Main weights written since the last ordering (a step, a load), or a unit used on
            # its own: the gather must follow those writes.
            self.order_gathers()
        with self._on_all_gather_stream():
            for group in stale:
                group.sync_model_weights()
            for group in unit.groups:
                group.unshard()
        if transient:
            self._resident[position] = None
        if self.streams is not None:
            self._ready_events[position].record(self.streams.all_gather)
            self._ready.add(position)

    def release(self, unit: FsdpUnit, *, after_backward: bool = False) -> None:
        """`unit`'s use is over (its forward or backward is queued): its whole weights may be
        freed once the bound requires it. After the backward of the unit that backward runs
        last, every released unit is freed now: no gather will need their room, and the rest
        of backward (the embeddings, the root's reductions) is where gradient memory peaks."""
        position = unit.position
        if position in self._resident:
            if self.streams is not None:
                self._release_events[position].record(self.streams.current())
            self._releasable[position] = None
            self._releasable.move_to_end(position)
        if after_backward and position not in self._next_backward:
            while self._releasable:
                self._free_oldest_released()

    def free(self, unit: FsdpUnit) -> None:
        """Frees `unit`'s whole weights once the current stream's work on them is done."""
        position = unit.position
        if position not in self._resident:
            return
        released = position in self._releasable
        if released:
            del self._releasable[position]
        if self.streams is not None:
            if released:
                self.streams.all_gather.wait_event(self._release_events[position])
            else:
                self.streams.all_gather.wait_stream(self.streams.current())
        # Freed on the CPU now, the memory returns to the all-gather stream, which only reuses
        # it after the wait just queued.
        for group in unit.groups:
            group.reshard()
        del self._resident[position]
        self._ready.discard(position)

    def free_all(self) -> None:
        """Frees every unit's whole weights after the current stream's queued work; the
        current stream then also waits for whatever the all-gather stream still runs (a
        prefetch nobody used), which rejoins it in a CUDA graph capture."""
        if self.streams is not None:
            self.streams.all_gather.wait_stream(self.streams.current())
        self._gathers_ordered = False
        for position in self._resident:
            if (unit := self._unit(position)) is not None:
                for group in unit.groups:
                    group.reshard()
        self._resident.clear()
        self._releasable.clear()
        self._ready.clear()
        if self.streams is not None:
            self.streams.current().wait_stream(self.streams.all_gather)

    def end_forward(self) -> None:
        """The root's forward (with autograd) is over: keeps only the unit released last, the
        first whose backward runs, and frees the others now, where activations peak; backward
        prefetches them again during the units before them."""
        while len(self._releasable) > 1:
            self._free_oldest_released()

    def zero_grad(self) -> None:
        """Forgets every unit's accumulated gradients and frees their memory (the adapter's
        `zero_grad_buffer()`)."""
        self._wait_pending_reductions()
        for unit in self.units():
            for group in unit.groups:
                if group.requires_grad:
                    group.zero_grad()

    def release_dropped_grads(self) -> None:
        """Frees the gradient memory of every group whose gradients the optimizer's
        `zero_grad()` dropped, before the forward where activations peak."""
        self._wait_pending_reductions()
        for unit in self.units():
            for group in unit.groups:
                group.release_dropped_grads()

    def _make_room(self) -> bool:
        """Frees the longest-released units until one more fits under the bound; False if it
        does not (every unit held is in use)."""
        while self._releasable and self._num_held() >= self.policy.max_unsharded_units:
            self._free_oldest_released()
        return self._num_held() < self.policy.max_unsharded_units

    def _free_oldest_released(self) -> None:
        oldest = next(iter(self._releasable))
        unit = self._unit(oldest)
        if unit is None:  # freed with its module
            self._releasable.pop(oldest)
            self._resident.pop(oldest, None)
        else:
            self.free(unit)

    def _num_held(self) -> int:
        return len(self._resident) - (0 in self._resident)

    def _unit(self, position: int) -> FsdpUnit | None:
        return self._units[position]()

    # Gradients.

    def reduce(self, unit: FsdpUnit, *, awaiting_only: bool = False) -> None:
        """Reduces `unit`'s gradients (every trainable group, or those awaiting gradients), on
        the reduce-scatter stream when the policy overlaps them.

        One unit's reduce-scatters are in flight at a time, as in FSDP2: the compute stream
        waits for the previous unit's (issued a whole unit's backward earlier) before casting
        this one's, so only one unit's reduction inputs are ever held. With symmetric memory
        (one buffer per process group and dtype) a unit's groups also wait for each other.
        """
        streams = self.streams if self.policy.overlap_grad_reduce else None
        groups = [
            group
            for group in unit.groups
            if group.requires_grad and (group.awaits_grads or not awaiting_only)
        ]
        if groups:
            self._wait_pending_reductions()
        for group in groups:
            if self.comm.symmetric is not None:
                self._wait_pending_reductions()
            sends = group.reduce_grads(streams)
            if sends is not None:
                self._reduced.record(streams.reduce_scatter)
                self._reductions.append(sends)

    def _wait_pending_reductions(self) -> None:
        """Makes the current stream wait for the reduce-scatters not yet waited for (in stream
        order: the last one's record covers all) and drops what they read, which frees it.
        None are pending after a complete backward; after a failed one the gradient buffers
        must not be freed before this."""
        if self._reductions:
            self.streams.current().wait_event(self._reduced)
            self._reductions.clear()

    def wait_reductions(self) -> None:
        """Makes the current stream wait for every reduce-scatter issued so far."""
        if self.streams is not None:
            self.streams.current().wait_stream(self.streams.reduce_scatter)
        self._reductions.clear()

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
        """End of backward: wait for the reduce-scatters, free whole weights, reduce what no
        unit's post-backward did, register main weights, and on the last microbatch run the
        deferred reductions."""
        self._callback_task = None
        units = list(self.units())
        # Backward is over: whole weights and the inputs of finished reduce-scatters are freed
        # before the root's gradients (often the largest: embeddings, output layer) are cast,
        # so the end of the step does not hold all of them at once.
        self.wait_reductions()
        self.free_all()
        for unit in units:
            self.reduce(unit, awaiting_only=True)
        self.wait_reductions()
        for unit in units:
            for group in unit.groups:
                group.use_dist_params()
        if self.is_last:
            self.finalize_grads(units)

    def finalize_grads(self, units: list[FsdpUnit] | None = None) -> None:
        """Runs every unit's deferred gradient reductions (idempotent)."""
        self.wait_reductions()
        for unit in units if units is not None else self.units():
            for group in unit.groups:
                if group.requires_grad:
                    group.finalize_grads()

    def _on_all_gather_stream(self) -> contextlib.AbstractContextManager:
        """Runs the body on the all-gather stream; on CPU (no streams) inline."""
        if self.streams is None:
            return contextlib.nullcontext()
        return self.streams.running_on(self.streams.all_gather)


def _successors(order: list[int]) -> dict[int, int]:
    """Each unit's successor in `order` (at its first occurrence)."""
    successors: dict[int, int] = {}
    for current, following in zip(order, order[1:]):
        successors.setdefault(current, following)
    return successors
