"""Trains one Mixture-of-Experts GPT under Megatron-FSDP at several expert-parallel sizes and under
PyTorch FSDP2, and compares their step times, rates and the time spent in the token all-to-all.

The model defaults to the MoE benchmark configuration: hidden 2048, 16 layers, 16 heads, 8 experts
with SwiGLU width 5632 (Mixtral's shape, scaled), top-2 routing, vocab 32000, seq 2048,
micro-batch 2. Megatron-FSDP engines (and `ddp`) run once per expert-parallel size of
`--expert-parallel-sizes` (default: the world size, halved down to 1); at EP 1 the experts are
sharded like dense weights and no token leaves its rank. `fsdp2` (and `single`) run at EP 1:
FSDP2 shards the stacked expert weights like any other and routes tokens locally.

TFLOP/s/GPU counts the FLOPs of the active parameters (the top-k experts a token visits), as
Megatron-LM's formula does. The all-to-all column is the GPU time of NCCL's send/receive kernels
per step, from `PROFILED_STEPS` profiled steps after the timed ones (rank 0's trace).

    torchrun --nproc-per-node 4 tools/benchmark_moe.py --bf16 --moe-grouped-gemm
    # tiny, on CPU (gloo):
    torchrun --nproc-per-node 2 tools/benchmark_moe.py --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --vocab-size 128 --seq-length 32 --num-experts 4 \\
        --moe-ffn-hidden-size 64 --steps 2 --warmup-steps 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import benchmark_fsdp as bench
from benchmark_lib.gpt_model import build_gpt, parallel_sizes, set_parallel_state
from benchmark_lib.report import report
from trace_summary import category_times, read_kernels

from megatron.core import parallel_state

EXPERT_PARALLEL_ENGINES = ("megatron_fsdp_zero3", "megatron_fsdp_zero2", "ddp")
"""Engines that split experts over the expert-parallel group; the others run at EP 1."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of `benchmark_fsdp.py` with the MoE model's defaults, and the EP sizes
    (`argv`: default the command line)."""
    parser = bench.build_parser()
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(
        engines="megatron_fsdp_zero3,fsdp2",
        num_layers=16,
        num_experts=8,
        moe_ffn_hidden_size=5632,
        swiglu=True,
    )
    parser.add_argument(
        "--expert-parallel-sizes",
        default=None,
        help="comma-separated EP sizes for the expert-parallel engines (default: the world size "
        "halved down to 1)",
    )
    args = bench.check_args(parser, parser.parse_args(argv))
    args.expert_parallel_sizes = parallel_sizes(
        parser, "--expert-parallel-sizes", args.expert_parallel_sizes,
        ("--num-experts", args.num_experts),
    )  # fmt: skip
    exchanging = [name for name in args.engines if name in EXPERT_PARALLEL_ENGINES]
    if (
        args.cuda_graph
        and exchanging
        and max(args.expert_parallel_sizes) > 1
        and not args.moe_pad_dispatch_to_worst_case
    ):
        parser.error(
            f"--cuda-graph at expert-parallel sizes {args.expert_parallel_sizes}: the token "
            "exchanges are then sized by counts read on the host, which a capture cannot do; "
            "add --moe-pad-dispatch-to-worst-case, or --expert-parallel-sizes 1."
        )
    return args


def run(name: str, ep: int, args: argparse.Namespace, device: torch.device, traces: str) -> dict:
    """One table row: engine `name` at expert-parallel size `ep`, profiled into `traces`."""
    set_parallel_state(args.create_all_gather_group, expert_model_parallel_size=ep)
    with torch.device("meta"):
        config, _ = build_gpt(args)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    label = f"{name}_ep{ep}" if name in EXPERT_PARALLEL_ENGINES else name
    run_args = copy.copy(args)
    # The all-to-all time comes from the GPU kernels of a trace: CPU runs profile on request only.
    if device.type == "cuda" or args.profile:
        run_args.profile = os.path.join(traces, label)
    row = bench.summarize(name, bench.run_engine(name, run_args, device), args, config, device)
    row["engine"] = label
    row["all_to_all_ms"] = None
    if device.type == "cuda" and (name != "single" or dist.get_rank() == 0):  # single: rank 0
        trace = os.path.join(run_args.profile, f"{name}_rank{dist.get_rank()}.json")
        _, kernels = read_kernels(trace)
        row["all_to_all_ms"] = category_times(kernels)["all_to_all"] / 1e3 / bench.PROFILED_STEPS
    return row


def main() -> None:
    """Runs every engine at each of its EP sizes; rank 0 prints (and writes) the results."""
    args = parse_args()
    device = bench.init_distributed(torch.device(args.device).type)
    set_parallel_state(args.create_all_gather_group)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in build_gpt(args)[1].parameters())
    rows = []
    # GPU runs profile always; without --profile their traces last only as long as the run.
    traces = (
        contextlib.nullcontext(args.profile)
        if args.profile
        else tempfile.TemporaryDirectory(prefix="benchmark_moe_")
    )
    with traces as trace_dir:
        for name in args.engines:
            sizes = args.expert_parallel_sizes if name in EXPERT_PARALLEL_ENGINES else [1]
            rows.extend(run(name, ep, args, device, trace_dir) for ep in sizes)
    single = next((r["step_ms"] for r in rows if r["engine"] == "single"), None)
    fsdp2 = next((r for r in rows if r["engine"] == "fsdp2"), None)
    for row in rows:
        row["vs_single"] = row["step_ms"] / single if single else None
        if fsdp2 is not None:
            row["tokens_vs_fsdp2"] = row["tokens_per_s_per_gpu"] / fsdp2["tokens_per_s_per_gpu"]
    notes = []
    for row in rows:
        a2a = "-" if row["all_to_all_ms"] is None else f"{row['all_to_all_ms']:.2f} ms"
        ratio = row.get("tokens_vs_fsdp2")
        versus = "" if ratio is None else f", tokens/s {ratio:.2f}x fsdp2's"
        notes.append(f"{row['engine']}: all-to-all {a2a} per step{versus}")
    report(rows, args, device, num_params, notes)
    gc.collect()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
