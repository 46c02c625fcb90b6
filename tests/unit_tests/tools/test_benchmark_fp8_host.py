"""Smoke tests of `tools/benchmark_fp8_host.py`: a chain of linear layers in bf16 and in FP8, MoE
expert projections in FP8, and a one-layer GPT, timed and their aten ops counted, the reference
quantisers' ops (which stand in for the GPU's cast kernels off CUDA) counted apart; bad usage
refused with a message."""

from __future__ import annotations

import math
import re

from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_fp8_host.py"
TINY = "--linears 2 --bursts 1 --burst-iters 1 --warmup-iters 1".split()
LINEAR_ROW = re.compile(
    r"^(?P<name>bf16|fp8 delayed|fp8 tensorwise) +(?P<us>\S+) +(?P<extra>\S+) +(?P<ops>\S+)"
    r" +(?P<py_calls>\S+)(?:  (?P<calls>\S+) \((?P<stand_in_ops>\d+)\))?$",
    re.MULTILINE,
)
GPT_ROW = re.compile(
    r"^(?P<name>bf16|delayed|tensorwise) +(?P<ms>\S+) +(?P<ops>\d+) +(?P<calls>\d+)", re.MULTILINE
)


def test_reports_host_time_and_ops_per_linear_and_per_gpt_step():
    proc = run_tool(*TINY, "--gpt-layers", "1", nproc=None, tool=TOOL, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    linears, gpt_table = proc.stdout.split("GPT of ")
    rows = {match["name"]: match for match in LINEAR_ROW.finditer(linears)}
    assert set(rows) == {"bf16", "fp8 delayed", "fp8 tensorwise"}, proc.stdout
    for name, row in rows.items():
        assert float(row["us"]) > 0 and math.isfinite(float(row["us"])), proc.stdout
        assert float(row["ops"]) > 0 and float(row["py_calls"]) > 0, proc.stdout
        if name == "bf16":
            assert row["calls"] is None, proc.stdout  # no cast, so no stand-in
        else:
            # Two casts per layer (its input, its output gradient), each a reference quantiser.
            assert float(row["calls"]) == 2.0 and int(row["stand_in_ops"]) > 0, proc.stdout
    gpt = {match["name"]: match for match in GPT_ROW.finditer(gpt_table)}
    assert set(gpt) == {"bf16", "delayed", "tensorwise"}, proc.stdout
    assert int(gpt["bf16"]["calls"]) == 0, proc.stdout
    # Four FP8 linears: two casts each, and each weight's once per optimizer step.
    assert int(gpt["delayed"]["calls"]) == int(gpt["tensorwise"]["calls"]) == 12, proc.stdout


EXPERT_ROW = re.compile(
    r"^ *(?P<experts>\d+) (?P<recipe>delayed|tensorwise) +(?P<us>\S+) +(?P<ops>\d+)"
    r" +(?P<scaled_mm>\d+) +(?P<grouped>\d+)  (?P<calls>\d+) \((?P<stand_in_ops>\d+)\)$",
    re.MULTILINE,
)


def test_reports_expert_projections_whose_casts_do_not_grow_with_the_experts():
    """On CPU every expert GEMM runs one `torch._scaled_mm` per expert (three per expert), and
    each pass casts all the experts' rows in one call (one or two kernel launches on CUDA)."""
    proc = run_tool(*TINY, "--experts", "4,8", nproc=None, tool=TOOL, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(int(m["experts"]), m["recipe"]): m for m in EXPERT_ROW.finditer(proc.stdout)}
    assert set(rows) == {(e, r) for e in (4, 8) for r in ("delayed", "tensorwise")}, proc.stdout
    for (experts, _), row in rows.items():
        assert float(row["us"]) > 0 and int(row["grouped"]) == 0, proc.stdout
        assert int(row["scaled_mm"]) == 3 * experts, proc.stdout
        assert int(row["calls"]) == 2, proc.stdout


def test_experts_must_be_positive_numbers(import_tool, capsys):
    tool = import_tool("benchmark_fp8_host")
    message = usage_error(lambda: tool.parse_args([*TINY, "--experts", "8,x"]), capsys)
    assert "give comma-separated numbers" in message
    message = usage_error(lambda: tool.parse_args([*TINY, "--experts", "0"]), capsys)
    assert "must be at least 1" in message


def test_blockwise_needs_the_e4m3_format(import_tool, capsys):
    tool = import_tool("benchmark_fp8_host")
    message = usage_error(lambda: tool.parse_args([*TINY, "--recipes", "blockwise"]), capsys)
    assert "--recipes blockwise needs --format e4m3" in message
