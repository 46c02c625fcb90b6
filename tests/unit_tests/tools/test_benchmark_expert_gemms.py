"""Smoke tests of `tools/benchmark_expert_gemms.py`: the routed token counts; bad flags and a
machine without a GPU refused with a message; on a GPU a row per projection, GEMM and kernel."""

from __future__ import annotations

import re

import pytest
import torch

from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_expert_gemms.py"
ROW = re.compile(
    r"^(?P<projection>fc1|fc2) +(?P<gemm>forward|input gradient|weight gradient) +"
    r"(?P<kernel>\S.*?) +(?P<gpu>[\d.]+) +(?P<host>\d+) +(?P<tflops>\d+)$",
    re.MULTILINE,
)


def test_each_token_is_routed_to_topk_distinct_experts(import_tool):
    tool = import_tool("benchmark_expert_gemms")
    counts = tool.routed_counts(8, 100, 3, seed=1)
    assert len(counts) == 8 and sum(counts) == 300
    assert max(counts) <= 100, "an expert gets each token at most once"
    assert counts == tool.routed_counts(8, 100, 3, seed=1) != tool.routed_counts(8, 100, 3, 2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--topk", "9", "--num-experts", "8"], "--topk 9 exceeds --num-experts 8"),
        (["--tokens", "0"], "--tokens must be at least 1"),
        (["--hidden-size", "100"], "--hidden-size must be a positive multiple of 16"),
    ],
)
def test_refuses_bad_flags(import_tool, capsys, flags, message):
    tool = import_tool("benchmark_expert_gemms")
    assert message in usage_error(lambda: tool.parse_args(flags), capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_says_what_it_needs():
    proc = run_tool(nproc=None, tool=TOOL)
    assert proc.returncode == 2
    assert "it times GPU kernels: run it on a GPU" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs an FP8 GPU of compute capability 9.0 or later",
)
def test_times_each_gemm_by_each_kernel_on_a_gpu():
    flags = "--num-experts 4 --hidden-size 64 --moe-ffn-hidden-size 32 --tokens 64 --topk 2"
    proc = run_tool(*flags.split(), "--repeats", "2", nproc=None, tool=TOOL, cuda=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(ROW.finditer(proc.stdout))
    kernels = {(m["projection"], m["gemm"]): set() for m in rows}
    for match in rows:
        kernels[match["projection"], match["gemm"]].add(match["kernel"])
        assert float(match["gpu"]) > 0, proc.stdout
    assert len(kernels) == 6, proc.stdout
    for found in kernels.values():
        assert {"one torch._scaled_mm per expert", "a Triton grouped GEMM"} <= found
