"""Runs the small-batch performance targets in one go and prints them as one table.

Each row runs ZeRO-3 over N GPUs against one GPU's step at the same per-GPU batch (the 1.34B
GPT of `tools/gpt_benchmark_model.py`): `tools/benchmark_fsdp.py` for the benchmark rows (one
process runs both engines), `pretrain_gpt.py` with the whole iteration CUDA-graphed for the
training-loop rows (N GPUs, then one GPU with the same micro-batches). `--use-symm-mem` rows run
ZeRO-3 again with symmetric memory, against the same row without it.

Results land in `--out` (one JSON or log per row and device count); rows already there are not
run again, so a long table can be filled over several invocations (`--max-seconds` stops
starting rows after that long), and `--report-only` prints what is there:

    python tools/benchmark_small_batches.py --out DIR [--nproc-per-node 2] [--rows S,L,...]

`--list` prints the rows' commands (each also a command of `docs/performance.md`).

The table gives ZeRO-3's and one GPU's ms per step (or per iteration), their ratio, the target
and whether it is met, ZeRO-3's peak GiB and host ms per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))

S = ("--micro-batch-size", "1", "--seq-length", "1024")
FOUR = ("--num-microbatches", "4")
OPTIONS = ("--megatron-fsdp-keep-unsharded-params", "--megatron-fsdp-accumulate-unsharded-grads")
GRAPHED = ("--cuda-graph",)

PRETRAIN = (
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
    "--no-fsdp-all-gather-in-start-param-sync --overlap-grad-reduce --overlap-param-gather "
    "--create-all-gather-group --grad-reduce-in-fp32 --num-layers 24 --hidden-size 2048 "
    "--num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 "
    "--position-embedding-type rope --vocab-size 32000 --micro-batch-size 1 --bf16 "
    "--hidden-dropout 0 --attention-dropout 0 --mock-data --eval-iters 0 --lr 1e-4 "
    "--cuda-graph-impl full_iteration --train-iters 40 --log-interval 10"
).split()


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table.

    Attributes:
        flags: added to `tools/benchmark_fsdp.py`'s (benchmark rows) or `PRETRAIN`.
        target: the most ZeRO-3's step may take, as a multiple of one GPU's; None: reported.
        microbatches: a training-loop row's micro-batches per iteration (None: a benchmark row).
    """

    flags: tuple[str, ...] = ()
    target: float | None = None
    microbatches: int | None = None


ROWS = {
    "L": Row((), 1.03),
    "L-graphed": Row(GRAPHED, 1.02),
    "L-4mb": Row(FOUR, 1.05),
    "L-4mb-options": Row(FOUR + OPTIONS),
    "S": Row(S, 1.25),
    "S-graphed": Row(S + GRAPHED),
    "S-4mb": Row(S + FOUR, 1.6),
    "S-4mb-options": Row(S + FOUR + OPTIONS),
    "pretrain-S-graphed": Row(microbatches=1, target=1.05),
    "pretrain-S-4mb-graphed": Row(microbatches=4, target=1.05),
}
"""The targets of the small-batch work (`docs/performance.md`)."""

SYMM = "+symm"
"""Suffix of a row's `--use-symm-mem` twin; its target: no slower than the row without."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = [*ROWS, *(name + SYMM for name in ROWS)]
    parser.add_argument("--out", required=True, help="folder for each row's result")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--rows", default=",".join(names), help="comma-separated, in order")
    parser.add_argument("--max-seconds", type=float, default=None, help="start no row after")
    parser.add_argument("--report-only", action="store_true", help="print the table, run none")
    parser.add_argument("--list", action="store_true", help="print the rows and their flags")
    parser.add_argument(
        "--model-args",
        default="",
        help="replaces the benchmark rows' model (for example a smaller one to try the tool)",
    )
    args = parser.parse_args(argv)
    args.rows = [row for row in args.rows.split(",") if row]
    unknown = [row for row in args.rows if row not in names]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(names)}")
    if args.nproc_per_node < 2:
        parser.error("--nproc-per-node must be >= 2 (ZeRO-3 over N GPUs against one GPU).")
    return args


def _row(name: str) -> tuple[Row, bool]:
    symm = name.endswith(SYMM)
    return ROWS[name.removesuffix(SYMM)], symm


def _commands(name: str, args: argparse.Namespace) -> dict[str, list[str]]:
    """The runs of row `name`: result file name -> command."""
    row, symm = _row(name)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    symm_flags = ["--use-symm-mem"] if symm else []
    if row.microbatches is None:
        out = os.path.join(args.out, f"{name}.json")
        engines = "megatron_fsdp_zero3" if symm else "megatron_fsdp_zero3,single"
        command = [*run, str(args.nproc_per_node), "tools/benchmark_fsdp.py", "--bf16"]
        command += ["--engines", engines, *row.flags, *symm_flags, "--json-out", out]
        return {out: command + args.model_args.split()}
    commands = {}
    counts = [args.nproc_per_node] if symm else [args.nproc_per_node, 1]
    for n in counts:
        batch = str(row.microbatches * n)
        out = os.path.join(args.out, f"{name}-{n}gpu.log")
        commands[out] = [*run, str(n), "pretrain_gpt.py", *PRETRAIN, "--global-batch-size", batch]
        commands[out] += symm_flags
    return commands


def run_rows(args: argparse.Namespace) -> None:
    start = time.monotonic()
    for name in args.rows:
        for out, command in _commands(name, args).items():
            if os.path.exists(out):
                continue
            if args.max_seconds is not None and time.monotonic() - start > args.max_seconds:
                print(f"--max-seconds reached before {os.path.basename(out)}", flush=True)
                return
            print(f"[{name}] {' '.join(command)}", flush=True)
            with open(out + ".partial", "w") as log:
                result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            if result.returncode != 0:
                print(f"[{name}] exit {result.returncode}: see {out}.partial", flush=True)
                continue
            if out.endswith(".log"):
                os.replace(out + ".partial", out)
            else:
                os.remove(out + ".partial")  # the benchmark wrote the JSON itself


def _benchmark(path: str) -> dict[str, dict]:
    with open(path) as f:
        return {row["engine"]: row for row in json.load(f)["rows"]}


_ITERATION = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
_PEAK = re.compile(r"peak memory \(GiB\): ([0-9.]+)")


def _pretrain(path: str) -> dict[str, float | None]:
    """The median ms per iteration of the logged intervals after the first (which holds the
    warm-up and the capture), and the peak GiB (None: not logged, off CUDA)."""
    with open(path) as f:
        text = f.read()
    times = [float(ms) for ms in _ITERATION.findall(text)][1:]
    peaks = [float(gib) for gib in _PEAK.findall(text)]
    if not times:
        raise ValueError(f"{path}: no 'elapsed time per iteration' after the first interval")
    return {"step_ms": statistics.median(times), "peak_gib": max(peaks) if peaks else None}


def _result(name: str, args: argparse.Namespace) -> tuple[float, float, float | None, float | None]:
    """(ZeRO-3 ms, one GPU's ms, ZeRO-3 peak GiB, ZeRO-3 host ms) of row `name`; raises
    FileNotFoundError where a run is missing."""
    row, symm = _row(name)
    base = name.removesuffix(SYMM)
    if row.microbatches is None:
        zero3 = _benchmark(os.path.join(args.out, f"{name}.json"))["megatron_fsdp_zero3"]
        single = _benchmark(os.path.join(args.out, f"{base}.json"))["single"]
        return zero3["step_ms"], single["step_ms"], zero3["peak_gib"], zero3["cpu_ms"]
    zero3 = _pretrain(os.path.join(args.out, f"{name}-{args.nproc_per_node}gpu.log"))
    single = _pretrain(os.path.join(args.out, f"{base}-1gpu.log"))
    return zero3["step_ms"], single["step_ms"], zero3["peak_gib"], None


def report(args: argparse.Namespace) -> None:
    n = args.nproc_per_node
    print(
        f"| row | ZeRO-3 on {n} GPUs, ms | one GPU, ms | x one GPU | target | met | peak GiB "
        "| host ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    steps = {}
    for name in args.rows:
        try:
            zero3, single, peak, host = _result(name, args)
        except FileNotFoundError:
            print(f"| {name} | not run | | | | | | |")
            continue
        steps[name] = zero3
        row, symm = _row(name)
        ratio = zero3 / single
        if symm:
            without = steps.get(name.removesuffix(SYMM))
            target = "<= without"
            met = "?" if without is None else ("yes" if zero3 <= without else "no")
        else:
            target = "" if row.target is None else f"<= {row.target}"
            met = "" if row.target is None else ("yes" if ratio <= row.target else "no")
        cells = [f"{zero3:.2f}", f"{single:.2f}", f"{ratio:.3f}", target, met]
        cells += ["-" if peak is None else f"{peak:.2f}", "-" if host is None else f"{host:.1f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    args = parse_args()
    if args.list:
        for name in args.rows:
            for command in _commands(name, args).values():
                print(f"{name}: {' '.join(command)}")
        return
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        run_rows(args)
    report(args)


if __name__ == "__main__":
    sys.exit(main())
