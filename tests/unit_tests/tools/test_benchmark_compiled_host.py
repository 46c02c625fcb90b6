"""Smoke tests of `tools/benchmark_compiled_host.py`: one rank, a small GPT eager and with
compiled layers, each variant's host time and its difference from the first reported; bad usage
refused with a message."""

from __future__ import annotations

import math
import re

import pytest

from megatron.core.transformer.transformer_config import inductor_finds_cpp_compiler
from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_compiled_host.py"
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --vocab-size 128 --seq-length 16 "
    "--bursts 2 --burst-steps 2 --warmup-steps 1 --device cpu"
).split()
REPORT = re.compile(
    r"single, host ms per step \(median of 2 bursts\): eager (?P<eager>\S+), python "
    r"(?P<python>\S+)\npython - eager: (?P<difference>\S+) ms per step"
)


@pytest.mark.skipif(
    not inductor_finds_cpp_compiler(), reason="inductor on CPU needs a C++ compiler"
)
def test_reports_each_variants_host_time_and_its_difference_from_the_first():
    proc = run_tool(*TINY, "--engine", "single", "--variants", "eager,python", nproc=1, tool=TOOL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^python: built and warmed up in \S+ s$", proc.stdout, re.M)
    match = REPORT.search(proc.stdout)
    assert match, proc.stdout
    values = {name: float(value) for name, value in match.groupdict().items()}
    assert values["eager"] > 0 and values["python"] > 0, values
    assert all(math.isfinite(value) for value in values.values()), values
    calls = re.search(
        r"^single, python calls per step: eager (\d+), python (\d+)$", proc.stdout, re.M
    )
    assert calls and int(calls[1]) > 0 and int(calls[2]) > 0, proc.stdout


@pytest.mark.parametrize(
    "variants, expected",
    [
        ("eager,cpp", "--variants cpp needs CUDA (got --device cpu)"),
        ("eager", "give two or more distinct names from eager, python, cpp."),
        ("eager,jit", "(jit unknown)."),
    ],
)
def test_bad_variants_are_usage_errors(variants, expected, import_tool, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = import_tool("benchmark_compiled_host")
    message = usage_error(lambda: tool.parse_args([*TINY, "--variants", variants]), capsys)
    assert expected in message


@pytest.mark.parametrize("flag", ["--compile-layers", "--no-compile-cpp-wrapper"])
def test_the_compile_flags_that_variants_set_are_refused(flag, import_tool, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = import_tool("benchmark_compiled_host")
    argv = [*TINY, "--variants", "eager,python", flag]
    message = usage_error(lambda: tool.parse_args(argv), capsys)
    assert "are what --variants sets for each variant" in message
