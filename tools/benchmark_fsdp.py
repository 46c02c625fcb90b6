"""Trains one GPT under several data-parallel engines in turn and compares their step times.

Engines (`--engines`, default all, run in the order given):

- `megatron_fsdp_zero3` / `megatron_fsdp_zero2`: Megatron-FSDP (`FullyShardedDataParallel`)
  sharding optimizer state, gradients and parameters / optimizer state and gradients;
- `fsdp2`: PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) on each layer, then the root;
- `ddp`: the project's `DistributedDataParallel` (bucketed all-reduce overlapped with backward);
- `single`: rank 0 alone, no communication, the same per-GPU batch: the compute-only reference.

With `--cuda-graph` (Megatron-FSDP and `single` only) each engine's whole training step, every
microbatch and the optimizer, is captured in one CUDA graph after eager warm-up and replayed
(`fsdp_all_gather_in_start_param_sync` off, as capture needs): the step costs what the GPU does.

Every rank draws the same tokens (fixed seed), so every engine computes the same training step as
`single` and the final losses must agree (a sanity check; token values do not change timings):
bitwise on CPU, and on GPU with `--deterministic`. Without it the sharded engines' losses differ
from the second step on, and from run to run: flash attention's backward accumulates with atomics,
in an order that changes with the collectives running beside it. Prints a table and one JSON
object (rank 0). The configurations reported in docs, on 2 GPUs:

    # L (~1.34B params, micro-batch 2, seq 2048)
    torchrun --nproc-per-node 2 tools/benchmark_fsdp.py --hidden-size 2048 --num-layers 24 \\
        --num-attention-heads 16 --vocab-size 32000 --micro-batch-size 2 --seq-length 2048 --bf16
    # S (same model, micro-batch 1, seq 1024: communication-heavy)
    torchrun --nproc-per-node 2 tools/benchmark_fsdp.py --micro-batch-size 1 --seq-length 1024 \\
        --bf16 --json-out s.json --profile traces/   # model flags default to L's model

With `--num-microbatches` > 1, `--megatron-fsdp-keep-unsharded-params` (ZeRO-3 only) and
`--megatron-fsdp-accumulate-unsharded-grads` turn on Megatron-FSDP's gradient-accumulation options
(`docs/architecture.md`); rank 0 prints what they hold. On CPU (gloo) with a tiny model; without torchrun it runs as a world of one:

    torchrun --nproc-per-node 2 tools/benchmark_fsdp.py --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --vocab-size 128 --seq-length 32 --num-microbatches 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_report import report
from gpt_benchmark_model import add_model_args, build_gpt

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.fsdp import (
    FullyShardedDataParallel,
    accumulation_memory,
    fully_shard_optimizer,
    local_main_weights,
    microbatch,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flops import num_floating_point_operations
from megatron.training.initialize import default_rendezvous

ENGINES = ("megatron_fsdp_zero3", "megatron_fsdp_zero2", "fsdp2", "ddp", "single")
GRAPHABLE = ("megatron_fsdp_zero3", "megatron_fsdp_zero2", "single")
"""Engines whose whole step captures in a CUDA graph (`--cuda-graph`)."""
PROFILED_STEPS = 3
Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[list[Batch]], torch.Tensor]
"""Runs one training step (every microbatch, then the optimizer); returns the detached loss."""


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
        "then bitwise equal to single's; slower (flash attention's backward), for checking, not "
        "timing",
    )
    parser.add_argument(
        "--megatron-fsdp-keep-unsharded-params",
        action="store_true",
        help="megatron_fsdp_zero3: keep whole weights across the microbatches of a step",
    )
    parser.add_argument(
        "--megatron-fsdp-accumulate-unsharded-grads",
        action="store_true",
        help="Megatron-FSDP engines: sum whole gradients, reduce-scatter once per step",
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
    if args.megatron_fsdp_keep_unsharded_params and "megatron_fsdp_zero2" in args.engines:
        parser.error(
            "--megatron-fsdp-keep-unsharded-params applies to megatron_fsdp_zero3 only (ZeRO-2 "
            "keeps whole weights anyway): drop megatron_fsdp_zero2 from --engines."
        )
    if args.steps < 1 or args.warmup_steps < 0:
        parser.error("--steps must be >= 1 and --warmup-steps >= 0.")
    return args


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


def make_adamw(params: Iterable[torch.nn.Parameter], args: argparse.Namespace) -> torch.optim.AdamW:
    """The one AdamW configuration every engine uses."""
    impl = {"fused": True} if args.adamw == "fused" else {"foreach": True}
    return torch.optim.AdamW(
        params,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        capturable=args.cuda_graph,
        **impl,
    )


class MainWeightsAdamW:
    """AdamW on fp32 main weights for parameters whose gradients are in `param.main_grad`
    (Megatron-LM's DDP convention; a minimal Float16OptimizerWithFloat16Params). fp32
    parameters are their own main weights; bf16 ones get fp32 copies, copied back each step.
    Not `MegatronOptimizer`, whose `step()` also takes the global grad norm (a host sync per
    step); the training loop captures its `step_on_device()` instead."""

    def __init__(self, params: Iterable[torch.nn.Parameter], args: argparse.Namespace):
        self.params = [p for p in params if p.requires_grad]
        self.main = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float())
            for p in self.params
        ]
        self.optimizer = make_adamw(self.main, args)

    @torch.no_grad()
    def step(self) -> None:
        """Steps the main weights with the accumulated `main_grad`s, then refreshes the params."""
        for param, main in zip(self.params, self.main):
            main.grad = param.main_grad.to(main.dtype)  # a view when already fp32
        self.optimizer.step()
        # Detached again: fp32 parameters are their own main weights, and backward must not
        # accumulate into a `.grad` that is a view of `main_grad`.
        self.optimizer.zero_grad(set_to_none=True)
        copies = [(p, m) for p, m in zip(self.params, self.main) if p is not m]
        if copies:
            torch._foreach_copy_([p for p, _ in copies], [m for _, m in copies])


def attach_local_main_grads(model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """Gives every parameter a `main_grad` view of one flat buffer that backward accumulates
    into (as the DDP engine does, without communication); returns the buffer."""
    params = [p for p in model.parameters() if p.requires_grad]
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)

    def accumulate(param: torch.nn.Parameter) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None

    offset = 0
    for param in params:
        param.main_grad = buffer[offset : offset + param.numel()].view_as(param)
        param.register_post_accumulate_grad_hook(accumulate)
        offset += param.numel()
    return buffer


def forward_backward(
    model: torch.nn.Module,
    batches: list[Batch],
    scope: Callable[[int], contextlib.AbstractContextManager],
) -> torch.Tensor:
    """Forward and backward of every microbatch, each inside `scope(index)`; the mean loss."""
    total = torch.zeros((), device=batches[0][0].device)
    for i, (tokens, labels) in enumerate(batches):
        with scope(i):
            loss = model(tokens, labels=labels).mean() / len(batches)
            loss.backward()
        total += loss.detach()
    return total


def build_megatron_fsdp(args: argparse.Namespace, strategy: str) -> StepFn:
    """bf16 model, fp32 sharded main weights (the default MixedPrecisionPolicy)."""
    config, model = build_gpt(args)
    if args.grad_reduce_dtype == "fp32":
        grads = dict(grad_reduce_in_fp32=True)
    else:
        grads = dict(megatron_fsdp_main_grads_dtype=torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        overlap_param_gather=True,
        overlap_grad_reduce=True,
        fsdp_all_gather_in_start_param_sync=not args.cuda_graph,
        megatron_fsdp_keep_unsharded_params=args.megatron_fsdp_keep_unsharded_params,
        megatron_fsdp_accumulate_unsharded_grads=args.megatron_fsdp_accumulate_unsharded_grads,
        **grads,
    )
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    fsdp = FullyShardedDataParallel(config, ddp_config, model, pg_collection=pg_collection)
    for option, nbytes in accumulation_memory(fsdp).items():
        if getattr(args, f"megatron_fsdp_{option}") and dist.get_rank() == 0:
            print(f"{strategy}: {option} holds up to {nbytes / 2**20:,.1f} MiB per rank")
    # The local shards of the main weights: the optimizer skips DTensor dispatch.
    params = local_main_weights(fsdp).values()
    optimizer = fully_shard_optimizer(make_adamw(params, args), fsdp)
    n = args.num_microbatches

    def scope(i: int) -> contextlib.AbstractContextManager:
        if n == 1:
            return contextlib.nullcontext()
        return microbatch(fsdp.module, is_last=i == n - 1)

    def step(batches: list[Batch]) -> torch.Tensor:
        # The training loop's order: gradient memory is freed before the first gather.
        fsdp.zero_grad_buffer()
        fsdp.start_param_sync()
        loss = forward_backward(fsdp, batches, scope)
        fsdp.finish_grad_sync()
        optimizer.step()
        return loss

    return step


def build_fsdp2(args: argparse.Namespace) -> StepFn:
    """fp32 model (FSDP2's sharded fp32 parameters are its main weights), bf16 compute."""
    # Built as the other engines are, then upcast: the main weights start from exactly their
    # initial weights (an fp32 build draws in another dtype, which need not round to them).
    _, model = build_gpt(args)
    model.float()
    policy = torch_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.bf16 else None,
        reduce_dtype=torch.bfloat16 if args.grad_reduce_dtype == "bf16" else torch.float32,
        # The layers' floating-point inputs keep their dtype, as under the other engines: the
        # hidden states are bf16 already, and the rotary angles must stay fp32 (bf16 rounds an
        # angle past 1024 radians to a multiple of 8, scrambling the fastest-turning channels).
        cast_forward_inputs=False,
    )
    mesh = init_device_mesh(torch.device(args.device).type, (dist.get_world_size(),))
    for layer in model.decoder.layers:
        torch_fsdp.fully_shard(layer, mesh=mesh, mp_policy=policy)
    torch_fsdp.fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = make_adamw(model.parameters(), args)
    n = args.num_microbatches

    @contextlib.contextmanager
    def scope(i: int) -> Iterator[None]:
        model.set_requires_gradient_sync(i == n - 1)
        yield

    def step(batches: list[Batch]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(model, batches, scope)
        optimizer.step()
        return loss

    return step


def build_ddp(args: argparse.Namespace) -> StepFn:
    """bf16 replicated model; fp32 replicated main weights kept by `MainWeightsAdamW` (the DDP
    engine reduces gradients into `main_grad`; see that class for why not `MegatronOptimizer`)."""
    config, model = build_gpt(args)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, grad_reduce_in_fp32=args.grad_reduce_dtype == "fp32"
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = MainWeightsAdamW(model.parameters(), args)
    n = args.num_microbatches

    def scope(i: int) -> contextlib.AbstractContextManager:
        return ddp.no_sync() if i < n - 1 else contextlib.nullcontext()

    def step(batches: list[Batch]) -> torch.Tensor:
        ddp.zero_grad_buffer()
        loss = forward_backward(ddp, batches, scope)
        ddp.finish_grad_sync()
        optimizer.step()
        return loss

    return step


def build_single(args: argparse.Namespace) -> StepFn:
    """The `ddp` arrangement on one rank, gradients accumulated locally, no communication."""
    _, model = build_gpt(args)
    grad_dtype = torch.bfloat16 if args.grad_reduce_dtype == "bf16" else torch.float32
    main_grads = attach_local_main_grads(model, grad_dtype)
    optimizer = MainWeightsAdamW(model.parameters(), args)

    def step(batches: list[Batch]) -> torch.Tensor:
        main_grads.zero_()
        loss = forward_backward(model, batches, lambda i: contextlib.nullcontext())
        optimizer.step()
        return loss

    return step


def build_engine(name: str, args: argparse.Namespace) -> StepFn:
    """The step function of engine `name`, its model built on the current default device."""
    if name.startswith("megatron_fsdp_"):
        strategy = {"zero3": "optim_grads_params", "zero2": "optim_grads"}[name.split("_")[-1]]
        return build_megatron_fsdp(args, strategy)
    return {"fsdp2": build_fsdp2, "ddp": build_ddp, "single": build_single}[name](args)


def precision_note(name: str, args: argparse.Namespace) -> str:
    """How `name` holds weights and gradients in this run (the table's footnote)."""
    note = _precision(name, args)
    return f"{note}; whole step replayed from a CUDA graph" if args.cuda_graph else note


def _precision(name: str, args: argparse.Namespace) -> str:
    grads = f"grads reduced in {args.grad_reduce_dtype}"
    if not args.bf16:
        return f"fp32 weights and compute, {grads}"
    return {
        "fsdp2": f"fp32 sharded params = main weights (AdamW on DTensors), bf16 compute "
        f"(mp_policy), {grads}",
        "ddp": f"bf16 params + fp32 main weights and AdamW state, all replicated, {grads}",
        "single": f"bf16 params + fp32 main weights, grads accumulated in {args.grad_reduce_dtype}",
    }.get(
        name,
        f"bf16 compute weights, fp32 sharded main weights (default policy; AdamW on their "
        f"local shards), {grads}",
    )


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
    loss = float("nan")
    if active:
        batches = make_batches(args, device)
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
        if args.profile:
            profile_steps(step, batches, name, args.profile, device)
        del step, batches
    if name == "single":
        dist.barrier()
    peak = requested = 0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        requested = torch.cuda.memory_stats(device)["requested_bytes.all.peak"]
    return {"times": times, "launch": launch, "loss": loss, "peak": peak, "requested": requested}


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


def main() -> None:
    """Runs every requested engine in turn; rank 0 prints (and writes) the results."""
    parser = build_parser()
    args = check_args(parser, parser.parse_args())
    if args.deterministic:
        # cuBLAS reads this when it initialises (deterministic mode refuses to run without it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = init_distributed(torch.device(args.device).type)
    parallel_state.initialize_model_parallel(create_all_gather_group=args.create_all_gather_group)
    with torch.device("meta"):
        config, model = build_gpt(args)
    num_params = sum(p.numel() for p in model.parameters())
    rows = []
    for name in args.engines:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        rows.append(summarize(name, run_engine(name, args, device), args, config, device))
    single = next((r["step_ms"] for r in rows if r["engine"] == "single"), None)
    for row in rows:
        row["vs_single"] = row["step_ms"] / single if single else None
    report(rows, args, device, num_params)
    gc.collect()  # free the last engine before its process groups go
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
