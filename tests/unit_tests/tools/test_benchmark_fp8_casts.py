"""Smoke tests of `tools/benchmark_fp8_casts.py`: on a GPU a row per shape and scaling with both
kernels' times, a row per weight shape with the transposes' and the refresh cast's line; without
one, and with bad shapes, a message and a non-zero exit."""

from __future__ import annotations

import re

import pytest

from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_fp8_casts.py"
ROW = re.compile(
    r"^ *(?P<shape>\d+x\d+) +(?P<scaling>delayed|current) +(?P<ours>\S+) +(?P<triton>\S+)"
    r" +(?P<bandwidth>\d+)$",
    re.MULTILINE,
)


def test_without_a_gpu_says_what_it_needs():
    proc = run_tool(nproc=None, tool=TOOL)
    assert proc.returncode != 0
    assert "needs CUDA and Triton" in proc.stderr


@pytest.mark.parametrize("flag", ["--shapes", "--weights"])
@pytest.mark.parametrize("shapes", ["3x", "4x0", "ax4"])
def test_refuses_bad_shapes(import_tool, capsys, flag, shapes):
    tool = import_tool("benchmark_fp8_casts")
    assert flag in usage_error(lambda: tool.parse_args([flag, shapes]), capsys)


def test_refuses_no_weight_layers(import_tool, capsys):
    tool = import_tool("benchmark_fp8_casts")
    message = usage_error(lambda: tool.parse_args(["--weight-layers", "0"]), capsys)
    assert "--weight-layers must be >= 1, got 0." in message


@pytest.mark.gpu
def test_times_each_shape_and_scaling_on_a_gpu():
    proc = run_tool(
        *("--shapes", "64x128,100x48", "--weights", "128x256,48x32", "--weight-layers", "2"),
        *("--iters", "3"),
        nproc=None,
        tool=TOOL,
        cuda=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [(m["shape"], m["scaling"]) for m in ROW.finditer(proc.stdout)]
    assert rows == [(s, k) for s in ("64x128", "100x48") for k in ("delayed", "current")]
    for match in ROW.finditer(proc.stdout):
        assert float(match["ours"]) > 0 and float(match["triton"]) > 0, proc.stdout
    number = r"(\d+\.\d)"
    weights = re.findall(rf"^ *(\d+x\d+) +{number} +{number} +{number} +\d+$", proc.stdout, re.M)
    assert [row[0] for row in weights] == ["128x256", "48x32"], proc.stdout
    assert all(float(t) > 0 for row in weights for t in row[1:]), proc.stdout
    assert re.search(r"refresh cast of 4 fp32 weights .* one launch: \S+ µs", proc.stdout)
