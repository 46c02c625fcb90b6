"""FP8 compute under the data-parallel engines (2 ranks, weights gathered in bf16): the FP8
weight copies follow the weights the engines refresh, and a tiny ZeRO-3 run in FP8 (hybrid,
delayed), its weights gathered in bf16 or as FP8 (`fp8_param_gather`), ends within a few
percent of its bf16 twin's loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.fsdp import FullyShardedDataParallel, fully_shard_optimizer
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)

BF16 = dict(params_dtype=torch.bfloat16, bf16=True)
FP8 = dict(fp8="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
BLOCKWISE = dict(fp8="e4m3", fp8_recipe="blockwise")


def _wrapped(config, strategy: str, fp8_param_gather: bool = False) -> FullyShardedDataParallel:
    model = build_tiny_gpt(config)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        fp8_param_gather=fp8_param_gather,
    )
    return FullyShardedDataParallel(model.config, ddp_config, model)


def _logits_after_an_in_place_write(strategy: str, fp8: dict = FP8) -> list[bool]:
    """A forward (which makes the FP8 weight copies), an in-place write to the main weights
    (no optimizer step: the engine gathers the new compute weights without bumping their
    version counters), another forward: its logits are those of a plain FP8 model holding the
    written weights."""
    config = tiny_gpt_config(**BF16, **fp8)
    fsdp = _wrapped(config, strategy)
    tokens, _ = make_token_batches(1, 2, seed=3)[0]
    fsdp(tokens)
    with torch.no_grad():
        for param in fsdp.parameters():
            param.mul_(0.5)
    logits = fsdp(tokens)
    plain = build_tiny_gpt(config)
    plain(tokens)  # the same delayed-scaling passes as the wrapped model's
    with torch.no_grad():
        for param in plain.parameters():
            param.mul_(0.5)
    return [torch.equal(logits, plain(tokens))]


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_fp8_weights_follow_the_engines_refreshed_weights(strategy):
    assert run_distributed(_logits_after_an_in_place_write, 2, strategy) == [[True]] * 2


def _ddp_logits_after_an_unseen_write(fp8: dict = FP8) -> list[bool]:
    """A write no version counter sees (as a replayed CUDA graph's optimizer step), then
    `start_param_sync(force_sync=True)`, the engine's signal that weights changed: the next
    forward casts the new weights."""
    config = tiny_gpt_config(**BF16, **fp8)
    model = build_tiny_gpt(config)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    tokens, _ = make_token_batches(1, 2, seed=3)[0]
    ddp(tokens)
    for param in model.parameters():
        param.data.mul_(0.5)  # `.data` bumps no version counter
    ddp.start_param_sync(force_sync=True)
    logits = ddp(tokens)
    plain = build_tiny_gpt(config)
    plain(tokens)
    with torch.no_grad():
        for param in plain.parameters():
            param.mul_(0.5)
    return [torch.equal(logits, plain(tokens))]


def test_fp8_weights_follow_the_ddp_engines_forced_sync():
    assert run_distributed(_ddp_logits_after_an_unseen_write, 2) == [[True]] * 2


def test_blockwise_fp8_weights_follow_both_engines():
    """The blockwise recipe's 128x128 weight copies follow the same signals, under ZeRO-3
    (weights gathered in bf16 at each use) and under the DDP engine."""
    zero3 = run_distributed(_logits_after_an_in_place_write, 2, "optim_grads_params", BLOCKWISE)
    assert zero3 == [[True]] * 2
    assert run_distributed(_ddp_logits_after_an_unseen_write, 2, BLOCKWISE) == [[True]] * 2


def _zero3_losses(fp8: bool, fp8_param_gather: bool = False, steps: int = 12) -> list[float]:
    config = tiny_gpt_config(**BF16, **(FP8 if fp8 else {}))
    fsdp = _wrapped(config, "optim_grads_params", fp8_param_gather)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(fsdp.parameters(), lr=1e-2), fsdp)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    tokens, labels = make_token_batches(1, 8, seed=11)[0]
    for _ in range(steps):  # the same batch: the model learns it
        loss = fsdp(shard_batch(tokens, rank, world_size), labels=shard_batch(labels, rank, 2))
        loss = loss.float().mean()
        loss.backward()
        fsdp.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(summed.item() / world_size)
    return losses


@pytest.mark.parametrize("fp8_param_gather", [False, True], ids=["bf16-gather", "fp8-gather"])
def test_zero3_fp8_run_ends_near_its_bf16_twin(fp8_param_gather):
    fp8 = run_distributed(_zero3_losses, 2, True, fp8_param_gather)[0]
    bf16 = run_distributed(_zero3_losses, 2, False)[0]
    assert fp8[-1] < fp8[0] - 0.3  # it learns
    assert abs(fp8[-1] - bf16[-1]) < 0.03 * bf16[-1], (fp8, bf16)
