"""Runs the small-batch performance targets in one go and prints them as one table.

Each row runs ZeRO-3 over N GPUs against one GPU's step at the same per-GPU batch (the 1.34B
GPT of `tools/benchmark_lib/gpt_model.py`): `tools/benchmark_fsdp.py` for the benchmark rows (one
process runs both engines, so their ratio shares the host's drift), `pretrain_gpt.py` with the
whole iteration CUDA-graphed for the training-loop rows (N GPUs, then one GPU with the same
micro-batches: two processes). Each row has a `--use-symm-mem` twin (`NAME+symm`), which must be
no slower than the row without it: its ratio to one GPU is compared with the row's.

Results land in `--out`, one file per row, device count and command (a hash of the command is in
the name, so other flags or another model never stand in for these); rows already there are not
run again, so a long table can be filled over several invocations (`--max-seconds` stops
starting rows after that long), and `--report-only` prints what is there. Results of separate
invocations may come from different machine starts, whose hosts differ in speed: compare rows
from one start.

    python tools/benchmark_small_batches.py --out DIR [--nproc-per-node 2] [--rows S,L,...]

`--list` prints each row's commands. The table gives ZeRO-3's and one GPU's ms per step (or per
iteration), their ratio, the target and whether it is met, ZeRO-3's peak GiB and host ms per
step. The exit status is 1 when a row failed to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

Runner = Callable[..., subprocess.CompletedProcess]
"""Runs a command as `subprocess.run` does."""
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))

S = ("--micro-batch-size", "1", "--seq-length", "1024")
FOUR = ("--num-microbatches", "4")
OPTIONS = ("--megatron-fsdp-keep-unsharded-params", "--megatron-fsdp-accumulate-unsharded-grads")
GRAPHED = ("--cuda-graph",)
TWO_LAYERS = ("--suggested-communication-unit-size", "101000000")
FOUR_LAYERS = ("--suggested-communication-unit-size", "202000000")
"""Units of two and of four of the 1.34B GPT's layers (50,368,272 elements each)."""

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
    "L-4mb-options": Row(FOUR + OPTIONS, 1.05),
    "S": Row(S, 1.25),
    "S-graphed": Row(S + GRAPHED),
    "S-2-layer-units": Row(S + TWO_LAYERS, 1.25),
    "S-4-layer-units": Row(S + FOUR_LAYERS, 1.25),
    "L-2-layer-units": Row(TWO_LAYERS, 1.03),
    "S-4mb": Row(S + FOUR, 1.6),
    "S-4mb-options": Row(S + FOUR + OPTIONS, 1.6),
    "pretrain-S-graphed": Row(microbatches=1, target=1.05),
    "pretrain-S-4mb-graphed": Row(microbatches=4, target=1.05),
}
"""The small-batch targets on 2 GPUs (`docs/performance.md`, "Small batches"; 4 GPUs aim at the
same table). The accumulation options and units of two layers are a choice of the run, so their
rows have the targets of the rows without them."""

SYMM = "+symm"
"""Suffix of a row's `--use-symm-mem` twin."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked.

    Raises:
        SystemExit: unknown rows, or fewer than 2 GPUs per node.
    """
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = [*ROWS, *(name + SYMM for name in ROWS)]
    parser.add_argument("--out", required=True, help="folder for each row's result")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--rows", default=",".join(names), help="comma-separated, in order")
    parser.add_argument("--max-seconds", type=float, default=None, help="start no row after")
    parser.add_argument("--report-only", action="store_true", help="print the table, run none")
    parser.add_argument("--list", action="store_true", help="print the rows' commands, run none")
    parser.add_argument(
        "--model-args",
        default="",
        help="appended to the benchmark rows' flags, which they override (a smaller model to "
        "try the tool; its results are kept apart from the real model's)",
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
    """The row of `name` and whether `name` is its `--use-symm-mem` twin."""
    return ROWS[name.removesuffix(SYMM)], name.endswith(SYMM)


def _runs(name: str, args: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """The runs of row `name` by role ("both": a benchmark row's one run; "zero3" and "single":
    a training-loop row's two): (result file, command)."""
    row, symm = _row(name)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    symm_flags = ["--use-symm-mem"] if symm else []
    if row.microbatches is None:
        command = [*launch, str(args.nproc_per_node), "tools/benchmark_fsdp.py", "--bf16"]
        command += ["--engines", "megatron_fsdp_zero3,single", *row.flags, *symm_flags]
        command += shlex.split(args.model_args)
        out = _result_path(args.out, name, args.nproc_per_node, command, "json")
        return {"both": (out, [*command, "--json-out", out + ".partial"])}
    runs = {}
    # One GPU has no symmetric memory to use: the twin's reference is the row's own.
    for role, n in (("zero3", args.nproc_per_node), ("single", 1)):
        base = name.removesuffix(SYMM) if role == "single" else name
        flags = symm_flags if role == "zero3" else []
        batch = str(row.microbatches * n)
        command = [*launch, str(n), "pretrain_gpt.py", *PRETRAIN, "--global-batch-size", batch]
        command += flags
        runs[role] = (_result_path(args.out, base, n, command, "log"), command)
    return runs


def _result_path(out: str, name: str, nproc: int, command: list[str], suffix: str) -> str:
    """Where the run of `command` keeps its result: named by the row (`+` spelt `_`, which
    file transfers refuse less often), the device count and a hash of the command (without the
    interpreter's path)."""
    digest = hashlib.sha1(" ".join(command[1:]).encode()).hexdigest()[:8]
    return os.path.join(out, f"{name.replace('+', '_')}-{nproc}gpu-{digest}.{suffix}")


def run_rows(args: argparse.Namespace, run: Runner = subprocess.run) -> bool:
    """Runs every run of `args.rows` whose result is missing, in order, until `--max-seconds`,
    each through `run` (`subprocess.run`'s signature).
    Each writes to `<result>.partial`, renamed to the result when it exits with 0 (a failed or
    killed run is never taken for a result, and its output stays for reading). Returns whether
    every run started succeeded."""
    start, ok = time.monotonic(), True
    for name in args.rows:
        for out, command in _runs(name, args).values():
            if os.path.exists(out):
                continue
            if args.max_seconds is not None and time.monotonic() - start > args.max_seconds:
                print(f"--max-seconds reached before {os.path.basename(out)}", flush=True)
                return ok
            print(f"[{name}] {shlex.join(command)}", flush=True)
            partial = out + ".partial"
            log = partial if out.endswith(".log") else out + ".out"
            with open(log, "w") as stream:
                result = run(command, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT)
            if result.returncode != 0:
                print(f"[{name}] exit {result.returncode}: see {log}", flush=True)
                ok = False
            elif os.path.exists(partial):
                os.replace(partial, out)
    return ok


def _benchmark(path: str) -> dict[str, dict]:
    with open(path) as f:
        return {row["engine"]: row for row in json.load(f)["rows"]}


_ITERATION = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
_PEAK = re.compile(r"peak memory \(GiB\): ([0-9.]+)")


def _pretrain(path: str) -> dict[str, float | None]:
    """The median ms per iteration of the logged intervals after the first (which holds the
    warm-up and the capture), and the peak GiB (None: not logged, off CUDA).

    Raises:
        ValueError: the log has no interval after the first.
    """
    with open(path) as f:
        text = f.read()
    times = [float(ms) for ms in _ITERATION.findall(text)][1:]
    peaks = [float(gib) for gib in _PEAK.findall(text)]
    if not times:
        raise ValueError(f"{path}: no 'elapsed time per iteration' after the first interval")
    return {"step_ms": statistics.median(times), "peak_gib": max(peaks) if peaks else None}


@dataclasses.dataclass(frozen=True)
class _Result:
    zero3_ms: float
    single_ms: float
    peak_gib: float | None
    host_ms: float | None

    @property
    def ratio(self) -> float:
        return self.zero3_ms / self.single_ms


def _result(name: str, args: argparse.Namespace) -> _Result:
    """Row `name`'s result.

    Raises:
        FileNotFoundError: a run of it is missing.
        ValueError, KeyError: a result that cannot be read.
    """
    runs = _runs(name, args)
    if "both" in runs:
        rows = _benchmark(runs["both"][0])
        zero3, single = rows["megatron_fsdp_zero3"], rows["single"]
        return _Result(zero3["step_ms"], single["step_ms"], zero3["peak_gib"], zero3["cpu_ms"])
    zero3, single = _pretrain(runs["zero3"][0]), _pretrain(runs["single"][0])
    return _Result(zero3["step_ms"], single["step_ms"], zero3["peak_gib"], None)


def _verdict(name: str, result: _Result, args: argparse.Namespace) -> tuple[str, str]:
    """The target cell and whether it is met ("" without a target, "?" without the result
    to compare with)."""
    row, symm = _row(name)
    if not symm:
        if row.target is None:
            return "", ""
        return f"<= {row.target}", "yes" if result.ratio <= row.target else "no"
    try:
        without = _result(name.removesuffix(SYMM), args)
    except (OSError, ValueError, KeyError):
        return "<= without", "?"
    return "<= without", "yes" if result.ratio <= without.ratio else "no"


def report(args: argparse.Namespace) -> None:
    """Prints the table of `args.rows` (Markdown), a row whose result is missing as not run,
    one that cannot be read as unreadable."""
    print(
        f"| row | ZeRO-3 on {args.nproc_per_node} GPUs, ms | one GPU, ms | x one GPU | target "
        "| met | peak GiB | host ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.rows:
        try:
            result = _result(name, args)
        except FileNotFoundError:
            print(f"| {name} | not run | | | | | | |")
            continue
        except (ValueError, KeyError) as error:
            print(f"| {name} | unreadable: {error} | | | | | | |")
            continue
        target, met = _verdict(name, result, args)
        cells = [f"{result.zero3_ms:.2f}", f"{result.single_ms:.2f}", f"{result.ratio:.3f}"]
        cells += [target, met]
        cells += [_cell(result.peak_gib, ".2f"), _cell(result.host_ms, ".1f")]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None, run: Runner = subprocess.run) -> int:
    """Lists, runs (through `run`) and reports the rows; 1 if a run failed, else 0."""
    args = parse_args(argv)
    if args.list:
        for name in args.rows:
            for _, command in _runs(name, args).values():
                print(f"{name}: {shlex.join(command)}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    ok = args.report_only or run_rows(args, run)
    report(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
