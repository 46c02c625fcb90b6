"""GPU: `--fp8-param-gather` through `pretrain_gpt.py` on CUDA (the fused cast kernels, the
all-gather stream): Megatron-FSDP trains bit for bit as without it, eager and with the whole
iteration in a CUDA graph, whose replays cast the FP8 weights from the main weights the graphed
optimizer step wrote. One rank per GPU present (1 or 2)."""

from __future__ import annotations

import os

import pytest
import torch

import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training.training import TrainingHistory, pretrain
from tests.unit_tests.distributed_harness import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--micro-batch-size 2 --train-iters 8 --lr 0.001953125 --lr-decay-style constant "
    "--mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --bf16 --eval-iters 0 "
    "--hidden-dropout 0 --attention-dropout 0 --fp8-format hybrid --fp8-amax-history-len 4 "
    "--fp8-amax-compute-algo max --use-megatron-fsdp --no-fsdp-all-gather-in-start-param-sync "
    "--overlap-grad-reduce --overlap-param-gather"
).split()
GRAPHED = ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2"]


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
