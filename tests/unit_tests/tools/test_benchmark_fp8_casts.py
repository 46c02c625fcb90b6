"""Smoke tests of `tools/benchmark_fp8_casts.py`: on a GPU a row per shape and scaling with both
kernels' times; without one, and with bad shapes, a message and a non-zero exit."""

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


@pytest.mark.parametrize("shapes", ["3x", "4x0", "ax4"])
def test_refuses_bad_shapes(import_tool, capsys, shapes):
    tool = import_tool("benchmark_fp8_casts")
    assert "--shapes" in usage_error(lambda: tool.parse_args(["--shapes", shapes]), capsys)


@pytest.mark.gpu
def test_times_each_shape_and_scaling_on_a_gpu():
    proc = run_tool("--shapes", "64x128,100x48", "--iters", "3", nproc=None, tool=TOOL, cuda=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [(m["shape"], m["scaling"]) for m in ROW.finditer(proc.stdout)]
    assert rows == [(s, k) for s in ("64x128", "100x48") for k in ("delayed", "current")]
    for match in ROW.finditer(proc.stdout):
        assert float(match["ours"]) > 0 and float(match["triton"]) > 0, proc.stdout
