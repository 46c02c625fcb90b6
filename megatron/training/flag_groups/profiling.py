"""Profiling flags (Megatron-LM's "profiling" group) and `validate_profiling`.

`--profile` profiles iterations `--profile-step-start` to `--profile-step-end` on the
`--profile-ranks` (all ranks when none are given): with `--use-pytorch-profiler` through
`torch.profiler` (a Chrome-trace file per rank, which Perfetto and TensorBoard read), otherwise
as an nsys capture range (`cudaProfilerStart` / `cudaProfilerStop`, GPU only).
`megatron/training/profiling.py` does the work.
"""

from __future__ import annotations

import argparse


def add_profiling_args(parser: argparse.ArgumentParser) -> None:
    """The "profiling" group."""
    group = parser.add_argument_group(title="profiling")
    group.add_argument(
        "--profile",
        action="store_true",
        help="Profile the iterations from --profile-step-start to --profile-step-end: an nsys "
        "capture range, or a torch.profiler trace with --use-pytorch-profiler.",
    )
    group.add_argument(
        "--profile-step-start", type=int, default=10, help="Iteration profiling starts at."
    )
    group.add_argument(
        "--profile-step-end", type=int, default=12, help="Iteration profiling stops at."
    )
    group.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="torch.profiler traces: <tensorboard-dir>/../torch_profile/rank-<r>.json.gz.",
    )
    group.add_argument(
        "--pytorch-profiler-collect-shapes", action="store_true", help="Record input shapes."
    )
    group.add_argument(
        "--pytorch-profiler-collect-callstack", action="store_true", help="Record Python stacks."
    )
    group.add_argument(
        "--profile-ranks",
        type=int,
        nargs="+",
        default=[],
        help="Global ranks to profile; none given: every rank.",
    )
    group.add_argument(
        "--record-memory-history",
        action="store_true",
        help="Record CUDA allocations; a snapshot is dumped at each log line (GPU only).",
    )
    group.add_argument(
        "--memory-snapshot-path",
        default="snapshot.pickle",
        help="Memory snapshots go to <base>_<rank><ext> of this path.",
    )
    group.add_argument(
        "--record-shapes",
        action="store_true",
        help="nsys mode: record shapes in torch.autograd.profiler.emit_nvtx ranges.",
    )


def validate_profiling(args: argparse.Namespace) -> None:
    """Checks the profiling step range and ranks, and that the CUDA-only tools have a GPU
    (`--pytorch-profiler-collect-chakra` and `--nvtx-ranges` are refused in
    `flag_groups.unbuilt`). Checked here, on every rank alike, rather than only on the profiled
    ranks when training starts, where the others would wait for them in a collective.

    Raises:
        ValueError: a bad step range or rank, or nsys-mode `--profile` or
            `--record-memory-history` on a run without GPUs.
    """
    # The model computes on the GPU exactly under NCCL (`get_device`).
    on_cpu = args.distributed_backend != "nccl"
    if args.record_memory_history and on_cpu:
        raise ValueError(
            f"--record-memory-history records CUDA allocations, and --distributed-backend "
            f"{args.distributed_backend} runs on the CPU; drop the flag."
        )
    if not args.profile:
        return
    if not args.use_pytorch_profiler and on_cpu:
        raise ValueError(
            f"--profile without --use-pytorch-profiler drives nsys (cudaProfilerStart), and "
            f"--distributed-backend {args.distributed_backend} runs on the CPU; add "
            "--use-pytorch-profiler for a torch.profiler trace, or drop the flag."
        )
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ValueError(
            f"--profile-step-start {args.profile_step_start} and --profile-step-end "
            f"{args.profile_step_end}: the start must be at least 0 and below the end."
        )
    outside = [rank for rank in args.profile_ranks if not 0 <= rank < args.world_size]
    if outside:
        raise ValueError(
            f"--profile-ranks {' '.join(map(str, outside))}: no such rank in a world of "
            f"{args.world_size}; give ranks from 0 to {args.world_size - 1}."
        )
