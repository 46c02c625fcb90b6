"""`Residency`: which units of a root hold their unsharded (whole) weights, and when they are
unsharded, waited for and resharded.

Under ZeRO-3 a unit's unsharded weights exist from its all-gather to its reshard. Residency
bounds how many units hold them at once (`OverlapPolicy.max_unsharded_units`, delayed release:
a unit whose use is over is resharded only when another gather needs the room) and orders the
streams around that memory on GPU: unsharded weights and all-gather staging are allocated and
freed on the all-gather stream, which waits for the event recorded after a unit's last use
before freeing it; the compute stream waits for the event recorded after a unit's gather before
using it. Nothing relies on `record_stream`. On CPU there are no streams and every step runs in
program order.

Under gradient accumulation with `OverlapPolicy.keep_unsharded_params` a unit gathered in a
microbatch that is not the step's last is *kept*: its uses do not release it and the end of that
backward does not free it, so later microbatches reuse it without gathering; kept units do not
count against the bound. The last microbatch's backward frees each kept unit right after its own
backward (the all-gather stream first waits for the compute stream, as for any free), and the end
of that backward, or of the step (`drop_kept`), frees the rest.

With `use_symm_mem` the compute weights of several units share one symmetric-memory slot
(`symmetric_memory.py`): a unit is gathered into its slot only once the unit holding it is
resharded, as a released unit is when the bound needs room; a prefetch whose slot a unit in use
holds is skipped.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from megatron.core.distributed.fsdp.fp8_gather import Fp8ComputeWeights, Fp8Refresh
from megatron.core.distributed.fsdp.overlap import CommStreams, OverlapPolicy
from megatron.core.distributed.fsdp.param_group import FsdpParameterGroup
from megatron.core.distributed.fsdp.weights import GroupWeights

_INLINE = contextlib.nullcontext()
"""A body that runs where it is: on the current stream, unlabelled."""


class ScheduledUnit(Protocol):
    """What the context and residency need of a unit (`FsdpUnit` is one)."""

    name: str
    position: int
    groups: list[FsdpParameterGroup]
    has_transient_weights: bool


class Residency:
    """The unsharded weights held by the units of one root.

    Args:
        num_units: how many units the root has (positions 0..n-1; 0 is the root).
        unit: position -> the live unit, or None once freed with its module.
        policy: the bound on units held.
        streams: the side streams (None on CPU).
        labels: opens a profiler range (`profiling.PhaseLabels`).
        window_slots: position -> the symmetric-memory slot its compute weights live in (units
            of one slot never hold them at once); empty without `use_symm_mem`.
    """

    def __init__(
        self,
        num_units: int,
        unit: Callable[[int], ScheduledUnit | None],
        policy: OverlapPolicy,
        streams: CommStreams | None,
        labels: Callable[[ScheduledUnit, str], contextlib.AbstractContextManager],
        window_slots: dict[int, int],
    ):
        self._unit = unit
        self._policy = policy
        self._streams = streams
        self._labels = labels
        # Units holding unsharded weights (ordered set), those whose last use is done (oldest
        # release first), those whose gather was not yet waited for, and those kept until the
        # step's last backward (a subset of the resident ones, never releasable).
        self._resident: dict[int, None] = {}
        self._releasable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._ready: set[int] = set()
        self._kept: set[int] = set()
        self._window_slots = window_slots
        self._fp8_refresh = Fp8Refresh()
        # The refreshes whose device work waits for their unit's first unshard, by position:
        # the unit's stale groups' weights and the position that names its FP8 casts' batch;
        # and the casts of each batch not queued yet, by that position (its first unit's).
        self._unqueued: dict[int, tuple[list[GroupWeights], int | None]] = {}
        self._unqueued_casts: dict[int, list[Fp8ComputeWeights]] = {}
        # The event after each unit's gather and after its last use (GPU): a wait queued on an
        # event is not affected by later records.
        if streams is not None:
            self._ready_events = [torch.cuda.Event() for _ in range(num_units)]
            self._release_events = [torch.cuda.Event() for _ in range(num_units)]

    def order_gathers(self) -> None:
        """Makes the all-gathers (and refreshes) issued from now on run after the current
        stream's queued work (an optimizer step or a load that wrote the main weights, or the
        unit computing when a backward prefetch is issued)."""
        if self._streams is not None:
            self._streams.wait(self._streams.all_gather, self._streams.current())

    def refresh(self, units: Iterable[ScheduledUnit]) -> None:
        """Makes the stale compute weights of `units` follow the main weights: their unsharded
        weights held from older main weights are resharded and FP8 compute weights
        (`fp8_gather.py`) take their amaxes, all of them reduced in one collective per shard
        group (`Fp8Refresh.scale`), now. The rest of each unit's refresh (its casts, copies and
        gathers, on the all-gather stream) is queued now where any unit's issues a collective
        (every rank then issues them at once, in one order), else at the unit's first unshard
        or `refresh_ahead`, or at the end of the forward (`queue_refreshes`): queued at once,
        they would all run ahead of the gather of the unit that computes first (3 ms of casts
        per step in the Llama-3-8B-layer FP8 model on one GPU). A unit is ready once its own
        refresh is done; one whose refresh queues no device work only records the version it
        follows, now.

        FP8 weights that stay whole are cast in launches of the groups of 1, 1, 2, 4, ... units
        in the units' order, each queued with the first of its units' refreshes to be queued
        (`_doubling_batches`): the first unit waits for its own cast only, and one launch per
        unit would cost the host a launch each."""
        stale = [
            (unit, [group.weights for group in unit.groups if group.weights.is_stale])
            for unit in units
        ]
        stale = [(unit, weights) for unit, weights in stale if weights]
        if not stale:
            return
        fp8 = [[w for w in weights if w.fp8 is not None] for _, weights in stale]
        batch_of: dict[int, int] = {}
        if any(fp8):
            with self._on_all_gather_stream():
                pending = [[w.start_fp8_refresh() for w in weights] for weights in fp8]
                comm = next(weights for weights in fp8 if weights)[0].comm
                self._fp8_refresh.scale([w for weights in pending for w in weights], comm)
            holding = [i for i, weights in enumerate(pending) if weights]
            for batch in _doubling_batches(holding):
                first = stale[batch[0]][0].position
                self._unqueued_casts[first] = [w for i in batch for w in pending[i]]
                batch_of.update(dict.fromkeys(batch, first))
        queued = []
        for i, (unit, weights) in enumerate(stale):
            self.reshard(unit)
            # ZeRO-3's refresh (whose every use gathers from the main weights) or that of
            # compute weights that are the main weights only records the version it follows.
            if any(w.refreshes_on_device for w in weights):  # FP8 weights among them
                self._unqueued[unit.position] = (weights, batch_of.get(i))
                queued.append(unit)
            else:
                for group_weights in weights:
                    group_weights.refresh()
        if any(w.refresh_communicates for _, weights in stale for w in weights):
            for unit in queued:
                self._queue_refresh(unit)

    def refresh_ahead(self, position: int) -> None:
        """Queues the device work of the refresh (`refresh`) of the unit at `position` on the
        all-gather stream, if not queued yet, ahead of the unit's use."""
        if position in self._unqueued and (unit := self._unit(position)) is not None:
            self._queue_refresh(unit)

    def queue_refreshes(self) -> None:
        """Queues the device work of every refresh not queued yet (of units a forward did not
        run), so that none waits beyond it (nor holds the weights of a unit freed since)."""
        for position in list(self._unqueued):
            unit = self._unit(position)
            if unit is None:
                del self._unqueued[position]
            else:
                self._queue_refresh(unit)
        self._unqueued_casts.clear()  # those of batches whose units are all gone

    def _queue_refresh(self, unit: ScheduledUnit) -> None:
        """Queues `unit`'s refresh, after its batch's casts if not queued yet (by a unit of the
        batch that came first)."""
        position = unit.position
        weights, batch = self._unqueued.pop(position)
        with self._on_all_gather_stream(), self._labels(unit, "refresh"):
            casts = self._unqueued_casts.pop(batch, None) if batch is not None else None
            if casts:
                self._fp8_refresh.cast(casts)
            for group_weights in weights:
                group_weights.refresh()
        if self._streams is not None:
            self._ready_events[position].record(self._streams.all_gather)
        self._ready.add(position)

    def unshard(
        self, unit: ScheduledUnit, phase: str, *, prefetch: bool = False, keep: bool = False
    ) -> None:
        """Starts all-gathering `unit`'s unsharded weights (ZeRO-3), on the all-gather stream,
        after its refresh if not queued yet (`refresh`); weights still held from an earlier use
        are kept (`refresh` reshards those made from older main weights). A prefetch is
        skipped when the bound leaves no room (the units held are all in use). `phase` names the
        pass in the profiler label; with `keep` the weights are kept until the step's last
        backward (module docstring)."""
        position = unit.position
        if position in self._unqueued:
            self._queue_refresh(unit)
        if position in self._resident:
            self._releasable.pop(position, None)
        elif not unit.has_transient_weights or (not self._make_room() and prefetch):
            return
        elif self._window_slots and not self._claim_slot(unit, prefetch):
            return
        else:
            with self._on_all_gather_stream(), self._labels(unit, f"{phase} all-gather"):
                for group in unit.groups:
                    group.weights.unshard()
            self._resident[position] = None
            if self._streams is not None:
                self._ready_events[position].record(self._streams.all_gather)
            self._ready.add(position)
        if keep:
            self._kept.add(position)

    def wait(self, unit: ScheduledUnit) -> None:
        """Makes the current stream wait for `unit`'s gather, if not done already."""
        position = unit.position
        if position in self._ready:
            self._ready.remove(position)
            if self._streams is not None:
                self._ready_events[position].wait(self._streams.current())

    def release(
        self, unit: ScheduledUnit, *, free_released: bool = False, ends_keep: bool = False
    ) -> None:
        """`unit`'s use is over (its forward or backward is queued): its weights may be
        resharded once the bound requires it; with `free_released`, every released unit is
        resharded now. A kept unit stays unless `ends_keep` (its last use in the step), which
        reshards it now: no gather of the step is left to make room."""
        position = unit.position
        if position in self._kept:
            if ends_keep:
                self.reshard(unit)
        elif position in self._resident:
            if self._streams is not None:
                self._release_events[position].record(self._streams.current())
            self._releasable[position] = None
            self._releasable.move_to_end(position)
        if free_released:
            while self._releasable:
                self._reshard_oldest_released()

    def reshard(self, unit: ScheduledUnit) -> None:
        """Frees `unit`'s unsharded weights once the current stream's work on them is done."""
        position = unit.position
        if position not in self._resident:
            return
        released = position in self._releasable
        if released:
            del self._releasable[position]
        if self._streams is not None:
            if released:
                self._release_events[position].wait(self._streams.all_gather)
            else:
                self._streams.wait(self._streams.all_gather, self._streams.current())
        # Freed on the CPU now, the memory returns to the all-gather stream, which only reuses
        # it after the wait just queued.
        for group in unit.groups:
            group.weights.reshard()
        self._forget(position)

    def reshard_all(self, *, except_kept: bool = False) -> None:
        """Frees every unit's unsharded weights (with `except_kept`, those of units not kept)
        after the current stream's queued work; the current stream then also waits for
        whatever the all-gather stream still runs (a prefetch nobody used), which rejoins it in
        a CUDA graph capture."""
        streams = self._streams
        if streams is not None:
            streams.wait(streams.all_gather, streams.current())
        if not except_kept:
            self._kept.clear()
        kept = self._kept
        for position in self._resident:
            if position not in kept and (unit := self._unit(position)) is not None:
                for group in unit.groups:
                    group.weights.reshard()
        self._resident = dict.fromkeys(kept)
        self._releasable.clear()
        self._ready &= kept
        if streams is not None:
            streams.wait(streams.current(), streams.all_gather)

    def drop_kept(self) -> None:
        """Frees the kept units' weights (the step is over), after the current stream's
        queued work."""
        for position in list(self._kept):
            self._reshard_position(position)

    def keep_last_released(self) -> None:
        """Reshards every released unit but the last (the first whose backward runs)."""
        while len(self._releasable) > 1:
            self._reshard_oldest_released()

    def _make_room(self) -> bool:
        """Reshards the longest-released units until one more fits under the bound; False if
        it does not (every unit held is in use)."""
        bound = self._policy.max_unsharded_units
        while self._releasable and self._num_held() >= bound:
            self._reshard_oldest_released()
        return self._num_held() < bound

    def _reshard_oldest_released(self) -> None:
        self._reshard_position(next(iter(self._releasable)))

    def _reshard_position(self, position: int) -> None:
        """Reshards the unit at `position`, or forgets it if it was freed with its module."""
        unit = self._unit(position)
        if unit is None:
            self._releasable.pop(position, None)
            self._forget(position)
        else:
            self.reshard(unit)

    def _forget(self, position: int) -> None:
        """Records that the unit at `position` holds no compute weights (any more)."""
        self._resident.pop(position, None)
        self._ready.discard(position)
        self._kept.discard(position)

    def _claim_slot(self, unit: ScheduledUnit, prefetch: bool) -> bool:
        """Makes `unit`'s symmetric-memory slot (if any) its own before its gather, resharding
        the unit that holds it if its use is over or has not begun (a prefetch this pass did
        not follow); False for a prefetch whose slot a unit in use holds.

        Raises:
            RuntimeError: a unit in use holds the slot that `unit` needs now.
        """
        slot = self._window_slots.get(unit.position)
        if slot is None:
            return True  # a unit with a place of its own
        holder = next((p for p in self._resident if self._window_slots.get(p) == slot), None)
        if holder is None:
            return True
        if holder in self._releasable or holder in self._ready:
            self._reshard_position(holder)
            return True
        if prefetch:
            return False
        other = self._unit(holder)
        raise RuntimeError(
            f"use_symm_mem: units {unit.name} and {other.name if other else holder} share a "
            f"symmetric-memory slot for their compute weights, and {unit.name} is needed while "
            "the other is still in use (more than max_unsharded_units + 1 units that contain "
            "no other unit in use at once: one calls another that is not its submodule, or "
            "FSDPModule.unshard() was called on several). Raise "
            "OverlapPolicy.max_unsharded_units, or set use_symm_mem=False (--use-symm-mem off)."
        )

    def _num_held(self) -> int:
        """Units under the bound: resident, neither the root nor kept."""
        root = 0 in self._resident and 0 not in self._kept
        return len(self._resident) - len(self._kept) - root

    def _on_all_gather_stream(self) -> contextlib.AbstractContextManager:
        """Runs the body on the all-gather stream; on CPU (no streams) inline."""
        if self._streams is None:
            return _INLINE
        return self._streams.running_on(self._streams.all_gather)


def _doubling_batches(items: list[int]) -> list[list[int]]:
    """`items` in consecutive batches of 1, 1, 2, 4, 8, ... (the last holds what is left)."""
    batches, start, size = [], 0, 1
    while start < len(items):
        batches.append(items[start : start + size])
        start += size
        size = start
    return batches
