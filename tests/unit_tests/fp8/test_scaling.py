"""Delayed scaling's update against a direct formula: per slot, the window of the last H amaxes
of the passes that used the slot, `max` (NaN skipped) or the most recent, the scale
`fp8_max * 2^-margin / amax` where finite and positive, else unchanged, an infinite scale
clamped to the largest fp32. Plus the state's checkpoint round trip."""

from __future__ import annotations

import collections
import math
import random

import pytest
import torch

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
            stored = state.state_dict()
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


def test_state_dict_round_trip_and_a_mismatch_is_refused():
    recipe = Fp8Recipe("hybrid", "delayed", amax_history_len=3, amax_compute_algo="max")
    source = DelayedScalingState(recipe, group=None)
    target = DelayedScalingState(recipe, group=None)
    for state in (source, target):
        state.new_slot(FORWARD), state.new_slot(BACKWARD)
    source.scale(FORWARD, 0, torch.device("cpu"))
    for value in (5.0, 7.0):
        source.amax_record(FORWARD, 0).fill_(value)
        source.amax_record(BACKWARD, 0).fill_(value / 2)
        source.end_forward(), source.end_backward()
    target.load_state_dict(source.state_dict())
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
    other = DelayedScalingState(Fp8Recipe("hybrid", "delayed", amax_history_len=4), group=None)
    other.new_slot(FORWARD), other.new_slot(BACKWARD)
    with pytest.raises(ValueError, match="--fp8-amax-history-len"):
        other.load_state_dict(source.state_dict())
