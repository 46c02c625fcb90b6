"""Numeric flags out of range are refused by validation, naming the flag (rather than failing
later with a message that blames something else), and the edges of each range are accepted.
Every float flag of the parser has a range: NaN, infinities and values just outside it are
refused, values at (or just inside) its edges pass."""

from __future__ import annotations

import argparse
import math

import pytest

from megatron.core.value_ranges import Range
from megatron.training.arguments import add_megatron_arguments, parse_args
from megatron.training.configs_from_args import transformer_config_from_flags
from megatron.training.flag_ranges import _FLAG_ONLY_RANGES, FLOAT_FLAG_RANGES, check_float_flags
from tests.unit_tests.training.flag_checks import BASE, validated

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
    "adam-eps-negative": (("--adam-eps=-1e-8",), "--adam-eps -1e-08 must be >= 0"),
    "seq-length-0": (("--seq-length", "0"), "--seq-length must be >= 1, got 0"),
    "min-lr-above-lr": (("--min-lr", "0.01"), "--min-lr 0.01 must be in [0, --lr 0.001]"),
    "lr-nan": (("--lr", "nan"), "--lr nan must be >= 0 and finite"),
    "min-loss-scale-nan": (("--min-loss-scale", "nan"), "--min-loss-scale nan must be > 0"),
    "hidden-dropout-1": (("--hidden-dropout", "1"), "--hidden-dropout 1.0 must be in [0, 1)"),
    "adam-beta2-inf": (("--adam-beta2", "inf"), "--adam-beta2 inf must be in [0, 1)"),
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
    # What torch and Megatron-LM accept, though they are seldom useful.
    ("--adam-eps", "0", "adam_eps"),
    ("--init-method-std", "0", "init_method_std"),
]


@pytest.mark.parametrize("flag, value, dest", ACCEPTED)
def test_edge_of_range_is_accepted(flag, value, dest):
    extra = ("--min-lr", "0") if flag == "--lr" else ()
    args = validated(*ROPE, flag, value, *extra)
    assert getattr(args, dest) == type(getattr(args, dest))(value)


def _float_flags() -> dict[str, str]:
    """Each float flag of the parser (its first option string) and its destination."""
    parser = add_megatron_arguments(argparse.ArgumentParser())
    return {
        action.option_strings[0]: action.dest
        for action in parser._actions
        if action.type is float or isinstance(action.default, float)
    }


FLOAT_FLAGS = _float_flags()


def test_every_float_flag_has_a_range():
    assert set(FLOAT_FLAGS.values()) <= set(FLOAT_FLAG_RANGES)
    assert set(_FLAG_ONLY_RANGES) <= set(FLOAT_FLAGS.values())  # none for a removed flag


def _outside(allowed: Range) -> list[float]:
    """The finite values nearest to the range that it excludes."""
    values = []
    if allowed.low is not None:
        values.append(allowed.low if allowed.low_open else math.nextafter(allowed.low, -math.inf))
    if allowed.high is not None:
        high = allowed.high
        values.append(high if allowed.high_open else math.nextafter(high, math.inf))
    return values


def _edges(allowed: Range) -> list[float]:
    """The values at the range's closed edges and just inside its open ones."""
    values = []
    if allowed.low is not None:
        low = allowed.low
        values.append(math.nextafter(low, math.inf) if allowed.low_open else low)
    if allowed.high is not None:
        high = allowed.high
        values.append(math.nextafter(high, -math.inf) if allowed.high_open else high)
    return values


@pytest.mark.parametrize("option", FLOAT_FLAGS)
def test_float_flag_refuses_non_finite_and_out_of_range_values_naming_itself(option):
    allowed = FLOAT_FLAG_RANGES[FLOAT_FLAGS[option]]
    for value in ["nan", "inf", "-inf", *map(repr, _outside(allowed))]:
        with pytest.raises(ValueError) as error:
            validated(f"{option}={value}")
        message = str(error.value)
        assert message.startswith(f"{option} ") and f" must be {allowed}." in message, message


@pytest.mark.parametrize("option", FLOAT_FLAGS)
def test_float_flag_accepts_the_edges_of_its_range(option):
    allowed = FLOAT_FLAG_RANGES[FLOAT_FLAGS[option]]
    for value in _edges(allowed):
        check_float_flags(parse_args(args=[*BASE, f"{option}={value!r}"]))


MOE = ("--num-experts", "4", "--moe-router-topk", "2")


@pytest.mark.parametrize(
    "flags, dest, value",
    [
        # Megatron-core's dropless: a negative capacity factor becomes None.
        (("--moe-expert-capacity-factor=-1",), "moe_expert_capacity_factor", None),
        (("--moe-z-loss-coeff", "0"), "moe_z_loss_coeff", 0.0),
        # The bias update rate matters only with the expert bias.
        (("--moe-router-bias-update-rate", "0"), "moe_router_bias_update_rate", 0.0),
    ],
)
def test_moe_values_megatron_core_accepts_are_accepted(flags, dest, value):
    config = transformer_config_from_flags(validated(*MOE, *flags))
    assert getattr(config, dest) == value
