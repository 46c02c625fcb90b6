"""Smoke tests of `tools/benchmark_native_host.py`: on a GPU, one rank and a small GPT, the host
time of each C++ extension, its Python path and the feature off reported; off a GPU, with the
feature turned off (or FP8's not turned on), or with an engine that does not gather, refused with
a message."""

from __future__ import annotations

import re

import pytest
import torch

from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_native_host.py"
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --vocab-size 128 --seq-length 16 "
    "--bursts 2 --burst-steps 2 --warmup-steps 1 --bf16"
).split()
ROW = re.compile(r"^  (\S.*?) +(\S+) +(\S+) \(quartiles", re.M)
ROWS = {
    "linear": ("Python function", "no fusion"),
    "fp8": ("Python function", None),
    "rope": ("Triton kernel", "no rope fusion"),
    "segment_copy": ("Triton kernel", None),
}
FLAGS = {"fp8": ["--fp8-format", "hybrid"]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extension", list(ROWS))
def test_reports_the_host_time_of_each_path(extension):
    proc = run_tool(
        *TINY, *FLAGS.get(extension, []), "--extension", extension, "--engine",
        "megatron_fsdp_zero3", nproc=1, tool=TOOL, cuda=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {name: (float(ms), float(diff)) for name, ms, diff in ROW.findall(proc.stdout)}
    python_path, off = ROWS[extension]
    assert set(rows) == {"C++", python_path} | ({off} if off else set()), proc.stdout
    assert all(ms > 0 for ms, _ in rows.values()), rows
    assert rows[python_path][1] == 0.0, rows


def test_a_cpu_run_is_refused(import_tool, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = import_tool("benchmark_native_host")
    message = usage_error(lambda: tool.parse_args([*TINY, "--device", "cpu"]), capsys)
    assert "the C++ nodes run on CUDA tensors: run it on a GPU" in message


@pytest.mark.parametrize(
    "extension, flag",
    [("linear", "--no-gradient-accumulation-fusion"), ("rope", "--no-rope-fusion")],
)
def test_the_feature_turned_off_is_refused(import_tool, monkeypatch, capsys, extension, flag):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = import_tool("benchmark_native_host")
    argv = [*TINY, "--device", "cuda", "--extension", extension, flag]
    message = usage_error(lambda: tool.parse_args(argv), capsys)
    assert f"--extension {extension} compares the feature on and off" in message


def test_segment_copies_need_an_engine_that_gathers(import_tool, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = import_tool("benchmark_native_host")
    argv = [*TINY, "--device", "cuda", "--extension", "segment_copy", "--engine", "single"]
    message = usage_error(lambda: tool.parse_args(argv), capsys)
    assert "--extension segment_copy times Megatron-FSDP's gathers" in message


def test_fp8_needs_its_format(import_tool, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = import_tool("benchmark_native_host")
    argv = [*TINY, "--device", "cuda", "--extension", "fp8"]
    message = usage_error(lambda: tool.parse_args(argv), capsys)
    assert "--extension fp8 times a feature that is off: set --fp8-format" in message
