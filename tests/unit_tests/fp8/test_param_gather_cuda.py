"""GPU: `--fp8-param-gather` through `pretrain_gpt.py` on CUDA (the fused cast kernels, the
all-gather stream): Megatron-FSDP, and the DDP engine's distributed optimizer, train bit for bit
as without it, eager and with the whole iteration in a CUDA graph, whose replays cast the FP8
weights from the main weights the graphed optimizer step wrote (with a multi-token prediction
depth in FP8 too, and with MoE layers whose grouped FP8 experts keep their token counts on the
device); with `--keep-fp8-transpose-cache` too, whose kept transposes hold 1 byte per
element of the FP8 weights from step to step and are freed at each refresh (the memory allocated
stays flat), made by the C++ backward once per gather of the weights, or once per step where
kept. One rank per GPU present (1 or 2)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from unittest import mock

import pytest
import torch

import pretrain_gpt
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp import FullyShardedDataParallel
from megatron.core.distributed.fsdp.roots import parameter_groups
from megatron.core.enums import ModelType
from megatron.core.fp8 import cpp_linear
from megatron.core.fp8.multi_tensor_cast import MultiTensorCast
from megatron.training.training import TrainingHistory, pretrain
from tests.unit_tests.distributed.fsdp.engine_spies import spy_on_engine
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--micro-batch-size 2 --train-iters 8 --lr 0.001953125 --lr-decay-style constant "
    "--mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --bf16 --eval-iters 0 "
    "--hidden-dropout 0 --attention-dropout 0 --fp8-format hybrid --fp8-amax-history-len 4 "
    "--fp8-amax-compute-algo max --overlap-grad-reduce"
).split()
BASE = [
    *MODEL,
    *"--use-megatron-fsdp --no-fsdp-all-gather-in-start-param-sync --overlap-param-gather".split(),
]
DDP = [*MODEL, "--use-distributed-optimizer"]
GRAPHED = ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2"]
MOE = "--num-experts 4 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 --moe-router-topk 2".split()


def _curves(flags: list[str]) -> tuple[list[float], list[float]]:
    """pretrain_gpt on this rank under deterministic kernels: losses and gradient norms."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        history: TrainingHistory = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            argv=[*flags, "--distributed-backend", "nccl"],
        )
    finally:
        torch.use_deterministic_algorithms(False)
    return history.loss_curve(), list(history.grad_norms)


def _world() -> int:
    return min(torch.cuda.device_count(), 2)


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_fp8_param_gather_trains_as_without_it(strategy, graphed):
    world = _world()
    flags = [*BASE, "--data-parallel-sharding-strategy", strategy]
    flags += ["--global-batch-size", str(4 * world)]
    plain = run_distributed(_curves, world, flags)
    gathered = run_distributed(_curves, world, [*flags, "--fp8-param-gather"])
    if graphed:
        gathered_graphed = run_distributed(_curves, world, [*flags, "--fp8-param-gather", *GRAPHED])
        assert gathered_graphed == gathered
    losses, _ = plain[0]
    assert losses[-1] < losses[0]
    assert gathered == plain


def test_fp8_depths_train_the_same_gathered_as_fp8_and_graphed():
    """ZeRO-3 with a multi-token prediction depth in FP8 (its own delayed-scaling state): the
    same losses with its weights gathered as FP8, and with the whole iteration graphed."""
    world = _world()
    flags = [*BASE, "--data-parallel-sharding-strategy", "optim_grads_params"]
    flags += ["--global-batch-size", str(4 * world), "--mtp-num-layers", "1"]
    plain = run_distributed(_curves, world, flags)
    gathered = run_distributed(_curves, world, [*flags, "--fp8-param-gather"])
    graphed = run_distributed(_curves, world, [*flags, "--fp8-param-gather", *GRAPHED])
    losses, _ = plain[0]
    assert losses[-1] < losses[0]
    assert gathered == plain
    assert graphed == gathered


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="the grouped FP8 experts' Triton kernels need compute capability 9.0 or newer",
)
@pytest.mark.parametrize(
    "engine",
    [
        [*BASE, "--data-parallel-sharding-strategy", "optim_grads"],
        [*BASE, "--data-parallel-sharding-strategy", "optim_grads_params"],
        DDP,
    ],
    ids=["zero2", "zero3", "distributed_optimizer"],
)
def test_fp8_moe_trains_the_same_gathered_as_fp8_and_graphed(engine):
    """Dropless MoE layers with grouped FP8 experts keep their token counts on the device: the
    same losses with the experts' weights gathered as FP8, and with the whole iteration
    graphed, with and without (the router, the dispatch and the experts' casts and GEMMs
    replayed)."""
    world = _world()
    flags = [*engine, "--global-batch-size", str(4 * world), *MOE]
    plain = run_distributed(_curves, world, flags)
    gathered = run_distributed(_curves, world, [*flags, "--fp8-param-gather"])
    losses, _ = plain[0]
    assert losses[-1] < losses[0]
    assert gathered == plain
    assert run_distributed(_curves, world, [*flags, *GRAPHED]) == plain
    assert run_distributed(_curves, world, [*flags, "--fp8-param-gather", *GRAPHED]) == plain


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_ddp_fp8_param_gather_trains_as_without_it(graphed):
    """The DDP engine's distributed optimizer gathering the FP8 weights as FP8: the graph
    captures the amax reduction, the casts, the FP8 all-gather and the dequantised writes."""
    world = _world()
    flags = [*DDP, "--global-batch-size", str(4 * world), *(GRAPHED if graphed else [])]
    plain = run_distributed(_curves, world, flags)
    gathered = run_distributed(_curves, world, [*flags, "--fp8-param-gather"])
    losses, _ = plain[0]
    assert losses[-1] < losses[0]
    assert gathered == plain


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_kept_fp8_transposes_train_as_without_them(graphed):
    """ZeRO-3, four microbatches per step: the transposes made in the first backward serve the
    other three (in the graph too)."""
    world = _world()
    flags = [*BASE, "--data-parallel-sharding-strategy", "optim_grads_params", "--fp8-param-gather"]
    flags += ["--global-batch-size", str(8 * world), *(GRAPHED if graphed else [])]
    freed = run_distributed(_curves, world, flags)
    kept = run_distributed(_curves, world, [*flags, "--keep-fp8-transpose-cache"])
    assert kept == freed


def _zero3_fp8(
    keep_fp8_transpose_cache: bool, strategy: str = "optim_grads_params", num_layers: int = 2
) -> FullyShardedDataParallel:
    """The tiny GPT (of `num_layers` layers) in FP8 under ZeRO-3 (or `strategy`) with
    `--fp8-param-gather` over this rank's GPU."""
    parallel_state.initialize_model_parallel()
    config = tiny_gpt_config(
        params_dtype=torch.bfloat16, bf16=True, fp8="hybrid", num_layers=num_layers
    )
    model = build_tiny_gpt(config)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        fp8_param_gather=True,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
    )
    return FullyShardedDataParallel(config, ddp_config, model)


def _train_steps(
    fsdp: FullyShardedDataParallel, steps: int, after_step: Callable[[], None] = lambda: None
) -> None:
    """`steps` steps of 2 microbatches (AdamW), `after_step` called after each."""
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    dp = parallel_state.get_data_parallel_group()
    batches = make_token_batches(2 * steps, 4 * dp.size(), seed=5)
    for step in range(steps):
        fsdp.zero_grad_buffer()
        for tokens, labels in batches[2 * step : 2 * step + 2]:
            tokens, labels = (shard_batch(t, dp.rank(), dp.size()).cuda() for t in (tokens, labels))
            fsdp(tokens, labels=labels).float().mean().backward()
        fsdp.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        after_step()


def _allocated_after_each_step(keep_fp8_transpose_cache: bool) -> tuple[list[int], int]:
    """ZeRO-3 over this rank's GPU: memory allocated after each of 4 steps of 2 microbatches,
    and the bytes the transposes of the whole FP8 weights take in allocator blocks."""
    gc.collect()  # what earlier runs on this rank left, so that it is not freed mid-run
    fsdp = _zero3_fp8(keep_fp8_transpose_cache)
    allocated = []

    def record() -> None:
        gc.collect()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())

    _train_steps(fsdp, 4, record)
    shapes = [
        shape
        for group in parameter_groups(fsdp.module)
        if group.plan.fp8_gather
        for shape in group.weights.layout.shapes
    ]
    return allocated, sum(-(-shape.numel() // 512) * 512 for shape in shapes)


def test_kept_fp8_transposes_hold_one_byte_per_element_and_do_not_grow():
    world = _world()
    kept = run_distributed(_allocated_after_each_step, world, True)
    freed = run_distributed(_allocated_after_each_step, world, False)
    for (kept_allocated, transpose_bytes), (freed_allocated, _) in zip(kept, freed):
        # From the second step on (the optimizer's states exist), nothing accumulates.
        assert len(set(kept_allocated[1:])) == 1, kept_allocated
        assert len(set(freed_allocated[1:])) == 1, freed_allocated
        assert kept_allocated[-1] - freed_allocated[-1] == transpose_bytes > 0


def _transposes_made_per_step(
    keep_fp8_transpose_cache: bool,
) -> tuple[list[int], list[int], int, int, bool]:
    """ZeRO-3 over this rank's GPU, 3 steps of 2 microbatches: the FP8 weight transposes made
    in each step, the calls that made them (a group's in one), the numbers of FP8 weights and
    of their groups, and whether the C++ extension ran."""
    fsdp = _zero3_fp8(keep_fp8_transpose_cache)
    ends: list[tuple[int, int]] = []
    with spy_on_engine() as calls:
        _train_steps(
            fsdp,
            3,
            lambda: ends.append((calls.count("fp8_transpose"), calls.count("fp8_transpose_all"))),
        )
    shapes = [
        len(group.weights.layout.shapes)
        for group in parameter_groups(fsdp.module)
        if group.plan.fp8_gather
    ]
    built = cpp_linear.native_transpose(torch.empty(1, 1, dtype=torch.uint8, device="cuda"))
    per_step = [[end - start for start, end in zip([0, *column], column)] for column in zip(*ends)]
    return per_step[0], per_step[1], sum(shapes), len(shapes), built is not None


@pytest.mark.parametrize("keep", [False, True], ids=["freed", "kept"])
def test_fp8_transposes_are_made_once_per_gather_or_kept_for_the_step(keep):
    """The C++ backward makes each FP8 weight's transpose at each backward that gathered the
    weights again (ZeRO-3: each microbatch), and once per step where the transposes are kept:
    those of a unit's group in one call of the extension."""
    results = run_distributed(_transposes_made_per_step, _world(), keep)
    if not all(built for *_, built in results):
        pytest.skip("the FP8 C++ extension did not build here (no nvcc or ninja)")
    for made, calls, weights, groups, _ in results:
        assert (weights, groups) == (8, 2)  # 4 linear layers in each of 2 transformer layers
        assert made == [weights * (1 if keep else 2)] * 3, made
        assert calls == [groups * (1 if keep else 2)] * 3, calls


def _fp8_cast_launches_per_step(strategy: str) -> tuple[list[int], int, bool]:
    """3 steps of `strategy` over this rank's GPU, a GPT of 5 layers: the launches of the FP8
    weights' casts in each step, the FP8 groups, and whether their gathers are transient
    (ZeRO-3 over more than one rank)."""
    fsdp = _zero3_fp8(False, strategy, num_layers=5)
    launches = []
    launch = MultiTensorCast.__call__

    def counted(cast: MultiTensorCast, scales: torch.Tensor) -> None:
        launches.append(1)
        launch(cast, scales)

    ends: list[int] = []
    with mock.patch.object(MultiTensorCast, "__call__", counted):
        _train_steps(fsdp, 3, lambda: ends.append(len(launches)))
    groups = [group for group in parameter_groups(fsdp.module) if group.plan.fp8_gather]
    transient = not groups[0].weights.fp8.casts_at_refresh
    return [end - start for start, end in zip([0, *ends], ends)], len(groups), transient


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_fp8_weights_that_stay_whole_are_cast_in_few_launches(strategy):
    """Weights that stay whole (ZeRO-2; ZeRO-3 over one rank) are cast at each step's refresh,
    the groups of 1, 1, 2, ... units a launch each (5 layers: 4 launches); ZeRO-3 over several
    ranks casts each group at its gather."""
    for launches, groups, transient in run_distributed(
        _fp8_cast_launches_per_step, _world(), strategy
    ):
        assert groups == 5
        # The first step's refresh is the model's first: its casts follow the construction.
        assert launches[1:] == [groups if transient else 4] * 2, launches
