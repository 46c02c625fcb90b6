"""Delayed scaling: the amax histories and scales of a model's FP8 tensors, Transformer Engine's
`DelayedScaling` recipe.

Each FP8 linear layer of a model owns one forward slot (its input) and one backward slot (its output
gradient) in its block's `DelayedScalingState` (the decoder's, or the multi-token prediction
depths'). A cast during a pass uses the slot's current scale and max-es the tensor's absolute
maximum into row 0 of the slot's history. At the end of each pass, forward at the end of the block's
forward and backward once the block's backward is done (`end_forward` / `end_backward`), the row 0
of every slot of that direction is all-reduced with MAX over the amax group in ONE collective, and
every slot is updated as Transformer Engine's `delayed_scaling.cu` (`kernel_bulk`) does, with `a`
the reduced amax:

- `a == 0` (the slot was not used): nothing changes;
- else the history rolls: `h'[j] = h[j + 1]` for `j < H - 1`, `h'[H - 1] = a`; the amax of the
  window is `max(h')` ("max", NaN ignored as `fmaxf` does) or `a` ("most_recent"); then
  `h'[0] = 0`, ready for the next pass's record;
- the scale becomes `fp8_max * 2**-margin / amax` where that amax is finite and > 0, else it
  keeps its value; an infinite scale becomes the largest fp32.

Histories start at 0 and scales at 1 (the first pass casts with scale 1, as upstream).

The amax group is every rank of the model's pipeline stage (tensor x data x context parallel,
Megatron-LM's `get_amax_reduction_group`), so all ranks cast with the same scales.

Recomputation: a checkpointed forward runs again in backward, after `end_forward` changed the
scales. `scale_replay_contexts()` (entered by `transformer.recompute`) keeps the scales a
checkpoint's forward started with and gives them back while it is recomputed, during which no
amax is recorded: the recomputed casts are the forward's, bit for bit.

Checkpoints: the state is a submodule of the transformer block (`decoder.fp8_state`; the
multi-token prediction depths own one of their own, `mtp.fp8_state`) whose
histories and scales are its `_extra_state` in the model's state dict, the bytes of a
`torch.save` of CPU copies (Transformer Engine's way), so a resumed run casts as the
uninterrupted one. Loading resizes a history saved with another length as Transformer Engine
does; a state dict without the entry (a model trained in bf16 or with current scaling) loads as
the initial state.
"""

from __future__ import annotations

import contextlib
import io
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron.core.fp8 import kernels
from megatron.core.fp8.quantize import FLT_MAX
from megatron.core.fp8.recipe import Fp8Recipe, fp8_max
from megatron.core.utils import FreshContext

FORWARD, BACKWARD = "forward", "backward"

STATE_KEYS = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd")
"""The entries of the saved state: Transformer Engine's extra-state names."""

_EXTRA_STATE_KEY_SUFFIX = "_extra_state"
"""The name `torch.nn.Module.state_dict()` gives a module's `get_extra_state()` value."""

_live_states: weakref.WeakSet[DelayedScalingState] = weakref.WeakSet()
"""Every state alive, for the recompute contexts (a module global, as the RNG tracker is:
checkpoints do not know which models they run)."""


class _Slots:
    """The amax history `[H, n]` and scales `[n]` of one direction's slots, and each slot's
    one-element views of them that its casts use."""

    def __init__(self, max_value: float) -> None:
        self.count = 0
        self.max_value = max_value
        self.history: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.cast_views: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per slot, (its scale, its record in history row 0): made once per placement of
        the tensors, which are then only written in place, rather than at every cast."""
        self.range_views: dict[range, tuple[torch.Tensor, torch.Tensor]] = {}
        """The same per range of slots cast together (`cast_range`): made at its first cast,
        then at each placement."""

    def materialize(self, history_len: int, device: torch.device) -> None:
        self.history = torch.zeros(history_len, self.count, dtype=torch.float32, device=device)
        self.scale = torch.ones(self.count, dtype=torch.float32, device=device)

    def make_cast_views(self) -> None:
        records = self.history[0]
        self.cast_views = [
            (self.scale.narrow(0, slot, 1), records.narrow(0, slot, 1))
            for slot in range(self.count)
        ]
        for slots in self.range_views:
            self.add_range(slots)

    def add_range(self, slots: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Makes (and keeps) the views of `slots`' scales and records."""
        first, count = slots.start, len(slots)
        views = self.scale.narrow(0, first, count), self.history[0].narrow(0, first, count)
        self.range_views[slots] = views
        return views


class _ReplayScales(NamedTuple):
    """The forward scales a recomputation casts with, `[n]`; one view of them per slot, and
    one per range of slots cast together (those a forward cast already, made up front)."""

    scales: torch.Tensor
    views: list[torch.Tensor]
    ranges: dict[range, torch.Tensor]


class DelayedScalingState(torch.nn.Module):
    """The delayed-scaling state of one model's FP8 linear layers (module docstring).

    Its tensors are made at the first cast, on that cast's device (a model built on the meta
    device gets them where it computes). Slots are handed out before that, as layers are built.

    A module without parameters or buffers: its histories and scales travel in the model's
    state dict as its `_extra_state` (`get_extra_state`), a non-tensor value, as Transformer
    Engine keeps its FP8 metadata, so the state dict's tensors are the same as without FP8.

    Args:
        recipe: a delayed recipe (history length, compute algorithm, margin, dtypes).
        group: the amax group; None: no reduction (one rank).
    """

    def __init__(self, recipe: Fp8Recipe, group: dist.ProcessGroup | None) -> None:
        if not recipe.delayed:
            raise ValueError(f"DelayedScalingState needs a delayed recipe, got {recipe.kind!r}.")
        super().__init__()
        self.recipe = recipe
        self.group = group
        self._slots = {
            FORWARD: _Slots(fp8_max(recipe.forward_dtype)),
            BACKWARD: _Slots(fp8_max(recipe.backward_dtype)),
        }
        # Where the casts use the tensors; None until the first cast, and after a load into a
        # state without tensors (the loaded ones wait on the CPU for the first cast).
        self._device: torch.device | None = None
        # The checkpoints being recomputed (innermost last): each one's scale snapshot (None
        # stands for the initial scales: a checkpoint run before the first cast) and its scales
        # on the casts' device with their views (None until the tensors are placed).
        self._replays: list[tuple[torch.Tensor | None, _ReplayScales | None]] = []
        _live_states.add(self)

    @property
    def materialized(self) -> bool:
        """Whether the tensors exist (a cast or a load happened)."""
        return self._slots[FORWARD].history is not None

    def new_slot(self, direction: str) -> int:
        """A new slot of `direction` ("forward" or "backward"); before the first cast.

        Raises:
            RuntimeError: the tensors exist already.
        """
        return self.new_slots(direction, 1).start

    def new_slots(self, direction: str, count: int) -> range:
        """`count` new consecutive slots of `direction` (an MoE projection's experts, whose
        casts take a range of them at once: `cast_range`); before the first cast.

        Raises:
            RuntimeError: the tensors exist already.
        """
        if self.materialized:
            raise RuntimeError("FP8 slots must all be made before the first FP8 cast.")
        slots = self._slots[direction]
        slots.count += count
        return range(slots.count - count, slots.count)

    def _place(self, device: torch.device) -> None:
        """Makes the tensors on `device` (initial values), or moves the loaded ones there."""
        for slots in self._slots.values():
            if slots.history is None:
                slots.materialize(self.recipe.amax_history_len, device)
            else:
                slots.history, slots.scale = slots.history.to(device), slots.scale.to(device)
            slots.make_cast_views()
        self._device = device

    def cast_tensors(
        self, direction: str, slot: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(scale(direction, slot, device), amax_record(direction, slot))`: what a cast of
        `slot` on `device` uses now, in one call (the linear layers' per-cast path)."""
        if device != self._device:
            self._place(device)
        if direction == FORWARD and self._replays:
            return self._replay_scales(device).views[slot], None
        return self._slots[direction].cast_views[slot]

    def cast_range(
        self, direction: str, slots: range, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`cast_tensors` of consecutive slots at once: their scales and their records, each a
        view of `len(slots)` elements (the records None during a recomputation). The views are
        made at the range's first cast, so a recomputation dispatches no op for them (as
        `replaying` says)."""
        if device != self._device:
            self._place(device)
        if direction == FORWARD and self._replays:
            replay = self._replay_scales(device)
            scales = replay.ranges.get(slots)
            if scales is None:  # a range no forward cast before
                scales = replay.ranges[slots] = replay.scales.narrow(0, slots.start, len(slots))
            return scales, None
        tensors = self._slots[direction]
        views = tensors.range_views.get(slots)
        return views if views is not None else tensors.add_range(slots)

    def _replay_scales(self, device: torch.device) -> _ReplayScales:
        """The scales the innermost recomputation casts with, on `device`."""
        snapshot, scales = self._replays[-1]
        if scales is None:
            scales = self._replay_views(snapshot, device)
            self._replays[-1] = (snapshot, scales)
        return scales

    def scale(self, direction: str, slot: int, device: torch.device) -> torch.Tensor:
        """The scale a cast of `slot` uses now: a one-element view of the state (during a
        recomputation, of the checkpoint's snapshot). Each cast asks for it before
        `amax_record`: it puts the tensors on the cast's device."""
        return self.cast_tensors(direction, slot, device)[0]

    def amax_record(self, direction: str, slot: int) -> torch.Tensor | None:
        """Where a cast of `slot` max-es its absolute maximum (a one-element view of history
        row 0), or None during a recomputation (its forward recorded it already)."""
        if direction == FORWARD and self._replays:
            return None
        return self._slots[direction].cast_views[slot][1]

    def _replay_views(self, snapshot: torch.Tensor | None, device: torch.device) -> _ReplayScales:
        """The forward scales in `snapshot` (None: the initial ones) on `device`, with their
        views."""
        forward = self._slots[FORWARD]
        if snapshot is None:
            scales = torch.ones(forward.count, dtype=torch.float32, device=device)
        else:
            # A snapshot taken before the first cast after a load is still on the CPU.
            scales = snapshot.to(device)
        ranges = {slots: scales.narrow(0, slots.start, len(slots)) for slots in forward.range_views}
        return _ReplayScales(scales, list(scales.split(1)), ranges)

    def end_forward(self) -> None:
        """Reduces and updates the forward slots (after the block's forward)."""
        self._end_pass(FORWARD)

    def end_backward(self) -> None:
        """Reduces and updates the backward slots (after the block's backward)."""
        self._end_pass(BACKWARD)

    def _end_pass(self, direction: str) -> None:
        if self._device is None:  # no cast recorded an amax
            return
        slots = self._slots[direction]
        if slots.count == 0:
            return
        self._reduce_amaxes(slots.history[0])
        update_delayed_scaling(
            slots.history,
            slots.scale,
            slots.max_value * 2.0**-self.recipe.margin,
            self.recipe.amax_compute_algo,
        )

    def _reduce_amaxes(self, amaxes: torch.Tensor) -> None:
        """All-reduces `amaxes` (row 0 of a direction's history) with MAX over the amax group:
        one collective per pass."""
        if self.group is not None and self.group.size() > 1:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=self.group)

    # Recomputation.

    def snapshot(self) -> torch.Tensor | None:
        """A copy of the forward scales (None before the first cast: the initial ones)."""
        if not self.materialized:
            return None
        return self._slots[FORWARD].scale.clone()

    @contextlib.contextmanager
    def replaying(self, snapshot: torch.Tensor | None) -> Iterator[None]:
        """Forward casts use `snapshot`'s scales and record nothing.

        The views of the scales are made here where the tensors are placed already, not by
        the recomputed casts: a recomputation may dispatch no op its forward did not (a
        selective checkpoint stores the forward's outputs by op and count)."""
        scales = None if self._device is None else self._replay_views(snapshot, self._device)
        self._replays.append((snapshot, scales))
        try:
            yield
        finally:
            self._replays.pop()

    # Checkpoints.

    def scaling_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the histories and scales, on their device, under Transformer Engine's
        extra-state names (`STATE_KEYS`); empty before the first cast (the initial state)."""
        if not self.materialized:
            return {}
        forward, backward = self._slots[FORWARD], self._slots[BACKWARD]
        return {
            "amax_history_fwd": forward.history.clone(),
            "scale_fwd": forward.scale.clone(),
            "amax_history_bwd": backward.history.clone(),
            "scale_bwd": backward.scale.clone(),
        }

    def load_scaling_tensors(self, values: dict[str, torch.Tensor]) -> None:
        """Restores `scaling_tensors()`'s values; an empty dict restores the initial state.

        A history of another length (a changed `--fp8-amax-history-len`) is resized as
        Transformer Engine's `adjust_amax_history_length` does (`adjust_amax_history_length`);
        the scales are kept.

        Raises:
            ValueError: a missing entry, or another number of slots (the state of another
                model).
        """
        if not values:
            if self.materialized:
                for slots in self._slots.values():
                    slots.history.zero_()
                    slots.scale.fill_(1.0)
            return
        missing = [key for key in STATE_KEYS if key not in values]
        if missing:
            raise ValueError(
                f"the FP8 delayed-scaling state lacks {missing}: it was not saved by "
                "DelayedScalingState. Load a checkpoint saved by this code, or one without FP8 "
                "state (which starts from the initial state)."
            )
        loaded = {}
        for direction, suffix in ((FORWARD, "fwd"), (BACKWARD, "bwd")):
            history, scale = values[f"amax_history_{suffix}"], values[f"scale_{suffix}"]
            count = self._slots[direction].count
            if history.dim() != 2 or scale.shape != (count,) or history.shape[1] != count:
                raise ValueError(
                    f"the FP8 delayed-scaling state holds {direction} amax histories "
                    f"{list(history.shape)} and scales {list(scale.shape)} (history length x "
                    f"slots); this model has {count} {direction} slots (one per FP8 linear "
                    "layer): the state is of another model. Load a checkpoint of this model."
                )
            history = adjust_amax_history_length(history, self.recipe.amax_history_len)
            loaded[direction] = (history, scale)
        for direction, (history, scale) in loaded.items():
            slots = self._slots[direction]
            if slots.history is None:  # placed on the first cast's device
                slots.history = history.to(torch.float32, copy=True)
                slots.scale = scale.to(torch.float32, copy=True)
                slots.make_cast_views()
            else:
                slots.history.copy_(history)
                slots.scale.copy_(scale)

    def get_extra_state(self) -> io.BytesIO:
        """The histories and scales for the model's state dict: the bytes of a `torch.save` of
        CPU copies of `scaling_tensors()` (an empty dict before the first cast), as Transformer
        Engine saves its FP8 metadata."""
        buffer = io.BytesIO()
        torch.save({key: value.cpu() for key, value in self.scaling_tensors().items()}, buffer)
        buffer.seek(0)
        return buffer

    def set_extra_state(self, state: io.BytesIO | None) -> None:
        """Restores `get_extra_state()`'s value (None: the initial state).

        Raises:
            TypeError: `state` is not `get_extra_state()`'s.
            ValueError: as `load_scaling_tensors`.
        """
        if state is None:
            self.load_scaling_tensors({})
            return
        if not isinstance(state, io.BytesIO):
            raise TypeError(
                f"the FP8 delayed-scaling state is a {type(state).__name__}, not the "
                "io.BytesIO DelayedScalingState.get_extra_state() returns; load a state dict "
                "saved by this code."
            )
        # A copy of the bytes: the caller's stream keeps its position.
        values = torch.load(io.BytesIO(state.getvalue()), map_location="cpu", weights_only=True)
        self.load_scaling_tensors(values)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """As `torch.nn.Module`'s, except that a state dict without this state's entry (of a
        model trained without delayed scaling, or weights only) loads as the initial state
        rather than missing a key."""
        key = prefix + _EXTRA_STATE_KEY_SUFFIX
        absent = key not in state_dict
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if absent:
            if key in missing_keys:
                missing_keys.remove(key)
            self.set_extra_state(None)

    def extra_repr(self) -> str:
        forward, backward = self._slots[FORWARD].count, self._slots[BACKWARD].count
        return f"{self.recipe.describe()}, {forward} forward and {backward} backward slots"


def adjust_amax_history_length(history: torch.Tensor, length: int) -> torch.Tensor:
    """`history` (`[H, n]`) with `length` rows, as Transformer Engine's
    `adjust_amax_history_length`: a shorter one keeps the first `length` rows, a longer one gets
    rows of zeros at the end (the same tensor when `H == length`)."""
    rows = history.shape[0]
    if length <= rows:
        return history[:length]
    return torch.nn.functional.pad(history, (0, 0, 0, length - rows))


@torch.no_grad()
def update_delayed_scaling(
    history: torch.Tensor, scale: torch.Tensor, scaled_max: float, compute_algo: str
) -> None:
    """Transformer Engine's delayed-scaling update of every slot, in place (module docstring).

    Args:
        history: `[H, n]` fp32; row 0 holds this pass's (reduced) amaxes.
        scale: `[n]` fp32.
        scaled_max: `fp8_max * 2**-margin`.
        compute_algo: "max" or "most_recent".

    On CUDA with Triton this is one kernel (`kernels.update_scales`, the same bits) instead of
    some twenty launches.
    """
    if kernels.updates_scales(history, scale):
        kernels.update_scales(history, scale, scaled_max, compute_algo == "max")
        return
    amax = history[0].clone()
    used = amax != 0  # NaN counts as used, as in the kernel
    rolled = torch.roll(history, -1, dims=0)  # rolled[H - 1] = history[0] = amax
    if compute_algo == "max":
        # fmaxf from 0: NaNs are skipped.
        amax = torch.where(torch.isnan(rolled), 0.0, rolled).amax(dim=0)
    rolled[0] = 0.0
    history.copy_(torch.where(used, rolled, history))
    new_scale = torch.full_like(amax, scaled_max) / amax  # a true division (`compute_scale`)
    new_scale = torch.where(torch.isfinite(amax) & (amax > 0) & used, new_scale, scale)
    scale.copy_(torch.where(torch.isinf(new_scale), FLT_MAX, new_scale))


def scale_replay_contexts() -> tuple[
    contextlib.AbstractContextManager, contextlib.AbstractContextManager
]:
    """`(forward_context, recompute_context)` for a non-reentrant checkpoint's `context_fn`:
    the first snapshots the forward scales of every delayed-scaling state as the checkpoint's
    forward starts, the second replays them in each recomputation (module docstring)."""
    snapshots: dict[DelayedScalingState, torch.Tensor | None] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        for state in list(_live_states):
            snapshots[state] = state.snapshot()
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for state, snapshot in snapshots.items():
                stack.enter_context(state.replaying(snapshot))
            yield

    return forward(), FreshContext(recompute)
