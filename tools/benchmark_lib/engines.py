"""The engines `tools/benchmark_fsdp.py` times: how each one builds the GPT, wraps it, and runs
one training step (every microbatch, then the optimizer), and how it holds weights and gradients.

Megatron-FSDP's hybrid engines (`megatron_fsdp_hsdp`, `megatron_fsdp_hfsdp`) shard ZeRO-3 inside
each of `--num-distributed-optimizer-instances` instances of world / instances ranks and either
replicate across the instances (HSDP) or also shard the optimizer state across them (HFSDP); they
take their groups from `parallel_state`, which the caller initialises with that many instances
(`instances()`); every other engine runs over all ranks with one instance. Imported by the
benchmark scripts in `tools/`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.fsdp import (
    FullyShardedDataParallel,
    accumulation_memory,
    fully_shard_optimizer,
    local_main_weights,
    microbatch,
    unit_memory,
)
from megatron.core.fusions.fused_adam import step_and_copy
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.grad_accumulation import FusionTarget, register_main_grad

from .gpt_model import build_gpt

ENGINES = ("megatron_fsdp_zero3", "megatron_fsdp_zero2", "fsdp2", "ddp", "single")
"""The engines that run at every world size: `--engines`' default."""
HYBRID_ENGINES = ("megatron_fsdp_hsdp", "megatron_fsdp_hfsdp")
"""Engines over several data-parallel instances: only where the world size splits into them."""
OPTIONAL_ENGINES = ("megatron_fsdp_no_shard",)
"""Engines that run at every world size, on request only."""
MEGATRON_FSDP = {
    "megatron_fsdp_zero3": ("optim_grads_params", None),
    "megatron_fsdp_zero2": ("optim_grads", None),
    "megatron_fsdp_no_shard": ("no_shard", None),
    "megatron_fsdp_hsdp": ("optim_grads_params", "no_shard"),
    "megatron_fsdp_hfsdp": ("optim_grads_params", "optim"),
}
"""Each Megatron-FSDP engine's (sharding inside an instance, sharding across the instances;
None: one instance of all ranks)."""
GRAPHABLE = ("megatron_fsdp_zero3", "megatron_fsdp_zero2", "single")
"""Engines whose whole step captures in a CUDA graph (`--cuda-graph`)."""
Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[list[Batch]], torch.Tensor]
"""Runs one training step (every microbatch, then the optimizer); returns the detached loss."""


def instances(name: str, args: argparse.Namespace) -> int:
    """How many data-parallel instances engine `name` runs over (parallel_state's
    `num_distributed_optimizer_instances` while it runs)."""
    if name in HYBRID_ENGINES:
        return args.num_distributed_optimizer_instances
    return 1


def layout(name: str, args: argparse.Namespace, world: int) -> str:
    """How engine `name` lies over `world` ranks, e.g. "HSDP 2 x 4" (instances x ranks each)."""
    if name == "single":
        return "1 rank"
    if name in HYBRID_ENGINES:
        count = instances(name, args)
        kind = "HSDP" if MEGATRON_FSDP[name][1] == "no_shard" else "HFSDP"
        return f"{kind} {count} x {world // count}"
    kinds = {
        "fsdp2": "FSDP2",
        "ddp": "DDP",
        "megatron_fsdp_zero2": "ZeRO-2",
        "megatron_fsdp_no_shard": "no_shard",
    }
    kind = kinds.get(name, "ZeRO-3")
    return f"{kind} over {world}"


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
        self.copies = [(p, m) for p, m in zip(self.params, self.main) if p is not m]

    @torch.no_grad()
    def step(self) -> None:
        """Steps the main weights with the accumulated `main_grad`s and refreshes the params
        (in one kernel where `step_and_copy` can)."""
        for param, main in zip(self.params, self.main):
            main.grad = param.main_grad.to(main.dtype)  # a view when already fp32
        step_and_copy(self.optimizer, self.copies)
        # Detached again: fp32 parameters are their own main weights, and backward must not
        # accumulate into a `.grad` that is a view of `main_grad`.
        self.optimizer.zero_grad(set_to_none=True)


class LocalMainGrads:
    """Gives every parameter a `main_grad` view of one flat buffer that backward accumulates
    into (as the DDP engine does, without communication); with `fusion`, linear layers add
    their weight gradients to it in their GEMMs (gradient-accumulation fusion)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, fusion: bool):
        params = [p for p in model.parameters() if p.requires_grad]
        device = params[0].device
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        offset = 0
        for param in params:
            param.main_grad = self.buffer[offset : offset + param.numel()].view_as(param)
            param.register_post_accumulate_grad_hook(self._accumulate)
            if fusion:
                register_main_grad(param, self._main_grad_of)
            offset += param.numel()

    @staticmethod
    def _accumulate(param: torch.nn.Parameter) -> None:
        if param.grad is not None:  # None: fused into main_grad already
            param.main_grad.add_(param.grad)
            param.grad = None

    def _main_grad_of(self, param: torch.nn.Parameter) -> FusionTarget:
        return FusionTarget(param.main_grad)


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


def wrapper_step(
    wrapper: _BaseDataParallel,
    optimizer_step: Callable[[], None],
    scope: Callable[[int], contextlib.AbstractContextManager],
) -> StepFn:
    """The step of a Megatron data-parallel `wrapper` (DDP or Megatron-FSDP), in the training
    loop's order: gradient memory is freed before the first gather."""

    def step(batches: list[Batch]) -> torch.Tensor:
        wrapper.zero_grad_buffer()
        wrapper.start_param_sync()
        loss = forward_backward(wrapper, batches, scope)
        wrapper.finish_grad_sync()
        optimizer_step()
        return loss

    return step


def build_megatron_fsdp(args: argparse.Namespace, name: str) -> StepFn:
    """bf16 model, fp32 sharded main weights (the default MixedPrecisionPolicy); engine `name`
    of `MEGATRON_FSDP`, over the instances `parallel_state` holds."""
    strategy, outer = MEGATRON_FSDP[name]
    hybrid = {}
    if outer is not None:
        hybrid = dict(
            num_distributed_optimizer_instances=instances(name, args),
            outer_dp_sharding_strategy=outer,
        )
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
        use_symm_mem=args.use_symm_mem,
        suggested_communication_unit_size=args.suggested_communication_unit_size,
        fp8_param_gather=args.fp8_param_gather and args.fp8_format is not None,
        **grads,
        **hybrid,
    )
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    fsdp = FullyShardedDataParallel(config, ddp_config, model, pg_collection=pg_collection)
    for option, nbytes in accumulation_memory(fsdp).items():
        if getattr(args, f"megatron_fsdp_{option}") and dist.get_rank() == 0:
            print(f"{name}: {option} holds up to {nbytes / 2**20:,.1f} MiB per rank")
    if args.suggested_communication_unit_size is not None and dist.get_rank() == 0:
        held = ", ".join(f"{kind} {n / 2**20:,.1f} MiB" for kind, n in unit_memory(fsdp).items())
        print(f"{name}: one unit holds up to (whole, per rank) {held}")
    # The local shards of the main weights: the optimizer skips DTensor dispatch.
    params = local_main_weights(fsdp).values()
    optimizer = fully_shard_optimizer(make_adamw(params, args), fsdp)
    n = args.num_microbatches

    def scope(i: int) -> contextlib.AbstractContextManager:
        if n == 1:
            return contextlib.nullcontext()
        return microbatch(fsdp.module, is_last=i == n - 1)

    def optimizer_step() -> None:
        # As MegatronOptimizer steps it: the fused kernel where it applies, recording the
        # amaxes of FP8 weights (`--fp8-param-gather`) on the way.
        step_and_copy(optimizer, amaxes=[fsdp.prepare_step_amaxes()])

    return wrapper_step(fsdp, optimizer_step, scope)


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

    return wrapper_step(ddp, optimizer.step, scope)


def build_single(args: argparse.Namespace) -> StepFn:
    """The `ddp` arrangement on one rank, gradients accumulated locally, no communication."""
    groups = None
    if args.fp8_format:
        # FP8's amaxes are reduced over the model's tp x dp x cp ranks: this rank alone here.
        alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        groups = dataclasses.replace(
            ProcessGroupCollection.use_mpu_process_groups(), tp_dp_cp=alone
        )
    config, model = build_gpt(args, pg_collection=groups)
    grad_dtype = torch.bfloat16 if args.grad_reduce_dtype == "bf16" else torch.float32
    main_grads = LocalMainGrads(model, grad_dtype, config.gradient_accumulation_fusion)
    optimizer = MainWeightsAdamW(model.parameters(), args)

    def step(batches: list[Batch]) -> torch.Tensor:
        main_grads.buffer.zero_()
        loss = forward_backward(model, batches, lambda i: contextlib.nullcontext())
        optimizer.step()
        return loss

    return step


def build_engine(name: str, args: argparse.Namespace) -> StepFn:
    """The step function of engine `name`, its model built on the current default device."""
    if name in MEGATRON_FSDP:
        return build_megatron_fsdp(args, name)
    return {"fsdp2": build_fsdp2, "ddp": build_ddp, "single": build_single}[name](args)


def precision_note(name: str, args: argparse.Namespace) -> str:
    """How `name` holds weights and gradients in this run (the table's footnote)."""
    note = _precision(name, args)
    if args.gradient_accumulation_fusion:
        sharded = name in MEGATRON_FSDP and MEGATRON_FSDP[name][0] != "no_shard"
        if sharded and not args.megatron_fsdp_accumulate_unsharded_grads:
            note += " (layers' weight gradients written by the GEMMs into the reduce-scatter input)"
        elif name != "fsdp2":
            note += " (weight gradients accumulated in the GEMMs)"
    if args.fp8_format:
        note += f"; transformer layers' linears in FP8 ({args.fp8_format}, {args.fp8_recipe})"
        if args.fp8_param_gather and name in MEGATRON_FSDP:
            note += ", their weights gathered in FP8"
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
        "megatron_fsdp_no_shard": f"bf16 compute weights, fp32 main weights and AdamW state, "
        f"all replicated, {grads}",
    }.get(
        name,
        f"bf16 compute weights, fp32 sharded main weights (default policy; AdamW on their "
        f"local shards), {grads}",
    )
