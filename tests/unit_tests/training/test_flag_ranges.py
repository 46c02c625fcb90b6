"""Numeric flags out of range are refused by validation, naming the flag (rather than failing
later with a message that blames something else), and the edges of each range are accepted."""

from __future__ import annotations

import pytest

from tests.unit_tests.training.flag_checks import validated

ROPE = ("--position-embedding-type", "rope")

REFUSED = {
    # id: (flags, the error)
    "rotary-base-0": ((*ROPE, "--rotary-base", "0"), "--rotary-base 0 must be > 0"),
    "rotary-base-negative": ((*ROPE, "--rotary-base=-10000"), "--rotary-base -10000 must be > 0"),
    "rotary-base-without-rope": (("--rotary-base", "0"), "--rotary-base 0 must be > 0"),
    "rotary-percent-0": (
        (*ROPE, "--rotary-percent", "0"),
        "--rotary-percent 0.0 must be in (0, 1]",
    ),
    "rotary-percent-above-1": (
        (*ROPE, "--rotary-percent", "1.5"),
        "--rotary-percent 1.5 must be in (0, 1]",
    ),
    "norm-epsilon-0": (("--norm-epsilon", "0"), "--norm-epsilon 0.0 must be > 0"),
    "timeout-0": (
        ("--distributed-timeout-minutes", "0"),
        "--distributed-timeout-minutes 0 must be >= 1",
    ),
    "timeout-negative": (
        ("--distributed-timeout-minutes=-5", "--use-megatron-fsdp"),
        "--distributed-timeout-minutes -5 must be >= 1",
    ),
    "lr-negative": (("--lr=-0.001",), "--lr -0.001 must be >= 0"),
    "decoupled-lr-negative": (("--decoupled-lr=-0.001",), "--decoupled-lr -0.001 must be >= 0"),
    "weight-decay-negative": (("--weight-decay=-0.1",), "--weight-decay -0.1 must be >= 0"),
    # Refused already (by the optimizer or transformer config, or the required-flag checks);
    # here so that each keeps naming its flag.
    "clip-grad-negative": (("--clip-grad=-1",), "--clip-grad -1.0 must be >= 0"),
    "adam-eps-0": (("--adam-eps", "0"), "--adam-eps 0.0 must be > 0"),
    "seq-length-0": (("--seq-length", "0"), "--seq-length must be >= 1, got 0"),
    "min-lr-negative": (("--min-lr=-0.1",), "--min-lr -0.1 must be in [0, --lr 0.001]"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_out_of_range_value_is_refused_naming_its_flag(case):
    flags, message = REFUSED[case]
    with pytest.raises(ValueError) as error:
        validated(*flags)
    assert message in str(error.value)


ACCEPTED = [
    # (flag, the edge of its range, its dest)
    ("--rotary-base", "1", "rotary_base"),
    ("--rotary-percent", "1.0", "rotary_percent"),
    ("--distributed-timeout-minutes", "1", "distributed_timeout_minutes"),
    ("--lr", "0", "lr"),
    ("--weight-decay", "0", "weight_decay"),
    ("--clip-grad", "0", "clip_grad"),
    ("--norm-epsilon", "1e-12", "layernorm_epsilon"),
]


@pytest.mark.parametrize("flag, value, dest", ACCEPTED)
def test_edge_of_range_is_accepted(flag, value, dest):
    extra = ("--min-lr", "0") if flag == "--lr" else ()
    args = validated(*ROPE, flag, value, *extra)
    assert getattr(args, dest) == type(getattr(args, dest))(value)
