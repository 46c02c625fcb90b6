"""Smoke tests of `tools/benchmark_engine_host.py`: one rank, a small GPT, the engine's host
overhead over one GPU's step reported; bad usage refused with a message."""

from __future__ import annotations

import math
import re

from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_engine_host.py"
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --vocab-size 128 --seq-length 16 "
    "--bursts 2 --burst-steps 2 --warmup-steps 1"
).split()
REPORT = re.compile(
    r"host ms per step: single (?P<single>\S+), megatron_fsdp_zero2 (?P<engine>\S+); "
    r"overhead (?P<overhead>\S+) ms .* (?P<per_unit>\S+) us per unit \(3 units\)"
)

CALLS = re.compile(
    r"python calls per step: single (?P<single>\d+), megatron_fsdp_zero2 (?P<engine>\d+); "
    r"(?P<added>[+-]\d+), [+-]\d+ per unit"
)


def test_reports_the_engines_host_overhead_per_step_and_unit():
    proc = run_tool(*TINY, "--engine", "megatron_fsdp_zero2", nproc=1, tool=TOOL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = REPORT.search(proc.stdout)
    assert match, proc.stdout
    values = {name: float(value) for name, value in match.groupdict().items()}
    assert values["single"] > 0 and values["engine"] > 0, values
    assert all(math.isfinite(value) for value in values.values()), values
    calls = CALLS.search(proc.stdout)
    assert calls, proc.stdout
    single, engine, added = (int(calls[name]) for name in ("single", "engine", "added"))
    # The engine's hooks run on top of the model's calls.
    assert engine > single > 0 and added == engine - single, calls.groupdict()


def test_more_than_one_rank_is_refused(import_tool, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for each of 2 ranks
    tool = import_tool("benchmark_engine_host")
    message = usage_error(lambda: tool.parse_args(TINY), capsys)
    assert "it runs on one rank: launch it with --nproc-per-node 1." in message


def test_fewer_than_two_bursts_is_a_usage_error(import_tool, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = import_tool("benchmark_engine_host")
    message = usage_error(lambda: tool.parse_args([*TINY, "--bursts", "1"]), capsys)
    assert "--bursts must be >= 2" in message
