"""Measures the host time a data-parallel engine adds to one GPU's training step.

Where the per-GPU batch is small the step is bound by the host, and the engine's hooks (gathers,
reduce-scatters, stream and event bookkeeping) add to the model's own host time. This tool runs
`single` (the model alone) and an engine (default `megatron_fsdp_zero3`) on the same model and
batch in one process, in alternating bursts of steps, and reports the per-step difference of
their host times (launch to launch, the GPU synchronised before each step): on shared machines
the host's speed drifts over tens of seconds, and adjacent bursts see the same drift, which
separate runs do not.

Use a model whose GPU work is small against its host work (the default: 24 layers of width
256), so both steps are bound by the host:

    torchrun --nproc-per-node 1 tools/benchmark_engine_host.py --bf16 [--engine NAME]

Rank 0 prints the median host ms per step of each, the engine's overhead (median of the
per-burst differences, with its quartiles) and that overhead per unit (layers + root), then the
Python-level calls of one step of each and the engine's added calls per unit: the same in every
run of the same code, where the times move with the host.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_fsdp import (
    build_parser,
    check_args,
    init_distributed,
    make_batches,
    synchronize,
)
from benchmark_lib.engines import ENGINES, build_engine
from benchmark_lib.gpt_model import add_model_args, set_parallel_state
from benchmark_lib.python_calls import count_python_calls

from megatron.core import parallel_state


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = alternation_parser(__doc__, bursts=30, burst_steps=15, warmup_steps=5)
    parser.add_argument(
        "--engine",
        default="megatron_fsdp_zero3",
        choices=[name for name in ENGINES if name != "single"],
    )
    args = parser.parse_args(argv)
    check_bursts(parser, args, min_warmup_steps=0)
    return with_engine_defaults(parser, args, engines=f"single,{args.engine}")


def alternation_parser(
    doc: str, *, bursts: int, burst_steps: int, warmup_steps: int
) -> argparse.ArgumentParser:
    """The flags of a tool that times steps in alternating bursts (`time_in_alternation`): the
    model's, at a size whose GPU work is small against its host work, and the timing's, with
    the given defaults.

    Args:
        doc: the tool's module docstring (its first line describes the tool).
        bursts, burst_steps, warmup_steps: the defaults of `--bursts`, `--burst-steps` and
            `--warmup-steps`.
    """
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser, micro_batch_size=1)
    parser.set_defaults(hidden_size=256, num_attention_heads=4, vocab_size=1024, seq_length=256)
    parser.add_argument("--bursts", type=int, default=bursts, help="bursts of each, alternating")
    parser.add_argument("--burst-steps", type=int, default=burst_steps, help="steps per burst")
    parser.add_argument("--warmup-steps", type=int, default=warmup_steps)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser


def check_bursts(
    parser: argparse.ArgumentParser, args: argparse.Namespace, min_warmup_steps: int
) -> None:
    """Exits through `parser.error` unless there are two bursts or more of one step or more,
    after at least `min_warmup_steps` warm-up steps."""
    if args.bursts < 2 or args.burst_steps < 1 or args.warmup_steps < min_warmup_steps:
        parser.error(
            f"--bursts must be >= 2, --burst-steps >= 1 and --warmup-steps >= {min_warmup_steps}."
        )


def with_engine_defaults(
    parser: argparse.ArgumentParser, args: argparse.Namespace, engines: str
) -> argparse.Namespace:
    """`args` completed with the rest of what `build_engine` reads, at `tools/benchmark_fsdp.py`'s
    defaults, and checked as that tool checks them (bad ones exit through `parser.error`).

    Args:
        parser: the calling tool's parser, whose `error` reports bad flags.
        args: its parsed flags.
        engines: the engines the tool builds, comma-separated (`--engines` of that tool).

    Returns:
        `args`, completed; one rank only.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        parser.error("it runs on one rank: launch it with --nproc-per-node 1.")
    for name, value in vars(build_parser().parse_args([])).items():
        args.__dict__.setdefault(name, value)
    args.engines = engines
    return check_args(parser, args)


def host_ms(step, batches, device: torch.device, count: int) -> float:
    """Median host milliseconds of `count` steps, each started on an idle GPU."""
    times = []
    for _ in range(count):
        synchronize(device)
        start = time.perf_counter()
        step(batches)
        times.append(time.perf_counter() - start)
    synchronize(device)
    return statistics.median(times) * 1e3


@dataclasses.dataclass
class Alternation:
    """What `time_in_alternation` measured of each named step.

    Attributes:
        bursts: the median host ms per step in each of its bursts.
        python_calls: the Python-level calls of one of its steps (`count_python_calls`), made
            after the bursts.
    """

    bursts: dict[str, list[float]]
    python_calls: dict[str, int]


def time_in_alternation(
    args: argparse.Namespace, builds: dict[str, tuple[str, argparse.Namespace]]
) -> Alternation:
    """Builds each named step on this process's device, warms it up (where its layers compile),
    times them all in turns of one burst each, then counts each one's Python calls in one more
    step; joins and leaves the process group.

    Args:
        args: the model, batch and timing flags (`warmup_steps`, `bursts`, `burst_steps`, `seed`,
            `device`).
        builds: name -> (`build_engine`'s engine name, the flags it builds with).

    Returns:
        Each name's bursts and Python calls.
    """
    device = init_distributed(torch.device(args.device).type)
    set_parallel_state(args.create_all_gather_group)
    batches = make_batches(args, device)
    steps = {}
    for name, (engine, engine_args) in builds.items():
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        with device:
            steps[name] = build_engine(engine, engine_args)
        if args.warmup_steps:
            host_ms(steps[name], batches, device, args.warmup_steps)
        print(f"{name}: built and warmed up in {time.perf_counter() - start:.1f} s")
    bursts: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.bursts):
        for name, step in steps.items():
            bursts[name].append(host_ms(step, batches, device, args.burst_steps))
    calls = {
        name: count_python_calls(functools.partial(step, batches)) for name, step in steps.items()
    }
    synchronize(device)
    del steps
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return Alternation(bursts, calls)


def main() -> None:
    args = parse_args()
    measured = time_in_alternation(args, {name: (name, args) for name in args.engines})
    bursts, calls = measured.bursts, measured.python_calls
    overhead = [e - s for e, s in zip(bursts[args.engine], bursts["single"])]
    quartiles = statistics.quantiles(overhead)
    units = args.num_layers + 1
    print(
        f"host ms per step: single {statistics.median(bursts['single']):.2f}, {args.engine} "
        f"{statistics.median(bursts[args.engine]):.2f}; overhead {statistics.median(overhead):.2f}"
        f" ms (quartiles {quartiles[0]:.2f} / {quartiles[2]:.2f}), "
        f"{statistics.median(overhead) / units * 1e3:.0f} us per unit ({units} units)"
    )
    added = calls[args.engine] - calls["single"]
    print(
        f"python calls per step: single {calls['single']}, {args.engine} {calls[args.engine]}; "
        f"{added:+d}, {added / units:+.0f} per unit"
    )


if __name__ == "__main__":
    main()
