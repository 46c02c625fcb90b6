"""`tools/benchmark_attention.py`: on a GPU a tiny run reports every case with sane numbers (the
timings themselves are the lead's to read, never asserted); without one it says it needs one."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[3] / "tools" / "benchmark_attention.py"
CASES = ["causal", "causal flex", "causal + sinks", "window", "window + sinks"]


def _tool():
    spec = importlib.util.spec_from_file_location("benchmark_attention", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without one")
def test_without_a_gpu_it_says_it_needs_one():
    with pytest.raises(SystemExit, match="needs a GPU"):
        _tool().main([])


@pytest.mark.gpu
def test_a_tiny_run_reports_every_case(tmp_path):
    out = tmp_path / "rows.json"
    flags = "--seq-length 512 --window 64 --num-attention-heads 4 --num-query-groups 2 --repeats 2"
    rows = _tool().main([*flags.split(), "--json", str(out)])
    assert [row["case"] for row in rows] == CASES
    assert json.loads(out.read_text())["rows"] == rows
    for row in rows:
        for key in ("forward_ms", "forward_backward_ms", "peak_gib", "speedup"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["case"], key)
    assert rows[0]["speedup"] == 1.0
