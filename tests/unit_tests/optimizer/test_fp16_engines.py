"""fp16 with loss scaling under both engines, and the DDP engine's distributed optimizer (2
ranks): an inf in one rank's gradient (shard) skips the step on every rank, and fp16 training
follows fp32 training's loss curve."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
    wrap_for_engine,
)

DISTRIBUTED_OPTIMIZER = "ddp-distributed-optimizer"
ENGINES = ["ddp", DISTRIBUTED_OPTIMIZER, "optim_grads", "optim_grads_params"]
"""The DDP engine (without and with `use_distributed_optimizer`), Megatron-FSDP ZeRO-2 and
ZeRO-3."""

FP16_LOSS_RTOL = 5e-3
"""fp16 compute rounds activations and weights to 11 significant bits (relative 2**-11 ~ 5e-4
per operation); over 8 Adam steps of a 2-layer GPT the loss stays within 0.5% of fp32's (0.07%
measured on CPU for DDP and ZeRO-3)."""


def _build(engine: str, fp16: bool, initial_loss_scale: float = 2.0**10, hysteresis: int = 2):
    dtypes = dict(fp16=True, params_dtype=torch.float16) if fp16 else {}
    model = build_tiny_gpt(tiny_gpt_config(**dtypes))
    if fp16:
        # The fp32 model's weights, rounded: torch draws `normal_` differently per dtype in some
        # releases (2.11 on CPU), which would make the two runs start from different models.
        model.load_state_dict(build_tiny_gpt().state_dict())
    if engine == DISTRIBUTED_OPTIMIZER:
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
        model = DistributedDataParallel(model.config, ddp_config, model)
    else:
        model = wrap_for_engine(model, engine)
    config = OptimizerConfig(
        lr=1e-2,
        clip_grad=1.0,
        fp16=fp16,
        initial_loss_scale=initial_loss_scale,
        hysteresis=hysteresis,
    )
    return model, get_megatron_optimizer(config, model)


def _forward_backward(model, optimizer, tokens, labels) -> float:
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens, labels=labels).float().mean()
    optimizer.scale_loss(loss).backward()
    model.finish_grad_sync()
    averaged = loss.detach().clone()
    dist.all_reduce(averaged)
    return averaged.item() / dist.get_world_size()


def _local_main_weights(model) -> list[torch.Tensor]:
    return [
        (p.to_local() if isinstance(p, DTensor) else p).detach().float().clone()
        for p in model.parameters()
    ]


def _inf_on_one_rank(engine: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = _build(engine, fp16=True, hysteresis=1)
    tokens, labels = make_token_batches(1, 4)[0]
    tokens, labels = shard_batch(tokens, rank, world), shard_batch(labels, rank, world)
    _forward_backward(model, optimizer, tokens, labels)
    first = optimizer.step()
    scale_after_first = optimizer.get_loss_scale()

    _forward_backward(model, optimizer, tokens, labels)
    optimizer.finish_grad_sync()
    before = _local_main_weights(model)
    sharded = []
    if rank == 1:
        # Poison one element of a gradient this rank alone holds: under Megatron-FSDP its shard
        # of the gradient; with the distributed optimizer its reduced gradient shard; under DDP
        # its copy of the all-reduced main_grad.
        for param in model.parameters():
            if engine == DISTRIBUTED_OPTIMIZER:
                grad = model.grad_shard(param)
            else:
                grad = param.grad if isinstance(param, DTensor) else param.main_grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local.numel():
                sharded.append(isinstance(grad, DTensor) or engine == DISTRIBUTED_OPTIMIZER)
                local.view(-1)[0] = float("inf")
                break
    second = optimizer.step()
    after = _local_main_weights(model)
    return dict(
        first_stepped=first[0],
        second=second,
        unchanged=all(torch.equal(b, a) for b, a in zip(before, after, strict=True)),
        scales=(scale_after_first, optimizer.get_loss_scale()),
        sharded=sharded,
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_inf_in_one_ranks_gradient_skips_the_step_on_every_rank(engine):
    results = run_distributed(_inf_on_one_rank, 2, engine)
    for result in results:
        assert result["first_stepped"]
        assert result["second"] == (False, None, None)
        assert result["unchanged"]
        # Hysteresis 1: the overflow halves the scale, on both ranks alike.
        assert result["scales"] == (2.0**10, 2.0**9)
    assert results[1]["sharded"] == [engine != "ddp"]


def _loss_curve(engine: str, fp16: bool, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = _build(engine, fp16=fp16)
    losses, skipped = [], 0
    # One batch over and over: memorising it lowers the loss at every step.
    tokens, labels = make_token_batches(1, 4, seed=3)[0]
    tokens, labels = shard_batch(tokens, rank, world), shard_batch(labels, rank, world)
    for _ in range(steps):
        losses.append(_forward_backward(model, optimizer, tokens, labels))
        skipped += not optimizer.step()[0]
    return dict(losses=torch.tensor(losses), skipped=skipped, scale=optimizer.get_loss_scale())


@pytest.mark.parametrize("engine", ENGINES)
def test_fp16_training_follows_fp32(engine):
    steps = 8
    fp32 = run_distributed(_loss_curve, 2, engine, False, steps)[0]
    fp16 = run_distributed(_loss_curve, 2, engine, True, steps)[0]
    assert fp16["skipped"] == 0 and fp16["scale"] == 2.0**10
    assert fp32["losses"][-1] < fp32["losses"][0] - 0.1  # it trains, so the curves can differ
    torch.testing.assert_close(fp16["losses"], fp32["losses"], rtol=FP16_LOSS_RTOL, atol=0)
