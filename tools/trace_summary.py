"""Says where the GPU (or host) time of a profiled training run goes, from a torch.profiler trace.

    python tools/trace_summary.py traces/megatron_fsdp_zero3_rank0.json [--steps 3] [--host]
    python tools/trace_summary.py traces/single_rank0.json traces/megatron_fsdp_zero3_rank0.json \
        --compare [--host]

Prints, per step: the kernel time of each category (GEMM, attention, all-gather, reduce-scatter,
all-to-all (NCCL's send/receive kernels: MoE token dispatch), other NCCL, optimizer, copies, other),
how long the compute stream (the one running most GEMMs) was busy and idle, how much NCCL time ran
while the compute stream was idle (exposed communication), the largest idle gaps of the compute
stream with what the other streams ran meanwhile, and the CPU time spent blocked in CUDA runtime
calls (synchronisation, allocation). A CUDA-graph replay shows each branch of the graph as a
stream of its own, so the compute-stream figures describe eager steps only.

With `--compare` and two traces it prints instead each kernel's time and launches per step in
both, the kernels whose time differs most first: what one engine's step runs that the other's
does not, and which shared kernels ran slower beside its other streams' work.

With `--host` it says where the host's time goes instead: each CPU op's, annotated range's
(`record_function`) and CUDA runtime call's self time per step (its time less that of the events
nested in it on its thread) and count, and each thread's busy time (the main thread's forward,
autograd's backward on CUDA); with `--compare` too, the two traces' side by side, the events
whose self time differs most first: where a step bound by the host spends what the other does
not.
"""

from __future__ import annotations

import argparse
import collections
import json

_CATEGORIES = (
    ("all_gather", ("allgather",)),
    ("reduce_scatter", ("reducescatter",)),
    ("all_to_all", ("sendrecv", "alltoall")),
    ("nccl_other", ("nccl",)),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass")),
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy", ("copy", "cat", "split", "memcpy", "memset", "fill")),
)
_BLOCKING_CALLS = ("Synchronize", "cudaMalloc", "cudaFree", "cudaHostAlloc")
_HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")


def category(name: str) -> str:
    key = name.lower().replace("_", "")
    for label, markers in _CATEGORIES:
        if any(marker.replace("_", "") in key for marker in markers):
            return label
    return "other"


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) not covered by union(b)."""
    covered = 0.0
    b = union(b)
    for start, end in union(a):
        for b_start, b_end in b:
            covered += max(0.0, min(end, b_end) - max(start, b_start))
    return length(union(a)) - covered


def read_events(path: str) -> list[dict]:
    """Every event of a chrome trace."""
    with open(path) as f:
        return json.load(f)["traceEvents"]


def read_kernels(path: str) -> tuple[list[dict], list[dict]]:
    """(every event, the GPU kernel / memcpy / memset events) of a chrome trace."""
    events = read_events(path)
    kernels = [
        e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    ]
    if not kernels:
        raise SystemExit(f"{path} holds no GPU kernels: was it profiled with CUDA activity?")
    return events, kernels


def read_host_events(path: str) -> list[dict]:
    """The host-side events of a chrome trace that have a duration (`_HOST_CATEGORIES`)."""
    host = [e for e in read_events(path) if e.get("cat") in _HOST_CATEGORIES and "dur" in e]
    if not host:
        raise SystemExit(f"{path} holds no host events: was it profiled with CPU activity?")
    return host


def self_times(events: list[dict]) -> tuple[dict[str, tuple[float, int]], dict[str, float]]:
    """Each event name's self time (us: its duration less that of the events nested in it on
    its thread) and count, and each thread's busy time (its events' union)."""
    by_thread: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        by_thread[f"{e.get('pid')}/{e.get('tid')}"].append(e)
    times: dict[str, tuple[float, int]] = {}
    busy: dict[str, float] = {}
    for thread, thread_events in by_thread.items():
        # An event starts inside the innermost open one that has not ended; ties: longer first.
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        own = [float(e["dur"]) for e in thread_events]
        ends = [e["ts"] + e["dur"] for e in thread_events]
        stack: list[int] = []
        for i, e in enumerate(thread_events):
            while stack and ends[stack[-1]] <= e["ts"]:
                stack.pop()
            if stack:
                # A child reported past its parent's end takes only what overlaps.
                own[stack[-1]] -= min(ends[i], ends[stack[-1]]) - e["ts"]
            stack.append(i)
        for e, t in zip(thread_events, own):
            total, count = times.get(e["name"], (0.0, 0))
            times[e["name"]] = (total + t, count + 1)
        busy[thread] = length(union([(e["ts"], end) for e, end in zip(thread_events, ends)]))
    return times, busy


def summarize_host(path: str, steps: int, rows: int) -> None:
    times, busy = self_times(read_host_events(path))
    per = 1000.0 * steps
    print(f"{path}: {steps} step(s), host ms per step (self time)")
    for thread, total in sorted(busy.items(), key=lambda item: -item[1]):
        print(f"  thread {thread:<24} busy {total / per:8.2f}")
    print(f"  {'ms':>8} {'count':>7}  event")
    largest = sorted(times.items(), key=lambda item: (-item[1][0], item[0]))  # ties by name
    for name, (total, count) in largest[:rows]:
        print(f"  {total / per:8.2f} {count / steps:7.0f}  {name[:90]}")


def category_times(kernels: list[dict]) -> collections.Counter[str]:
    """Kernel time (us) by category."""
    times: collections.Counter[str] = collections.Counter()
    for k in kernels:
        times[category(k["name"])] += k["dur"]
    return times


def summarize(path: str, steps: int) -> None:
    events, kernels = read_kernels(path)
    by_category = category_times(kernels)
    gemm_time: collections.Counter[int] = collections.Counter()
    for k in kernels:
        if category(k["name"]) == "gemm":
            gemm_time[k["args"].get("stream", -1)] += k["dur"]
    compute = gemm_time.most_common(1)[0][0]
    start = min(k["ts"] for k in kernels)
    end = max(k["ts"] + k["dur"] for k in kernels)
    on_compute = [
        (k["ts"], k["ts"] + k["dur"]) for k in kernels if k["args"].get("stream") == compute
    ]
    nccl = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if "nccl" in k["name"].lower()]
    busy = union(on_compute)
    per = 1000.0 * steps
    print(f"{path}: {steps} step(s), compute stream {compute}, ms per step")
    print(
        f"  window {(end - start) / per:8.2f}   compute busy {length(busy) / per:8.2f}   "
        f"compute idle {(end - start - length(busy)) / per:8.2f}"
    )
    print(
        f"  NCCL {length(union(nccl)) / per:8.2f}   of which exposed "
        f"(compute idle) {subtract(nccl, on_compute) / per:8.2f}"
    )
    for label, total in by_category.most_common():
        print(f"  {label:<15}{total / per:8.2f}")
    gaps = [(b_start - a_end, a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:])]
    print("  largest compute-idle gaps (us) and what ran elsewhere:")
    for gap, gap_start, gap_end in sorted(gaps, reverse=True)[:6]:
        during = collections.Counter(
            category(k["name"])
            for k in kernels
            if k["args"].get("stream") != compute
            and k["ts"] < gap_end
            and k["ts"] + k["dur"] > gap_start
        )
        print(f"    {gap:9.0f} at +{(gap_start - start) / 1000:8.2f} ms  {dict(during)}")
    blocking = collections.Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" and any(c in e["name"] for c in _BLOCKING_CALLS):
            blocking[e["name"]] += e.get("dur", 0)
    for name, total in blocking.most_common(5):
        print(f"  CPU in {name:<28}{total / per:8.2f}")


def kernel_times(kernels: list[dict]) -> dict[str, tuple[float, int]]:
    """Each kernel name's total time (us) and launch count."""
    times: dict[str, tuple[float, int]] = {}
    for k in kernels:
        total, count = times.get(k["name"], (0.0, 0))
        times[k["name"]] = (total + k["dur"], count + 1)
    return times


def compare(first: str, second: str, steps: int, rows: int, host: bool = False) -> None:
    """Prints the `rows` kernels (`host`: host events, by self time) whose time per step differs
    most between two traces."""
    if host:
        a, b = (self_times(read_host_events(path))[0] for path in (first, second))
        what, counted, total_label = "event", "counts", "all host events"
    else:
        a, b = (kernel_times(read_kernels(path)[1]) for path in (first, second))
        what, counted, total_label = "kernel", "launches", "all kernels"
    per = 1000.0 * steps
    print(f"ms and {counted} per step: (1) {first}, (2) {second}")
    print(f"  {'(2) - (1)':>9} {'(1)':>8} {'(2)':>8} {'n (1)':>6} {'n (2)':>6}  {what}")
    none = (0.0, 0)
    names = sorted(
        a.keys() | b.keys(), key=lambda n: (-abs(b.get(n, none)[0] - a.get(n, none)[0]), n)
    )
    for name in names[:rows]:
        (t1, n1), (t2, n2) = a.get(name, none), b.get(name, none)
        print(
            f"  {(t2 - t1) / per:+9.2f} {t1 / per:8.2f} {t2 / per:8.2f} {n1 / steps:6.0f} "
            f"{n2 / steps:6.0f}  {name[:90]}"
        )
    total_a, total_b = (sum(t for t, _ in times.values()) / per for times in (a, b))
    print(f"  {total_b - total_a:+9.2f} {total_a:8.2f} {total_b:8.2f}  ({total_label})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--steps", type=int, default=3, help="steps the trace holds")
    parser.add_argument(
        "--compare", action="store_true", help="two traces: their kernels side by side"
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="the host's time by event (self time) instead of the GPU's by kernel",
    )
    parser.add_argument(
        "--rows", type=int, default=30, help="kernels (events) --compare or --host prints"
    )
    args = parser.parse_args()
    if args.compare:
        if len(args.traces) != 2:
            parser.error(f"--compare takes two traces, got {len(args.traces)}.")
        compare(*args.traces, args.steps, args.rows, host=args.host)
        return
    for path in args.traces:
        if args.host:
            summarize_host(path, args.steps, args.rows)
        else:
            summarize(path, args.steps)


if __name__ == "__main__":
    main()
