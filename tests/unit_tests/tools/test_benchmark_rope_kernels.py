"""Smoke tests of `tools/benchmark_rope_kernels.py`: on a GPU a row per shape with both kernels'
times and their results within a unit in the last place; without one, and with bad shapes, a
message and a non-zero exit."""

from __future__ import annotations

import re

import pytest

from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_rope_kernels.py"
ROW = re.compile(
    r"^ *(?P<shape>\d+x\d+x\d+x\d+) +(?P<ours>\S+) +(?P<triton>\S+) +(?P<ratio>\S+)"
    r" +(?P<ulps>\S+)$",
    re.MULTILINE,
)


def test_without_a_gpu_says_what_it_needs():
    proc = run_tool(nproc=None, tool=TOOL)
    assert proc.returncode != 0
    assert "needs CUDA and Triton" in proc.stderr


@pytest.mark.parametrize("shapes", ["8x1x2", "8x1x2x0", "8x1x2x33", "ax1x2x32"])
def test_refuses_bad_shapes(import_tool, capsys, shapes):
    tool = import_tool("benchmark_rope_kernels")
    assert "--shapes" in usage_error(lambda: tool.parse_args(["--shapes", shapes]), capsys)


@pytest.mark.gpu
def test_times_each_shape_on_a_gpu():
    proc = run_tool("--shapes", "16x2x4x64,9x1x3x32", nproc=None, tool=TOOL, cuda=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(ROW.finditer(proc.stdout))
    assert [m["shape"] for m in rows] == ["16x2x4x64", "9x1x3x32"], proc.stdout
    for match in rows:
        assert float(match["ours"]) > 0 and float(match["triton"]) > 0, proc.stdout
        assert float(match["ulps"]) <= 1.0, proc.stdout
