"""`--log-params-norm` and `--log-num-zeros-in-grad` on 2 gloo ranks: the parameters' norm and
the zero-gradient count of each engine (the DDP engine, its distributed optimizer, Megatron-FSDP
sharding optimizer state only and everything) equal those of one plain PyTorch process that
takes the same SGD step on the whole batch (linear in the gradient, so the weights agree to
rounding; Adam's first step is sign-like and amplifies the rounding of near-zero gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
    wrap_for_engine,
)

LR = 0.5
BATCH = 4  # 32 tokens of a 64-token vocabulary: unused embedding rows get zero gradients


def _model() -> torch.nn.Module:
    # Untied: a tied output layer would give every embedding row a gradient. No biases: the
    # key bias's gradient is zero in exact arithmetic, so whether an element rounds to 0.0
    # depends on the summation order.
    config = tiny_gpt_config(add_bias_linear=False)
    return build_tiny_gpt(config, share_embeddings_and_output_weights=False)


def _engine_step(engine: str) -> tuple[float, int, float]:
    """One step of `engine` on this rank's half of the batch: (params norm before the step,
    the step's zero-gradient count, params norm after it)."""
    parallel_state.initialize_model_parallel()
    try:
        if engine == "distributed-optimizer":
            config = DistributedDataParallelConfig(use_distributed_optimizer=True)
            model = _model()
            model = DistributedDataParallel(model.config, config, model)
        else:
            model = wrap_for_engine(_model(), engine)
        config = OptimizerConfig(
            optimizer="sgd", lr=LR, weight_decay=0.0, clip_grad=0.0, log_num_zeros_in_grad=True
        )
        optimizer = get_megatron_optimizer(config, model)
        before = optimizer.get_params_norm()
        tokens, labels = make_token_batches(1, BATCH)[0]
        rank, world_size = dist.get_rank(), dist.get_world_size()
        tokens = shard_batch(tokens, rank, world_size)
        labels = shard_batch(labels, rank, world_size)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(tokens, labels=labels).float().mean().backward()
        model.finish_grad_sync()
        update_successful, _, num_zeros = optimizer.step()
        assert update_successful
        return before, num_zeros, optimizer.get_params_norm()
    finally:
        parallel_state.destroy_model_parallel()


def _reference_step() -> tuple[float, int, float]:
    """The same step in one process with torch's SGD on the whole batch."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def norm() -> float:
        return torch.linalg.vector_norm(torch.cat([p.flatten() for p in model.parameters()]))

    before = norm().item()
    tokens, labels = make_token_batches(1, BATCH)[0]
    device = current_device()
    model(tokens.to(device), labels=labels.to(device)).float().mean().backward()
    zeros = sum(int((p.grad == 0).sum()) for p in model.parameters())
    optimizer.step()
    return before, zeros, norm().item()


@pytest.mark.parametrize("engine", ["ddp", "distributed-optimizer", "optim", "optim_grads_params"])
def test_params_norm_and_zero_count_match_one_process(engine):
    before, zeros, after = _reference_step()
    assert zeros > 0, "the batch should leave some embedding rows without gradient"
    for rank_before, rank_zeros, rank_after in run_distributed(_engine_step, 2, engine):
        assert rank_before == pytest.approx(before, rel=1e-6)
        assert rank_zeros == zeros
        assert rank_after == pytest.approx(after, rel=1e-6)
    assert after != pytest.approx(before, rel=1e-6), "the step should move the weights"
