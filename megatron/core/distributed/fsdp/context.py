"""`FsdpContext`: the state shared by every FSDP unit under one root, and the choreography of a
pass: what happens before and after each unit's forward and backward.

The root is the outermost unit: the first whose forward runs (or the one `microbatch()` finds),
and it creates the context lazily. `fsdp_module.py` only registers hooks that call
`pre_forward`, `post_forward`, `pre_recompute`, `pre_backward` and `post_backward` here. The
context holds:

- the collectives issuer and, on GPU, the all-gather and reduce-scatter streams;
- the units' unsharded weights (`Residency`) and the order of the units, recorded in each
  forward, which prefetching follows;
- the reduce-scatters in flight, and the end-of-backward callback;
- the pass state, `TrainingState`, checked where it matters.

Pass states::

    IDLE --root pre-forward--> FORWARD --root post-forward--> IDLE
    IDLE --first pre-backward--> BACKWARD --end of backward--> IDLE

A root forward that finds the state not IDLE knows that the previous forward or backward raised:
it reshards every unit, registers the main weights again and drops the gradients that pass left
unreduced (`zero_grad_buffer()` and `finish_grad_sync()` do the same), so a failed pass leaves
nothing behind. At the start of each root forward the main version of every group is read once
(`weights.py`), with which weights are frozen, stale compute weights are refreshed (each
unit's device work queued ahead of its use, `residency.py`), and gradients an optimizer dropped
are freed. At the end of each backward the units that entered
it but were not reduced by their own post-backward (the root, units whose inputs need no
gradient) are reduced, however many backward passes run per forward; outside `no_sync()` /
`microbatch(is_last=False)` the gradients are then finalised (`finalize_grads`, the one place
that finalises).

With the root's gradient-accumulation options (`OverlapPolicy.keep_unsharded_params`,
`accumulate_unsharded_grads`), a microbatch that is not the last keeps the units it gathers
(`residency.py`) and defers its sharded reductions (`gradients.py`); the last microbatch's
backward frees each kept unit after its own backward and reduces the deferred sums, and
`finalize_grads` completes whatever a step left (no last microbatch). With `is_last` True, as
outside `microbatch()`, they change nothing.

Memory discipline (GPU): see `residency.py` for unsharded weights; reduce-scatter inputs
(gradients cast to the reduction dtype, or written there by linear layers during the unit's
backward) are allocated and freed on the compute stream, which waits for the reduce-scatter that
read them before casting the next. The all-gather stream waits for the compute stream's queued
work at the start of each root forward (and wherever gathers start outside one), not before
every gather: all-gathers read the main weights, which change only between passes; in backward
each prefetch also waits, to stay under the unit computing when it is issued. On CPU there are
no streams and every step runs in program order.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.autograd import Variable

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.gradients import GradState, GroupGrads
from megatron.core.distributed.fsdp.overlap import CommStreams, OverlapPolicy
from megatron.core.distributed.fsdp.profiling import PhaseLabels
from megatron.core.distributed.fsdp.rank_check import UnitsRunCheck
from megatron.core.distributed.fsdp.residency import Residency, ScheduledUnit
from megatron.core.distributed.fsdp.symmetric_memory import place_weights_in_windows


class TrainingState(enum.Enum):
    """Where the root's pass is (module docstring)."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (in this thread)."""
    return torch._C._current_graph_task_id() != -1


class FsdpContext:
    """Shared by the units of one root (which owns it; the others hold it weakly).

    Args:
        units: the root first, then every unit below it in module order.
        policy: the root's communication schedule.
        device: where the units' buffers live.

    Attributes:
        comm: the collectives issuer of every unit.
        streams: the side streams (CUDA only; None on CPU).
        residency: the units' unsharded weights.
        labels: the profiler labels (off unless `set_profiler_labels`).
        state: where the pass is.
        is_last: whether the end of this backward finalises the gradients; True outside
            `microbatch()` / `no_sync()`.
    """

    def __init__(self, units: list[ScheduledUnit], policy: OverlapPolicy, device: torch.device):
        self.policy = policy
        self.streams = CommStreams(device) if device.type == "cuda" else None
        self.comm = Collectives()
        self.labels = PhaseLabels(device)
        self.state = TrainingState.IDLE
        self.is_last = True
        # The root unit owns this context, so units are referred to by their position in
        # `units` (0: the root, `FsdpUnit.position`), which keeps the context from holding the
        # root strongly.
        self._units = [weakref.ref(unit) for unit in units]
        window_slots = self._place_in_windows(units, device) if policy.use_symm_mem else {}
        self.residency = Residency(
            len(units), self._unit, policy, self.streams, self.labels, window_slots
        )
        groups = [group for unit in units for group in unit.groups]
        shard_groups = groups[0].weights.groups if groups else None
        check_groups = [] if shard_groups is None else [shard_groups.shard, shard_groups.outer]
        self._check = UnitsRunCheck(
            [g for g in check_groups if g is not None], device, [unit.name for unit in units]
        )
        self._callback_task: int | None = None
        self._creates_graph = False  # the backward in progress has `create_graph=True`
        # Units whose pre-backward / post-backward ran in the current backward, and how many
        # forwards with autograd of each unit no reduction has matched yet (a unit run twice
        # gets its parameters' gradients only after both runs' backward, after its first
        # post-backward).
        self._entered: set[int] = set()
        self._reduced: set[int] = set()
        self._unreduced_forwards: collections.Counter[int] = collections.Counter()
        # The groups of the last unit reduced whose reduce-scatters are in flight on their
        # stream (what they read is kept, unwritten, until the compute stream waits for
        # `_reduced_event`).
        self._reducing: list[GroupGrads] = []
        if self.streams is not None:
            self._reduced_event = torch.cuda.Event()
        # Orders of the last complete forward (initially module order), and the one recording.
        positions = list(range(len(units)))
        self._next_forward = _successors(positions)
        self._next_backward = _successors([0, *reversed(positions[1:])])
        self._first_unit = 0
        self._recording: tuple[list[int], list[int]] | None = None

    def _place_in_windows(self, units: list[ScheduledUnit], device: torch.device) -> dict[int, int]:
        """Moves the compute weights into symmetric windows (`symmetric_memory.py`): with
        `keep_unsharded_params` each unit has its own place (all may be kept at once), else
        transient weights share `max_unsharded_units` + 1 slots. Returns the units' slots."""
        policy = self.policy
        ring_size = None if policy.keep_unsharded_params else policy.max_unsharded_units + 1
        return place_weights_in_windows(units, ring_size, device)

    def units(self) -> Iterator[ScheduledUnit]:
        """The live units, root first, then in module order."""
        for ref in self._units:
            unit = ref()
            if unit is not None:
                yield unit

    def _unit(self, position: int) -> ScheduledUnit | None:
        return self._units[position]()

    @contextlib.contextmanager
    def microbatch_state(self, is_last: bool) -> Iterator[None]:
        """Sets `is_last` for the scope and restores the previous value."""
        previous = self.is_last
        self.is_last = is_last
        try:
            yield
        finally:
            self.is_last = previous

    # Forward.

    def pre_recompute(self, unit: ScheduledUnit) -> None:
        """Before an activation-recompute rerun of `unit`'s forward, inside a backward: its
        weights are already in use, unless its forward ran without autograd (a reentrant
        checkpoint's first pass), whose backward no hook announced: the end of this backward
        then reduces it."""
        self._queue_end_of_backward()
        self._entered.add(unit.position)
        self._use(unit, "recompute")
        self._register(unit, unsharded=True)

    def pre_forward(self, unit: ScheduledUnit) -> bool:
        """Before `unit`'s forward (outside a backward: `pre_recompute` there): unshard and
        register its compute weights, prefetch the next unit's. Returns whether the unit's
        inputs must report the end of its backward (a forward with autograd)."""
        position = unit.position
        if position == 0:
            self._begin_pass()
        elif self.state is TrainingState.IDLE:
            # A unit used on its own: nothing ordered its gathers after the latest writes.
            self._prepare_outside_pass(unit)
        if self._recording is not None:
            self._recording[0].append(position)
        with self.labels(unit, "forward"):
            self._use(unit, "forward", self._next_forward)
        self._register(unit, unsharded=True)
        if not torch.is_grad_enabled():
            return False
        self._unreduced_forwards[position] += 1
        return True

    def _begin_pass(self) -> None:
        """The root's forward starts: recover from a failed pass, read every group's main
        version and frozen weights, refresh stale compute weights (`Residency.refresh`), free
        gradients an optimizer dropped."""
        self._recover_failed_pass()
        self._check.resolve()
        self.state = TrainingState.FORWARD
        self._recording = ([], [])
        self._wait_pending_reductions()
        self.residency.order_gathers()
        units = list(self.units())
        for unit in units:
            for group in unit.groups:
                group.weights.observe_main_weights()
                if group.grads is not None:
                    group.grads.free_if_dropped()
        self.residency.refresh(units)

    def _prepare_outside_pass(self, unit: ScheduledUnit) -> None:
        """A unit used outside the root's forward: its gathers follow the latest writes, and
        its compute weights follow the main weights."""
        for group in unit.groups:
            group.weights.observe_main_weights()
        self.residency.order_gathers()
        self.residency.refresh([unit])

    def post_forward(self, unit: ScheduledUnit) -> None:
        """After `unit`'s forward (not a recompute rerun, after which the backward needs the
        weights registered as they are): register the main weights, release (or, at the
        root's end, reshard) unsharded weights."""
        self._register(unit, unsharded=False)
        position = unit.position
        if self._recording is not None:
            self._recording[1].append(position)
        if position != 0:
            self.residency.release(unit)
            return
        self._end_pass()
        if torch.is_grad_enabled():
            # Keeps only the unit released last, the first whose backward runs, and the root
            # (which backward starts with); backward prefetches the others again.
            self.residency.keep_last_released()
        else:
            self.residency.reshard_all()  # the end of an inference forward

    def _end_pass(self) -> None:
        """The root's forward ended: the recorded order takes effect (forward prefetching
        follows the pre-forward order, backward the reversed post-forward order, the order the
        units' backward hooks fire in), the ranks compare the units they ran, and the
        refreshes of units the forward did not run are queued."""
        self.state = TrainingState.IDLE
        pre, post = self._recording
        self._recording = None
        self._first_unit = pre[0]
        self._next_forward = _successors(pre)
        self._next_backward = _successors(list(reversed(post)))
        self._check.after_forward(pre)
        self.residency.queue_refreshes()

    def _use(self, unit: ScheduledUnit, phase: str, successors: dict[int, int] | None = None):
        """Makes `unit`'s compute weights whole and ready for the current stream (kept until
        the step's last backward with `keep_unsharded_params` in a microbatch that is not the
        last), then (with `successors`) starts gathering the unit that computes next, with the
        policy's prefetch, and in a forward queues the refreshes of that unit and the one after
        it (`Residency.refresh`)."""
        keep = self.policy.keep_unsharded_params and not self.is_last
        self.residency.unshard(unit, phase, keep=keep)
        self.residency.wait(unit)
        if successors is None:
            return
        following = successors.get(unit.position)
        if following is None or (next_unit := self._unit(following)) is None:
            return
        if self.policy.prefetch:
            if phase == "backward":
                # Keeps the gather under this unit's backward: the first one of a backward has
                # no release event to wait for and would otherwise run at once, under the
                # loss's.
                self.residency.order_gathers()
            self.residency.unshard(next_unit, phase, prefetch=True)
        elif phase == "forward":
            self.residency.refresh_ahead(following)  # holds no memory early: a cast, a gather
        # The refresh of the unit after it goes behind that gather, a unit ahead of its own:
        # queued together, the gather would wait for the refresh's casts. A backward finds no
        # refresh left but those of units the forward did not run, queued at their use.
        if phase == "forward" and (after := successors.get(following)) is not None:
            self.residency.refresh_ahead(after)

    @staticmethod
    def _register(unit: ScheduledUnit, *, unsharded: bool) -> None:
        for group in unit.groups:
            if unsharded:
                group.weights.register_unsharded()
            else:
                group.weights.register_sharded()

    def unshard(self, unit: ScheduledUnit) -> None:
        """Starts gathering `unit`'s compute weights ahead of its use (`FsdpModule.unshard`)."""
        self._recover_failed_pass()
        self._prepare_outside_pass(unit)
        self.residency.unshard(unit, "forward")

    def unshard_first_unit(self) -> None:
        """Starts gathering the unit the next forward begins with (`start_param_sync`)."""
        unit = self._unit(self._first_unit)
        if unit is not None:
            self.unshard(unit)

    def mark_main_weights_written(self) -> None:
        """Refreshes every compute weight before its next use, whatever the versions say."""
        for unit in self.units():
            for group in unit.groups:
                group.weights.mark_written()

    # Backward.

    def pre_backward(self, unit: ScheduledUnit) -> None:
        """Before `unit`'s backward: gather and register its compute weights (a recompute
        inside the unit reads them from the modules), and prefetch the next unit's."""
        self._queue_end_of_backward()
        self._entered.add(unit.position)
        with self.labels(unit, "backward"):
            self._use(unit, "backward", self._next_backward)
        self._register(unit, unsharded=True)

    def post_backward(self, unit: ScheduledUnit) -> None:
        """After `unit`'s backward: reduce its gradients (missing ones as zeros, so every rank
        reduces the same groups in the same order), release its unsharded weights (all
        released ones after the unit backward runs last; kept ones in the last microbatch),
        register the main weights."""
        if torch.is_grad_enabled():
            # A backward with `create_graph=True` (others run without grad, and skip the cost
            # of entering `no_grad` once per unit): the gradients' graph holds the whole
            # weights, which stay until the end of the next backward without it.
            with torch.no_grad():
                self.reduce(unit)
                self._reduced.add(unit.position)
                self._register(unit, unsharded=False)
            return
        self.reduce(unit)
        self._reduced.add(unit.position)
        self.residency.release(
            unit, free_released=unit.position not in self._next_backward, ends_keep=self.is_last
        )
        self._register(unit, unsharded=False)

    def reduce(self, unit: ScheduledUnit) -> None:
        """Reduces `unit`'s gradients, on the reduce-scatter stream when the policy overlaps
        them.

        One unit's reduce-scatters are in flight at a time, as in FSDP2: the compute stream
        waits for the previous unit's (issued a whole unit's backward earlier) before casting
        this one's, so at most two units' reduction inputs are held (one, and this unit's
        gradients in the compute dtype, where linear layers do not write them there). With
        `accumulate_unsharded_grads` in a microbatch that is not the last, sharded
        gradients are summed whole instead (`GroupGrads.reduce`), which issues nothing.
        """
        position = unit.position
        if self._unreduced_forwards[position] > 0:
            self._unreduced_forwards[position] -= 1
        streams = self.streams if self.policy.overlap_grad_reduce else None
        defer = self.policy.accumulate_unsharded_grads and not self.is_last
        grads = [group.grads for group in unit.groups if group.grads is not None]
        if not grads:
            return
        self._wait_pending_reductions()
        with self.labels(unit, "reduce-scatter"):
            for group_grads in grads:
                if group_grads.reduce(streams, defer=defer):
                    self._reduced_event.record(streams.reduce_scatter)
                    self._reducing.append(group_grads)

    def _wait_pending_reductions(self) -> None:
        """Makes the current stream wait for the reduce-scatters not yet waited for and frees
        what they read.

        Every piece of work on the reduce-scatter stream is followed by a record of
        `_reduced_event`, so the last record covers all of it (stream order), and nothing is
        waited for when nothing was issued since the last wait: inside a CUDA graph capture a
        wait on the stream's earlier, uncaptured work would fail it (a microbatch whose
        reductions are deferred issues none).
        """
        if self._reducing:
            self._reduced_event.wait(self.streams.current())
            for grads in self._reducing:
                grads.reduction_done()
            self._reducing.clear()

    def _queue_end_of_backward(self) -> None:
        """Makes the current backward call `end_of_backward` once when it finishes."""
        # Keyed by graph task: a backward that raised never ran its callback, and must not stop
        # the next backward from queueing one.
        task = torch._C._current_graph_task_id()
        if self._callback_task == task:
            return
        self._callback_task = task
        self._creates_graph = torch.is_grad_enabled()
        self.state = TrainingState.BACKWARD
        context = weakref.ref(self)

        def callback() -> None:
            owner = context()
            if owner is not None:
                owner.end_of_backward()

        Variable._execution_engine.queue_callback(callback)

    @torch.no_grad()
    def end_of_backward(self) -> None:
        """Waits for the reduce-scatters, reshards every unit (but those kept for a later
        microbatch), reduces the units that entered this backward (or ran a forward) without a
        reduction of their own, registers the main weights, and outside `no_sync()` finalises
        the gradients."""
        self._callback_task = None
        units = list(self.units())
        # Unsharded weights and the inputs of finished reduce-scatters are freed before the
        # root's gradients (often the largest: embeddings, output layer) are cast, so the end
        # of the step does not hold all of them at once.
        self._wait_pending_reductions()
        if not self._creates_graph:
            self.residency.reshard_all(except_kept=not self.is_last)
        for unit in units:
            position = unit.position
            entered_only = position in self._entered and position not in self._reduced
            if entered_only or self._unreduced_forwards[position] > 0:
                self.reduce(unit)
        self._wait_pending_reductions()
        for unit in units:
            self._register(unit, unsharded=False)
        self._entered.clear()
        self._reduced.clear()
        self.state = TrainingState.IDLE
        if self.is_last:
            self.finalize_grads()

    def _recover_failed_pass(self) -> None:
        """After a forward or backward that raised (the state is not IDLE outside a pass):
        reshards every unit, registers the main weights, drops the gradients the failed pass
        left unreduced; what it reduced stays, in the main weights' `.grad`, as torch leaves a
        failed backward's gradients in `.grad` (and so does what linear layers added to whole
        gradient sums themselves, gradient-accumulation fusion)."""
        if self.state is TrainingState.IDLE or in_backward():
            return
        self._wait_pending_reductions()
        self.residency.reshard_all()
        for unit in self.units():
            self._register(unit, unsharded=False)
            for group in unit.groups:
                if group.grads is not None:
                    group.grads.drop_unreduced()
        self._callback_task = None
        self._recording = None
        self._entered.clear()
        self._reduced.clear()
        self._unreduced_forwards.clear()
        self.state = TrainingState.IDLE

    # Gradients, once per step.

    def finalize_grads(self) -> None:
        """Runs every unit's deferred gradient reductions: each group still ACCUMULATING
        becomes READY (the one place that finalises; a READY group has nothing to run), after
        reduce-scattering gradients still summed whole (a step whose last microbatch did not
        run them, `accumulate_unsharded_grads`). Frees the compute weights kept for the step.
        Reads the last forward's rank check first: gradients from mismatched reductions must
        not reach the optimizer."""
        self._recover_failed_pass()
        self._check.resolve()
        self._wait_pending_reductions()
        self.residency.drop_kept()
        for unit in self.units():
            for group in unit.groups:
                grads = group.grads
                if grads is None:
                    continue
                grads.reduce_deferred()
                if grads.state is GradState.ACCUMULATING:
                    grads.finalize()

    def zero_grad(self) -> None:
        """Forgets every unit's gradients and frees their memory (`zero_grad_buffer()`)."""
        self._recover_failed_pass()
        self._wait_pending_reductions()
        for unit in self.units():
            for group in unit.groups:
                if group.grads is not None:
                    group.grads.zero_grad()

    def drop_held_grads(self, units: Iterable[ScheduledUnit]) -> None:
        """Forgets the gradients `units` hold outside any `.grad` (`FsdpModule.zero_grad`)."""
        self._recover_failed_pass()
        self._wait_pending_reductions()
        for unit in units:
            for group in unit.groups:
                if group.grads is not None:
                    group.grads.drop_held()


def _successors(order: list[int]) -> dict[int, int]:
    """Each unit's successor in `order` (at its first occurrence)."""
    successors: dict[int, int] = {}
    for current, following in zip(order, order[1:]):
        successors.setdefault(current, following)
    return successors
