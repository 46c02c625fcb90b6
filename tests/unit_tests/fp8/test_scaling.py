"""Delayed scaling's update against a direct formula: per slot, the window of the last H amaxes
of the passes that used the slot, `max` (NaN skipped) or the most recent, the scale
`fp8_max * 2^-margin / amax` where finite and positive, else unchanged, an infinite scale
clamped to the largest fp32. Plus the state's checkpoint round trip (its `_extra_state`),
against values worked out by hand."""

from __future__ import annotations

import collections
import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.scaling import BACKWARD, FORWARD, DelayedScalingState
from tests.unit_tests.fp8.reference import FLT_MAX

F32 = torch.float32


class _ReferenceSlot:
    """One slot's delayed scaling, written out with a deque."""

    def __init__(self, history_len: int, algo: str, scaled_max: float):
        self.window = collections.deque([0.0] * history_len, maxlen=history_len)
        self.algo, self.scaled_max = algo, torch.tensor(scaled_max, dtype=F32)
        self.scale = torch.tensor(1.0, dtype=F32)

    def update(self, amax: float) -> None:
        if amax == 0:  # unused this pass (NaN is not 0: it is recorded)
            return
        self.window.append(amax)
        if self.algo == "max":
            chosen = max(0.0 if math.isnan(a) else a for a in self.window)
        else:
            chosen = amax
        chosen = torch.tensor(chosen, dtype=F32)
        if torch.isfinite(chosen) and chosen > 0:
            self.scale = self.scaled_max / chosen
            if torch.isinf(self.scale):
                self.scale = torch.tensor(FLT_MAX, dtype=F32)

    def history(self) -> list[float]:
        """The stored history: row 0 cleared for the next pass, then the window's older H - 1."""
        return [0.0, *list(self.window)[1:]]


def _amax(rng: random.Random) -> float:
    return rng.choice([0.0, 0.0, float("inf"), float("nan"), 1e-44, rng.uniform(0, 10), 3.0])


@pytest.mark.parametrize("history_len", [1, 4])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_update_matches_the_direct_formula(history_len, algo, margin, fmt):
    recipe = Fp8Recipe(
        fmt, "delayed", margin=margin, amax_history_len=history_len, amax_compute_algo=algo
    )
    state = DelayedScalingState(recipe, group=None)
    slots = 3
    for direction in (FORWARD, BACKWARD):
        for _ in range(slots):
            state.new_slot(direction)
    state.scale(FORWARD, 0, torch.device("cpu"))  # makes the tensors
    maxima = {FORWARD: 448.0, BACKWARD: 57344.0 if fmt == "hybrid" else 448.0}
    references = {
        direction: [
            _ReferenceSlot(history_len, algo, maxima[direction] * 2.0**-margin)
            for _ in range(slots)
        ]
        for direction in (FORWARD, BACKWARD)
    }
    rng = random.Random(f"{history_len}{algo}{margin}{fmt}")
    for _ in range(12):
        for direction, end in ((FORWARD, state.end_forward), (BACKWARD, state.end_backward)):
            amaxes = [_amax(rng) for _ in range(slots)]
            for slot, amax in enumerate(amaxes):
                state.amax_record(direction, slot).fill_(amax)
            end()
            stored = state.scaling_tensors()
            suffix = "fwd" if direction == FORWARD else "bwd"
            for slot, (reference, amax) in enumerate(zip(references[direction], amaxes)):
                reference.update(amax)
                assert _same(stored[f"amax_history_{suffix}"][:, slot], reference)
                assert torch.equal(stored[f"scale_{suffix}"][slot], reference.scale), (
                    direction,
                    slot,
                    amaxes,
                )


def _same(history: torch.Tensor, reference: _ReferenceSlot) -> bool:
    expected = torch.tensor(reference.history(), dtype=F32)
    return bool(((history == expected) | (history.isnan() & expected.isnan())).all())


def test_a_fresh_state_casts_with_scale_one_and_keeps_unused_slots():
    state = DelayedScalingState(Fp8Recipe("hybrid", "delayed", amax_history_len=2), group=None)
    for _ in range(2):
        state.new_slot(FORWARD)
    assert state.scale(FORWARD, 1, torch.device("cpu")).item() == 1.0
    state.amax_record(FORWARD, 0).fill_(2.0)
    state.end_forward()
    assert state.scale(FORWARD, 0, torch.device("cpu")).item() == 224.0
    assert state.scale(FORWARD, 1, torch.device("cpu")).item() == 1.0
    with pytest.raises(RuntimeError, match="before the first FP8 cast"):
        state.new_slot(FORWARD)


def _trained_state(history_len: int = 3, forward_slots: int = 1) -> DelayedScalingState:
    """A state of `forward_slots` forward slots and one backward slot after two passes whose
    slot-0 amaxes were 5 then 7 (forward) and 2.5 then 3.5 (backward), `max` over the window."""
    recipe = Fp8Recipe("hybrid", "delayed", amax_history_len=history_len, amax_compute_algo="max")
    state = DelayedScalingState(recipe, group=None)
    for _ in range(forward_slots):
        state.new_slot(FORWARD)
    state.new_slot(BACKWARD)
    state.scale(FORWARD, 0, torch.device("cpu"))
    for value in (5.0, 7.0):
        state.amax_record(FORWARD, 0).fill_(value)
        state.amax_record(BACKWARD, 0).fill_(value / 2)
        state.end_forward(), state.end_backward()
    return state


TRAINED = {
    # Row 0 cleared for the next pass, then the window, oldest first; the scales are
    # 448 / 7 (E4M3) and 57344 / 3.5 (E5M2), both exact in fp32.
    "amax_history_fwd": torch.tensor([[0.0], [5.0], [7.0]]),
    "scale_fwd": torch.tensor([64.0]),
    "amax_history_bwd": torch.tensor([[0.0], [2.5], [3.5]]),
    "scale_bwd": torch.tensor([16384.0]),
}
"""`_trained_state()`'s histories and scales, worked out by hand."""


def _saved_values(state_dict: dict) -> dict[str, torch.Tensor]:
    """The histories and scales a state dict of the state holds, decoded."""
    assert list(state_dict) == ["_extra_state"]  # no tensors: the model's stay as they are
    return torch.load(state_dict["_extra_state"], weights_only=True)


def test_state_dict_round_trip_holds_the_histories_and_scales():
    source = _trained_state()
    saved = source.state_dict()
    assert_same_values(_saved_values(source.state_dict()), TRAINED)
    target = _trained_state()
    target.load_scaling_tensors({})  # back to the initial state first
    target.load_state_dict(saved)
    assert_same_values(target.scaling_tensors(), TRAINED)
    # The next cast uses the loaded scale, and the next pass continues the loaded window.
    assert target.scale(FORWARD, 0, torch.device("cpu")).item() == 64.0
    target.amax_record(FORWARD, 0).fill_(1.0)
    target.end_forward()
    assert target.scaling_tensors()["amax_history_fwd"].flatten().tolist() == [0.0, 7.0, 1.0]
    assert target.scale(FORWARD, 0, torch.device("cpu")).item() == 64.0


def test_a_state_before_the_first_cast_saves_and_loads_the_initial_state():
    fresh = _fresh_state(history_len=3)
    assert _saved_values(fresh.state_dict()) == {}
    for state_dict in (fresh.state_dict(), {}):  # an empty state, or none (a bf16 model's)
        state = _trained_state()
        state.load_state_dict(state_dict)
        assert_same_values(
            state.scaling_tensors(),
            {
                "amax_history_fwd": torch.zeros(3, 1),
                "scale_fwd": torch.ones(1),
                "amax_history_bwd": torch.zeros(3, 1),
                "scale_bwd": torch.ones(1),
            },
        )


@pytest.mark.parametrize(
    "length, rows",
    [
        (2, [[0.0], [5.0]]),  # shorter: the first rows
        (3, [[0.0], [5.0], [7.0]]),
        (5, [[0.0], [5.0], [7.0], [0.0], [0.0]]),  # longer: zero rows at the end
    ],
)
def test_a_changed_history_length_resizes_as_transformer_engine(length, rows):
    state = _fresh_state(history_len=length)
    state.load_state_dict(_trained_state().state_dict())
    values = state.scaling_tensors()
    assert values["amax_history_fwd"].tolist() == rows
    assert values["amax_history_bwd"].tolist() == [[r[0] / 2] for r in rows]
    assert torch.equal(values["scale_fwd"], TRAINED["scale_fwd"])
    assert torch.equal(values["scale_bwd"], TRAINED["scale_bwd"])


def test_the_state_of_another_model_is_refused():
    target = _fresh_state(history_len=3, forward_slots=2)
    with pytest.raises(ValueError, match=r"this model has 2 forward slots .* another model"):
        target.load_state_dict(_trained_state().state_dict())
    assert not target.materialized  # nothing was loaded


def _fresh_state(history_len: int, forward_slots: int = 1) -> DelayedScalingState:
    recipe = Fp8Recipe("hybrid", "delayed", amax_history_len=history_len, amax_compute_algo="max")
    state = DelayedScalingState(recipe, group=None)
    for _ in range(forward_slots):
        state.new_slot(FORWARD)
    state.new_slot(BACKWARD)
    return state


def assert_same_values(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == F32 and torch.equal(actual[key], value), key


def test_a_state_loaded_before_the_first_cast_moves_to_that_casts_device():
    """Loaded into a state without tensors, the values wait on the CPU (the state does not know
    where its model computes) and move to the first cast's device (the meta device here, for a
    GPU), the scales a recomputed checkpoint replays too."""
    state = _fresh_state(history_len=3)
    state.load_state_dict(_trained_state().state_dict())
    assert state.scaling_tensors()["scale_fwd"].device.type == "cpu"
    snapshot = state.snapshot()  # a checkpoint's forward starting before the first cast
    meta = torch.device("meta")
    assert state.scale(BACKWARD, 0, meta).device == meta
    assert {value.device for value in state.scaling_tensors().values()} == {meta}
    with state.replaying(snapshot):
        assert state.scale(FORWARD, 0, meta).device == meta


class _Dispatched(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_range_of_slots_casts_with_views_made_once():
    """An MoE projection's experts cast with a range of consecutive slots: their scales and
    records are views of the state's tensors, made at the range's first cast; later casts, and
    a recomputation's (which uses the snapshot's scales and records nothing), dispatch no op
    for them (a selective checkpoint replays the forward's ops by count)."""
    state = DelayedScalingState(Fp8Recipe("hybrid", "delayed"), group=None)
    for direction in (FORWARD, BACKWARD):
        for _ in range(5):
            state.new_slot(direction)
    experts = range(1, 4)
    device = torch.device("cpu")
    scales, records = state.cast_range(FORWARD, experts, device)
    records.copy_(torch.tensor([1.0, 2.0, 4.0]))
    state.end_forward()
    assert state.scaling_tensors()["scale_fwd"][1:4].tolist() == [448.0, 224.0, 112.0]
    assert scales.tolist() == [448.0, 224.0, 112.0], "a view of the state's scales"
    snapshot = state.snapshot()
    scales.mul_(2)  # the state's scales move on; the recomputation keeps the snapshot's
    with _Dispatched() as dispatched:
        again = state.cast_range(FORWARD, experts, device)
    with state.replaying(snapshot), _Dispatched() as replay_dispatched:
        replayed, record = state.cast_range(FORWARD, experts, device)
    assert dispatched.ops == replay_dispatched.ops == [] and again[0] is scales
    assert record is None and replayed.tolist() == [448.0, 224.0, 112.0]
    grads, _ = state.cast_range(BACKWARD, range(0, 5), device)
    assert grads.shape == (5,) and grads.tolist() == [1.0] * 5
