"""Measures the host time that `--compile-layers` saves or costs an eager training step.

Where the per-GPU batch is small the step is bound by the host. Compiled layers launch fewer
kernels than eager ones (inductor fuses the norms, residual adds, rotary embedding and
activations), but each compiled graph is entered through its wrapper, the generated code that
allocates its buffers and launches its kernels: in Python (`--no-compile-cpp-wrapper`) or in C++
(the default on CUDA). This tool builds the same model under one engine once per variant (eager
layers, compiled with the Python wrapper, compiled with the C++ wrapper), runs them in
alternating bursts of steps in one process (the GPU synchronised before each step: adjacent
bursts see the same drift of the host's speed, separate processes do not), and reports each
variant's median host milliseconds per step and its median per-burst difference from the first
variant's, with quartiles, then each variant's Python-level calls per step (a compiled layer's
Python wrapper makes a call per kernel). Each variant's build, warm-up and compile time is
printed as it is built (later processes find inductor's kernels in its cache and compile
faster).

    torchrun --nproc-per-node 1 tools/benchmark_compiled_host.py --bf16 \\
        [--engine megatron_fsdp_zero3] [--variants eager,python,cpp]

Every variant holds its own model and optimizer state: for large models give fewer variants.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_engine_host import (
    alternation_parser,
    check_bursts,
    time_in_alternation,
    with_engine_defaults,
)
from benchmark_lib.engines import ENGINES

VARIANTS = {"eager": (False, False), "python": (True, False), "cpp": (True, True)}
"""Variant -> (`compile_layers`, `compile_cpp_wrapper`)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This tool's flags, checked (bad ones exit through `parser.error`)."""
    parser = alternation_parser(__doc__, bursts=20, burst_steps=10, warmup_steps=3)
    parser.add_argument("--engine", default="megatron_fsdp_zero3", choices=list(ENGINES))
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)}; differences are to the first",
    )
    args = parser.parse_args(argv)
    args.variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or len(args.variants) < 2 or len(set(args.variants)) != len(args.variants):
        parser.error(
            f"--variants {','.join(args.variants)!r}: give two or more distinct names from "
            f"{', '.join(VARIANTS)}" + (f" ({', '.join(unknown)} unknown)." if unknown else ".")
        )
    if args.compile_layers or not args.compile_cpp_wrapper:
        parser.error(
            "--compile-layers and --no-compile-cpp-wrapper are what --variants sets for each "
            "variant (eager, python, cpp): drop them."
        )
    if "cpp" in args.variants and not args.device.startswith("cuda"):
        parser.error(
            f"--variants cpp needs CUDA (got --device {args.device}): inductor's C++ wrapper is "
            "asked for on CUDA only; compare eager,python on the CPU."
        )
    # A variant's layers compile in its warm-up, not in its first burst.
    check_bursts(parser, args, min_warmup_steps=1)
    return with_engine_defaults(parser, args, engines=args.engine)


def main() -> None:
    """Times the variants and prints their host ms per step and differences (rank 0)."""
    args = parse_args()
    builds = {}
    for variant in args.variants:
        variant_args = copy.copy(args)
        variant_args.compile_layers, variant_args.compile_cpp_wrapper = VARIANTS[variant]
        builds[variant] = (args.engine, variant_args)
    measured = time_in_alternation(args, builds)
    bursts = measured.bursts
    medians = ", ".join(f"{v} {statistics.median(times):.2f}" for v, times in bursts.items())
    print(f"{args.engine}, host ms per step (median of {args.bursts} bursts): {medians}")
    first, *others = args.variants
    for variant in others:
        difference = [a - b for a, b in zip(bursts[variant], bursts[first])]
        quartiles = statistics.quantiles(difference)
        print(
            f"{variant} - {first}: {statistics.median(difference):.2f} ms per step (quartiles "
            f"{quartiles[0]:.2f} / {quartiles[2]:.2f})"
        )
    calls = ", ".join(f"{v} {count}" for v, count in measured.python_calls.items())
    print(f"{args.engine}, python calls per step: {calls}")


if __name__ == "__main__":
    main()
