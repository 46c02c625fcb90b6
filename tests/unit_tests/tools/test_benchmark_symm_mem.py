"""Smoke tests of `tools/benchmark_symm_mem.py`: on 2 GPUs, every size and the layer are timed
and the layer's all-gather in its window runs NCCL's symmetric kernel; without CUDA, a usage
error that says so."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit_tests.tools.test_benchmark_fsdp import REPO, check_needs_gpus, run_tool

TOOL = REPO / "tools" / "benchmark_symm_mem.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_it_says_it_needs_gpus():
    check_needs_gpus(TOOL)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_times_each_size_and_a_layer_in_and_out_of_a_window(tmp_path):
    out = tmp_path / "symm.json"
    sizes = ("--min-kib", "256", "--max-mib", "1")
    args = ("--hidden-size", "256", *sizes, "--iters", "3", "--json-out", str(out))
    proc = run_tool(*args, nproc=2, tool=TOOL, cuda=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["bytes"] for row in result["rows"]] == [256 * 1024] * 2 + [2**20] * 2
    assert all(row["plain"] > 0 and row["symm"] > 0 for row in result["rows"])
    layer = result["layer"]
    assert layer["plain"]["all_gather_us"] > 0 and layer["symm"]["all_gather_us"] > 0
    for collective in ("all_gather_kernels", "reduce_scatter_kernels"):
        assert any("symk" in name.lower() for name in layer["symm"][collective]), layer
        assert not any("symk" in name.lower() for name in layer["plain"][collective]), layer
