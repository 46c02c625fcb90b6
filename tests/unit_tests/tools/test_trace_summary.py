"""`tools/trace_summary.py`: `--compare`, two chrome traces' kernels side by side, per step;
`--host`, the host's self time by event and thread, alone and compared."""

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


def write_host_trace(path: Path, launches: int = 1) -> str:
    """Two steps of host events, 5 ms apart: on thread 1 a 4 ms range holding an mm (1 ms,
    holding `launches` CUDA launches of 0.2 ms) and an add (0.5 ms); on thread 2 a 0.6 ms
    backward and a 0.2 ms call that starts 0.1 ms before its end (reported past it). Self times
    per step: the range 2.5 ms, the mm 1 - 0.2 x `launches`, the add 0.5, the backward 0.5, the
    call 0.2, the launches 0.2 x `launches`; thread 2 busy 0.7 ms."""

    def event(cat, name, ts, dur, tid):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = []
    for t in (0, 5000):
        events += [
            event("user_annotation", "forward", t, 4000, 1),
            event("cpu_op", "aten::mm", t + 1000, 1000, 1),
            *(
                event("cuda_runtime", "cudaLaunchKernel", t + 1100 + 250 * i, 200, 1)
                for i in range(launches)
            ),
            event("cpu_op", "aten::add", t + 2500, 500, 1),
            event("cpu_op", "backward", t, 600, 2),
            event("cuda_runtime", "cudaStreamWaitEvent", t + 500, 200, 2),
        ]
    # A kernel: the host view ignores it.
    events.append({"cat": "kernel", "name": "gemm", "ts": 0, "dur": 900, "args": {"stream": 7}})
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_host_view_gives_self_times_and_busy_threads(tmp_path):
    trace = write_host_trace(tmp_path / "a.json")
    proc = run_tool(trace, "--host", "--steps", "2", nproc=None, tool=TOOL)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^\s+(\d+\.\d+)\s+(\d+)\s+(\S+)$", proc.stdout, re.M)
    assert rows == [
        ("2.50", "1", "forward"),
        ("0.80", "1", "aten::mm"),
        ("0.50", "1", "aten::add"),
        ("0.50", "1", "backward"),
        ("0.20", "1", "cudaLaunchKernel"),
        ("0.20", "1", "cudaStreamWaitEvent"),
    ], proc.stdout
    assert re.search(r"thread 1/1\s+busy\s+4\.00", proc.stdout), proc.stdout
    assert re.search(r"thread 1/2\s+busy\s+0\.70", proc.stdout), proc.stdout
    assert "gemm" not in proc.stdout


def test_host_compare_lists_events_by_self_time_difference(tmp_path):
    first = write_host_trace(tmp_path / "a.json", launches=1)
    second = write_host_trace(tmp_path / "b.json", launches=3)
    proc = run_tool(first, second, "--compare", "--host", "--steps", "2", nproc=None, tool=TOOL)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(
        r"^\s+([+-]\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)\s+(\d+)\s+(\S+)$",
        proc.stdout,
        flags=re.M,
    )
    # Two more launches per step move 0.4 ms of the mm's self time into theirs.
    assert rows[:3] == [
        ("-0.40", "0.80", "0.40", "1", "1", "aten::mm"),
        ("+0.40", "0.20", "0.60", "1", "3", "cudaLaunchKernel"),
        ("+0.00", "0.50", "0.50", "1", "1", "aten::add"),  # ties by name
    ], proc.stdout
    assert re.search(r"\+0\.00\s+4\.70\s+4\.70\s+\(all host events\)", proc.stdout), proc.stdout
