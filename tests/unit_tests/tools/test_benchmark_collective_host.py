"""Smoke tests of `tools/benchmark_collective_host.py`: on a GPU, every way of moving a layer's
tensors is timed; without one, a usage error that says so."""

from __future__ import annotations

import re

import pytest
import torch

from tests.unit_tests.tools.test_benchmark_fsdp import REPO, check_needs_gpus, run_tool

TOOL = REPO / "tools" / "benchmark_collective_host.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_it_says_it_needs_gpus():
    check_needs_gpus(TOOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_times_every_way_of_moving_a_layer():
    proc = run_tool("--hidden-size", "256", "--calls", "5", nproc=1, tool=TOOL, cuda=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    timed = re.findall(r"^  (.+?)\s+(\d+\.\d)\s+(\d+\.\d)$", proc.stdout, flags=re.M)
    assert len(timed) == 13, proc.stdout
    assert all(float(host) > 0 and float(gpu) >= 0 for _, host, gpu in timed), proc.stdout
