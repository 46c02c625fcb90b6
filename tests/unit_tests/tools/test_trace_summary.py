"""`tools/trace_summary.py --compare`: two chrome traces' kernels side by side, per step."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "trace_summary.py"


def write_trace(path: Path, kernels: list[tuple[str, float]]) -> str:
    """A chrome trace of `kernels` ((name, duration in us)) back to back on one stream."""
    events, ts = [], 0.0
    for name, dur in kernels:
        events.append({"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}})
        ts += dur
    path.write_text(json.dumps({"traceEvents": [{"cat": "cpu_op", "name": "step"}, *events]}))
    return str(path)


def test_compare_lists_kernels_by_difference_per_step(tmp_path):
    # Two steps each: the GEMM slows from 1000 to 1500 us per step, a copy appears (300 us in
    # 3 launches per step), the attention kernel stays.
    first = write_trace(tmp_path / "a.json", [("gemm_a", 1000), ("flash_fwd", 400)] * 2)
    second = write_trace(
        tmp_path / "b.json", [("gemm_a", 1500), ("flash_fwd", 400), *[("copy_k", 100)] * 3] * 2
    )
    proc = run_tool(first, second, "--compare", "--steps", "2", nproc=None, tool=TOOL)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(
        r"^\s+([+-]\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)\s+(\d+)\s+(\S+)$",
        proc.stdout,
        flags=re.M,
    )
    assert [row[-1] for row in rows] == ["gemm_a", "copy_k", "flash_fwd"]
    assert rows[0][:5] == ("+0.50", "1.00", "1.50", "1", "1")
    assert rows[1][:5] == ("+0.30", "0.00", "0.30", "0", "3")
    assert rows[2][:5] == ("+0.00", "0.40", "0.40", "1", "1")
    assert re.search(r"\+0\.80\s+1\.40\s+2\.20\s+\(all kernels\)", proc.stdout), proc.stdout


def test_compare_needs_two_traces(tmp_path):
    only = write_trace(tmp_path / "a.json", [("gemm_a", 1000)])
    proc = run_tool(only, "--compare", nproc=None, tool=TOOL)
    assert proc.returncode == 2
    assert "--compare takes two traces, got 1." in proc.stderr
