"""Trains one GPT under several data-parallel engines in turn and compares their step times.

Engines (`--engines`, default all, run in the order given):

- `megatron_fsdp_zero3` / `megatron_fsdp_zero2`: Megatron-FSDP (`FullyShardedDataParallel`)
  sharding optimizer state, gradients and parameters / optimizer state and gradients;
- `megatron_fsdp_no_shard` (not in the default list): Megatron-FSDP replicating everything,
  gradients all-reduced once per step (`no_shard`, Megatron-FSDP's default strategy);
- `megatron_fsdp_hsdp` / `megatron_fsdp_hfsdp` (not in the default list): Megatron-FSDP ZeRO-3
  inside each of `--num-distributed-optimizer-instances` R instances (default 2) of world / R
  ranks, replicated across them (HSDP), or with main weights and optimizer state also sharded
  across them (HFSDP); R >= 2 must divide the world size, and they are not CUDA-graphed;
- `fsdp2`: PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) on each layer, then the root;
- `ddp`: the project's `DistributedDataParallel` (bucketed all-reduce overlapped with backward);
- `single`: rank 0 alone, no communication, the same per-GPU batch: the compute-only reference.

With `--cuda-graph` (Megatron-FSDP and `single` only) each engine's whole training step, every
microbatch and the optimizer, is captured in one CUDA graph after eager warm-up and replayed
(`fsdp_all_gather_in_start_param_sync` off, as capture needs): the step costs what the GPU does.

Every rank draws the same tokens (fixed seed), so every engine computes the same training step as
`single` and the final losses must agree (a sanity check; token values do not change timings):
bitwise on CPU, and on GPU with `--deterministic`, but for FSDP2's on GPU. There this
project's engines write each weight gradient as the fp32 output of its GEMM (gradient-accumulation
fusion), where FSDP2's are bf16 GEMM outputs upcast for the reduction, and step their fp32 main
weights with one Triton kernel that also writes the bf16 weights (`--adamw fused`), equal to
torch's fused AdamW only up to a unit or two in the last place; with
`--no-gradient-accumulation-fusion --adamw foreach` every engine computes the same bits.
Without `--deterministic` the sharded engines' losses differ from the second step on, and from
run to run: flash attention's backward accumulates with atomics, in an order that changes with
the collectives running beside it. Prints a table and one JSON object (rank 0). The
configurations reported in docs, on 2 GPUs:

    # L (~1.34B params, micro-batch 2, seq 2048)
    torchrun --nproc-per-node 2 tools/benchmark_fsdp.py --hidden-size 2048 --num-layers 24 \\
        --num-attention-heads 16 --vocab-size 32000 --micro-batch-size 2 --seq-length 2048 --bf16
    # S (same model, micro-batch 1, seq 1024: communication-heavy)
    torchrun --nproc-per-node 2 tools/benchmark_fsdp.py --micro-batch-size 1 --seq-length 1024 \\
        --bf16 --json-out s.json --profile traces/   # model flags default to L's model

With `--num-microbatches` > 1, `--megatron-fsdp-keep-unsharded-params` (ZeRO-3 only) and
`--megatron-fsdp-accumulate-unsharded-grads` turn on Megatron-FSDP's gradient-accumulation options
(`docs/architecture.md`); rank 0 prints what they hold. On CPU (gloo) with a tiny model;
without torchrun it runs as a world of one:

    torchrun --nproc-per-node 2 tools/benchmark_fsdp.py --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --vocab-size 128 --seq-length 32 --num-microbatches 2

Hybrid sharding against ZeRO-3 over all ranks (the table names each layout, e.g. "HSDP 2 x 4"):

    torchrun --nproc-per-node 8 tools/benchmark_fsdp.py --bf16 \\
        --engines megatron_fsdp_zero3,megatron_fsdp_hsdp,megatron_fsdp_hfsdp \\
        --num-distributed-optimizer-instances 2
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_lib.engines import (
    ENGINES,
    GRAPHABLE,
    HYBRID_ENGINES,
    OPTIONAL_ENGINES,
    Batch,
    StepFn,
    build_engine,
    instances,
    layout,
    precision_note,
)
from benchmark_lib.gpt_model import add_model_args, build_gpt, set_parallel_state
from benchmark_lib.report import report

from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flops import num_floating_point_operations
from megatron.training.initialize import default_rendezvous

PROFILED_STEPS = 3


def build_parser() -> argparse.ArgumentParser:
    """The flags (`tools/benchmark_moe.py` adds its own)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated list")
    parser.add_argument("--num-microbatches", type=int, default=None, help="default 1")
    parser.add_argument(
        "--global-batch-size", type=int, default=None, help="sets --num-microbatches"
    )
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--grad-reduce-dtype", choices=("fp32", "bf16"), default="fp32")
    # fused=True works for every engine's optimizer parameters: all are fp32 (main weights),
    # plain tensors (ddp, single, Megatron-FSDP's local shards) or DTensors (FSDP2; DTensor
    # has a fused AdamW rule).
    # foreach is the fallback should a torch build lack it; one choice applies to all engines.
    parser.add_argument("--adamw", choices=("fused", "foreach"), default="fused")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json-out", default=None, help="also write the JSON to this file")
    parser.add_argument("--profile", default=None, metavar="DIR", help="chrome traces here")
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help=f"capture each step in a CUDA graph and replay it ({', '.join(GRAPHABLE)} only)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (torch.use_deterministic_algorithms): every engine's loss is "
        "then bitwise equal to single's (FSDP2's on GPU only with "
        "--no-gradient-accumulation-fusion: its weight gradients are bf16); "
        "slower (flash attention's backward), for checking, not timing",
    )
    parser.add_argument(
        "--megatron-fsdp-keep-unsharded-params",
        action="store_true",
        help="ZeRO-3 engines: keep whole weights across the microbatches of a step",
    )
    parser.add_argument(
        "--megatron-fsdp-accumulate-unsharded-grads",
        action="store_true",
        help="Megatron-FSDP engines: sum whole gradients, reduce-scatter once per step",
    )
    parser.add_argument(
        "--suggested-communication-unit-size",
        type=int,
        default=None,
        help="Megatron-FSDP engines: gather and reduce consecutive layers together, up to this "
        "many parameter elements per unit (default: one layer per unit)",
    )
    parser.add_argument(
        "--use-symm-mem",
        action="store_true",
        help="Megatron-FSDP engines: whole weights in NCCL symmetric memory, gathered there by "
        "NCCL's symmetric kernels (CUDA, NCCL >= 2.27)",
    )
    parser.add_argument(
        "--create-all-gather-group",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Megatron-FSDP gathers over its own process group (so all-gathers and "
        "reduce-scatters run concurrently), as Megatron-LM's --create-all-gather-group",
    )
    return parser


def check_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, engines: tuple[str, ...] = ENGINES
) -> argparse.Namespace:
    """`args` checked and resolved (bad ones exit through `parser.error`); `engines` are the
    names `--engines` may give."""
    args.engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    unknown = sorted(set(args.engines) - set(engines))
    if unknown or not args.engines or len(set(args.engines)) != len(args.engines):
        parser.error(
            f"--engines {','.join(args.engines)!r}: give one or more distinct names from "
            f"{', '.join(engines)}" + (f" ({', '.join(unknown)} unknown)." if unknown else ".")
        )
    check_batch(parser, args, int(os.environ.get("WORLD_SIZE", "1")))
    if args.grad_reduce_dtype == "bf16" and not args.bf16:
        parser.error("--grad-reduce-dtype bf16 needs --bf16 (an fp32 run reduces in fp32).")
    if args.cuda_graph:
        eager_only = [name for name in args.engines if name not in GRAPHABLE]
        if eager_only or not args.device.startswith("cuda"):
            parser.error(
                f"--cuda-graph needs CUDA and engines from {', '.join(GRAPHABLE)} "
                f"(got --device {args.device}, --engines {','.join(args.engines)}); run the "
                "others without it."
            )
    if args.use_symm_mem and not args.device.startswith("cuda"):
        parser.error(f"--use-symm-mem needs CUDA (got --device {args.device}); drop it.")
    if args.megatron_fsdp_keep_unsharded_params and "megatron_fsdp_zero2" in args.engines:
        parser.error(
            "--megatron-fsdp-keep-unsharded-params applies to the ZeRO-3 engines only (ZeRO-2 "
            "keeps whole weights anyway): drop megatron_fsdp_zero2 from --engines."
        )
    if args.steps < 1 or args.warmup_steps < 0:
        parser.error("--steps must be >= 1 and --warmup-steps >= 0.")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This benchmark's flags (`build_parser`'s and the hybrid engines'), checked."""
    parser = build_parser()
    parser.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=None,
        help=f"{', '.join(HYBRID_ENGINES)} only: data-parallel instances R (default 2), each of "
        "world / R >= 2 ranks; the other engines run over all ranks",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the engines in turn this many times in one process, each round's ratios to "
        "its own one-GPU step (host-bound steps move with the host's speed between processes)",
    )
    parser.add_argument(
        "--fp8-only",
        action="store_true",
        help="with --fp8-format: time the FP8 steps alone, without the bf16 twin each engine "
        "otherwise runs first (for a sampling profiler that follows one process); the rows then "
        "have no ratio to the bf16 one-GPU step",
    )
    args = check_args(parser, parser.parse_args(argv), ENGINES + HYBRID_ENGINES + OPTIONAL_ENGINES)
    check_instances(parser, args, int(os.environ.get("WORLD_SIZE", "1")))
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more.")
    if args.fp8_only and args.fp8_format is None:
        parser.error("--fp8-only leaves out the bf16 twin of an FP8 run: give --fp8-format too.")
    return args


def check_instances(parser: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """Resolves `--num-distributed-optimizer-instances`: given only with a hybrid engine, and
    splitting the `world` ranks into instances of two or more ranks."""
    hybrid = [name for name in args.engines if name in HYBRID_ENGINES]
    if not hybrid:
        if args.num_distributed_optimizer_instances is not None:
            parser.error(
                "--num-distributed-optimizer-instances applies to "
                f"{' and '.join(HYBRID_ENGINES)} only: add one to --engines or drop the flag."
            )
        return
    if args.num_distributed_optimizer_instances is None:
        args.num_distributed_optimizer_instances = 2
    count = args.num_distributed_optimizer_instances
    # One rank per instance leaves nothing to shard inside it: not the layout these engines name.
    if count < 2 or world % count or world // count < 2:
        parser.error(
            f"--num-distributed-optimizer-instances {count} with {', '.join(hybrid)} on {world} "
            "rank(s): give R >= 2 dividing the world size into instances of two or more ranks "
            "(e.g. 2 on 4 or 8 ranks), or drop those engines."
        )


def check_batch(parser: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """Resolves `--num-microbatches` from `--global-batch-size` (micro x microbatches x ranks)."""
    if args.micro_batch_size < 1 or args.seq_length < 1:
        parser.error("--micro-batch-size and --seq-length must be >= 1.")
    if args.global_batch_size is not None:
        per_step = args.micro_batch_size * world
        if args.global_batch_size < per_step or args.global_batch_size % per_step:
            parser.error(
                f"--global-batch-size {args.global_batch_size} must be a positive multiple of "
                f"--micro-batch-size x world size = {args.micro_batch_size} x {world}."
            )
        derived = args.global_batch_size // per_step
        if args.num_microbatches not in (None, derived):
            parser.error(
                f"--num-microbatches {args.num_microbatches} contradicts --global-batch-size "
                f"{args.global_batch_size} ({derived} microbatches on {world} rank(s)); give one."
            )
        args.num_microbatches = derived
    if args.num_microbatches is None:
        args.num_microbatches = 1
    if args.num_microbatches < 1:
        parser.error(f"--num-microbatches must be >= 1, got {args.num_microbatches}.")


def init_distributed(device_type: str) -> torch.device:
    """Joins torchrun's group, or makes a world of one on a free localhost port."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    kwargs = default_rendezvous()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    return device


def make_batches(args: argparse.Namespace, device: torch.device) -> list[Batch]:
    """The same `num_microbatches` (tokens, labels) pairs on every rank and for every engine."""
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.num_microbatches, args.micro_batch_size, args.seq_length + 1)
    data = torch.randint(0, args.vocab_size, shape, generator=generator).to(device)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def synchronize(device: torch.device) -> None:
    """Waits for the GPU's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(name: str, args: argparse.Namespace, device: torch.device, build=None) -> dict:
    """Builds (with `build(name, args)`, default `build_engine`) and times `name` on this rank;
    the per-step times are not yet max-reduced."""
    active = name != "single" or dist.get_rank() == 0
    times = torch.zeros(args.steps, dtype=torch.float64)
    launch = torch.zeros(args.steps, dtype=torch.float64)
    loop = 0.0
    loss = float("nan")
    if active:
        batches = make_batches(args, device)
        if args.compile_layers:
            # Each engine's layers are a class of their own (the engines' unit subclasses), so
            # the compiled layer code would otherwise keep one cache entry per engine built in
            # this process, tried in turn at every layer call (host time that depends on the
            # build order), and past dynamo's recompile limit run its layers uncompiled.
            torch._dynamo.reset()
        torch.manual_seed(args.seed)
        with device:
            step = (build or build_engine)(name, args)
        if args.cuda_graph:
            step = capture_step(step, batches)
        for i in range(args.warmup_steps + args.steps):
            synchronize(device)
            start = time.perf_counter()
            step_loss = step(batches)
            launched = time.perf_counter()
            synchronize(device)
            if i >= args.warmup_steps:
                times[i - args.warmup_steps] = time.perf_counter() - start
                launch[i - args.warmup_steps] = launched - start
        loss = step_loss.item()
        loop = time_loop(step, batches, args.steps, device)
        if args.profile:
            trace = f"{name}_fp8" if args.fp8_format else name  # beside its bf16 twin's
            profile_steps(step, batches, trace, args.profile, device)
        del step, batches
    if name == "single":
        dist.barrier()
    peak = requested = 0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        requested = torch.cuda.memory_stats(device)["requested_bytes.all.peak"]
    return {
        "times": times,
        "launch": launch,
        "loop": loop,
        "loss": loss,
        "peak": peak,
        "requested": requested,
    }


def time_loop(step: StepFn, batches: list[Batch], steps: int, device: torch.device) -> float:
    """Seconds per step of `steps` steps run back to back, as a training loop runs them: the
    GPU is synchronised before the first and after the last only, so a step's host work
    overlaps the GPU work the steps before it queued (Megatron-LM's iteration time is measured
    so, over its log interval). The per-step times of `run_engine` synchronise around each
    step instead, so each also holds the host's time to its first kernel."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(batches)
    synchronize(device)
    return (time.perf_counter() - start) / steps


def capture_step(step: StepFn, batches: list[Batch], warmup: int = 3) -> StepFn:
    """`step` captured in a CUDA graph after `warmup` eager steps on a side stream (so that
    lazy state, optimizer state and allocator pools exist); the result replays it on the same,
    static `batches`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step(batches)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(batches)

    def replay(replayed: list[Batch]) -> torch.Tensor:
        if replayed is not batches:
            raise ValueError("A captured step replays on the batches it was captured with.")
        graph.replay()
        return static_loss

    return replay


def profile_steps(
    step: StepFn, batches: list[Batch], name: str, out_dir: str, device: torch.device
) -> None:
    """Runs `PROFILED_STEPS` more steps under torch.profiler; one chrome trace per rank."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(PROFILED_STEPS):
            step(batches)
        synchronize(device)
    os.makedirs(out_dir, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(out_dir, f"{name}_rank{dist.get_rank()}.json"))


def max_over_ranks(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Element-wise maximum of `values` over all ranks (on CPU)."""
    values = values.to(device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.cpu()


def summarize(
    name: str,
    measured: dict,
    args: argparse.Namespace,
    config: TransformerConfig,
    device: torch.device,
) -> dict:
    """One table row: medians of the per-step maxima over ranks, per-GPU rates."""
    times = max_over_ranks(measured["times"], device).tolist()
    launch = max_over_ranks(measured["launch"], device).tolist()
    loop_s = max_over_ranks(torch.tensor([measured["loop"]], dtype=torch.float64), device).item()
    # float64: float32 would round byte counts of ~10 GiB to KiBs.
    memory = torch.tensor([measured["peak"], measured["requested"]], dtype=torch.float64)
    peak, requested = max_over_ranks(memory, device).tolist()
    step_s = statistics.median(times)
    tokens = args.num_microbatches * args.micro_batch_size * args.seq_length
    batch = args.num_microbatches * args.micro_batch_size
    flops = num_floating_point_operations(config, args.vocab_size, args.seq_length, batch)
    return {
        "engine": name,
        "step_ms": step_s * 1e3,
        "step_ms_per_step": [t * 1e3 for t in times],
        # The same steps run back to back (`time_loop`): what a training loop's iteration takes.
        "loop_ms": loop_s * 1e3,
        # Host time until the step's work is queued: near step_ms means the CPU is the limit.
        "cpu_ms": statistics.median(launch) * 1e3,
        "tokens_per_s_per_gpu": tokens / step_s,
        "tflops_per_s_per_gpu": flops / step_s / 1e12,
        "peak_gib": peak / 2**30 if device.type == "cuda" else None,
        # The peak of the bytes asked for: the allocated peak above also counts what the
        # caching allocator rounds up, and the tail (under 1 MiB) it leaves on a block it
        # does not split, which varies with the order of allocations.
        "peak_requested_gib": requested / 2**30 if device.type == "cuda" else None,
        "final_loss": measured["loss"],
        "precision": precision_note(name, args),
    }


def precision_variants(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The flags each engine runs with: as given, and with `--fp8-format` (but `--fp8-only`) a
    bf16 twin first (the same flags without FP8), so that one run compares both on the same
    machine state."""
    if args.fp8_format is None or args.fp8_only:
        return [args]
    bf16 = {"fp8_format": None, "fp8_recipe": build_parser().get_default("fp8_recipe")}
    return [argparse.Namespace(**{**vars(args), **bf16}), args]


def main() -> None:
    """Runs every requested engine in turn; rank 0 prints (and writes) the results."""
    args = parse_args()
    if args.deterministic:
        # cuBLAS reads this when it initialises (deterministic mode refuses to run without it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = init_distributed(torch.device(args.device).type)
    set_parallel_state(args.create_all_gather_group)
    with torch.device("meta"):
        config, model = build_gpt(args)
    num_params = sum(p.numel() for p in model.parameters())
    rows = []
    for round_index in range(args.rounds):
        round_rows = []
        for name, variant in [(n, v) for n in args.engines for v in precision_variants(args)]:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            # Each engine over its own instances: the plain ones shard over all ranks.
            count = instances(name, args)
            set_parallel_state(
                args.create_all_gather_group, num_distributed_optimizer_instances=count
            )
            row = summarize(name, run_engine(name, variant, device), variant, config, device)
            row["layout"] = layout(name, args, dist.get_world_size())
            if variant.fp8_format:
                row["engine"] += " fp8"
            round_rows.append(row)
        # The ratios are to the round's bf16 single-GPU step (FP8's speed-up shows as a ratio
        # below it).
        single = next((r["step_ms"] for r in round_rows if r["engine"] == "single"), None)
        for row in round_rows:
            row["vs_single"] = row["step_ms"] / single if single else None
            if args.rounds > 1:
                row["round"] = round_index + 1
                row["engine"] += f" r{round_index + 1}"
        rows.extend(round_rows)
    report(rows, args, device, num_params)
    gc.collect()  # free the last engine before its process groups go
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
