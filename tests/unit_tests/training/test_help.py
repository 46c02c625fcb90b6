"""What a user reads about the flags: `pretrain_gpt.py --help` lists the built flags (those of
features not built are recognised and refused, and said to exist), a flag error is short, enum
flags show the values users type, and the arguments print at start-up lists the built flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from megatron.training.arguments import add_megatron_arguments, parse_args
from megatron.training.flag_groups.unbuilt import (
    PERFORMANCE_HINTS,
    TOKENIZER_UNBUILT,
    UNBUILT,
    VALUED_HINTS,
    unbuilt_dests,
)
from megatron.training.initialize import _format_args
from tests.unit_tests.program_launcher import run_program
from tests.unit_tests.training.flag_checks import BASE, validated

ROOT = Path(__file__).resolve().parents[3]
UNBUILT_FLAGS = {flag for u in UNBUILT + TOKENIZER_UNBUILT for flag in (*u.switches, *u.valued)}
NO_OPS = {flag for flag, *_ in PERFORMANCE_HINTS + VALUED_HINTS}
"""Upstream flags accepted with no effect: hidden from --help as the refused ones are."""
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][\w-]*")


@pytest.fixture(scope="module")
def help_text() -> str:
    done = run_program(ROOT / "pretrain_gpt.py", ["--help"], cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_lists_the_built_flags_only(help_text):
    parser = add_megatron_arguments(argparse.ArgumentParser())
    flags = {o for action in parser._actions for o in action.option_strings if o.startswith("--")}
    shown = set(FLAG.findall(help_text))
    assert flags - UNBUILT_FLAGS - NO_OPS <= shown
    assert not shown & (UNBUILT_FLAGS | NO_OPS)
    flat = " ".join(help_text.split())
    assert f"{len(UNBUILT_FLAGS)} upstream Megatron-LM flags of features this project" in flat
    assert f"{len(NO_OPS)} more, which change no result here, are accepted" in flat
    assert "docs/flags.md" in flat
    # Defaults are shown where they say something: a 0, but not a switch's off nor a None.
    assert "--lr-warmup-iters LR_WARMUP_ITERS Iterations of linear warmup. (default: 0)" in flat
    assert "(default: False)" not in flat and "(default: None)" not in flat
    # About 2.5 lines per built flag, and a one-line usage: a bound per flag, so that building a
    # feature (its flags leaving the refused ones) does not move it.
    built = flags - UNBUILT_FLAGS - NO_OPS
    assert len(help_text.splitlines()) < 2.7 * len(built)
    assert help_text.splitlines()[0] == "usage: pretrain_gpt.py [-h] [--flag [VALUE ...] ...]"


def test_unbuilt_flags_are_still_recognised():
    args = parse_args(args=[*BASE, "--mtp-hybrid-override-pattern", "MM", "--mtp-hsm"])
    assert (args.mtp_hybrid_override_pattern, args.mtp_hsm) == (["MM"], True)


def test_a_flag_error_is_short(capsys):
    with pytest.raises(SystemExit):
        parse_args(args=[*BASE, "--no-such-flag"])
    usage, error = capsys.readouterr().err.splitlines()
    assert usage.startswith("usage: ") and usage.endswith(" [-h] [--flag [VALUE ...] ...]")
    assert error.endswith(": error: unrecognized arguments: --no-such-flag")


def test_enum_flags_show_the_values_users_type(help_text, capsys):
    flat = " ".join(help_text.split())
    assert "--attention-backend {flash,fused,unfused,local,auto} " in flat
    assert "local, auto. (default: auto)" in flat
    assert "The signal --exit-signal-handler waits for. (default: SIGTERM)" in flat
    assert "AttnBackend" not in help_text and "Signals" not in help_text
    with pytest.raises(SystemExit):
        parse_args(args=[*BASE, "--attention-backend", "flash-attn"])
    error = capsys.readouterr().err
    assert "invalid choice 'flash-attn' (choose from flash, fused, unfused, local, auto)" in error


def test_the_arguments_print_lists_the_built_flags_by_the_values_users_type():
    args = validated("--attention-backend", "unfused", "--exit-signal", "SIGUSR1")
    printed = dict(
        re.fullmatch(r"  (\w+) \.+ (.*)", line).groups()
        for line in _format_args(args).splitlines()[1:-1]
    )
    assert (printed["attention_backend"], printed["exit_signal"]) == ("unfused", "SIGUSR1")
    # Validation refused any that was set: they would all print their defaults.
    assert set(printed) == set(vars(args)) - unbuilt_dests(UNBUILT + TOKENIZER_UNBUILT)
