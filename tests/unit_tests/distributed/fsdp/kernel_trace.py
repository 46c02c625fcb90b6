"""GPU kernel timelines from `torch.profiler`, for the overlap tests: which kernels ran on which
stream, when, and which of them overlapped (counts, not durations, are asserted)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# The kernel categories are tools/trace_summary.py's (a script, not a package: found by path).
_TOOLS = str(Path(__file__).resolve().parents[4] / "tools")
if _TOOLS not in sys.path:
    sys.path.insert(0, _TOOLS)
from trace_summary import category  # noqa: E402


@dataclass(frozen=True)
class Kernel:
    name: str
    stream: int
    start: float
    end: float

    @property
    def is_all_gather(self) -> bool:
        return category(self.name) == "all_gather"

    @property
    def is_reduce_scatter(self) -> bool:
        return category(self.name) == "reduce_scatter"

    @property
    def is_gemm(self) -> bool:
        return category(self.name) == "gemm"

    def overlaps(self, other: Kernel) -> bool:
        return self.start < other.end and other.start < self.end


def kernels_of(fn: Callable[[], object]) -> list[Kernel]:
    """The CUDA kernels `fn` ran (it is followed by a device synchronisation). Only GPU
    activity is recorded: recording CPU ops would slow the host enough to starve the GPU."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [
        Kernel(e["name"], int(e["args"]["stream"]), e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "kernel"
    ]


def compute_stream(kernels: list[Kernel]) -> int:
    """The stream most GEMMs ran on."""
    return Counter(k.stream for k in kernels if k.is_gemm).most_common(1)[0][0]


def num_overlapping(kernels: list[Kernel], selected: list[Kernel]) -> int:
    """How many of `selected` overlap a GEMM on the compute stream."""
    stream = compute_stream(kernels)
    gemms = [k for k in kernels if k.is_gemm and k.stream == stream]
    return sum(any(k.overlaps(g) for g in gemms) for k in selected)
