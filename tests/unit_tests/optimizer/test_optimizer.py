"""`get_megatron_optimizer`: weight decay skips biases and norm weights; the same Megatron loop
with the optimizer wrapper trains identically under Megatron-FSDP and the DDP engine."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
)
from megatron.core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES
from megatron.core.distributed.fsdp import local_main_weights
from megatron.core.optimizer import (
    MegatronOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    get_param_groups,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from tests.unit_tests.distributed.fsdp.fsdp_training import full_state
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)

NUM_MICROBATCHES = 2
# Small enough that clipping acts at every step, so its scale reaches the weights.
CLIP_GRAD = 0.05


def test_no_weight_decay_on_biases_and_norm_weights():
    model = build_tiny_gpt()
    names = {p: n for n, p in model.named_parameters()}
    decay, no_decay = get_param_groups(model, weight_decay=0.1)
    assert (decay["wd_mult"], decay["weight_decay"]) == (1.0, 0.1)
    assert (no_decay["wd_mult"], no_decay["weight_decay"]) == (0.0, 0.0)
    expected = {n for n in names.values() if n.endswith((".bias", "layernorm.weight"))}
    assert {names[p] for p in no_decay["params"]} == expected
    assert {names[p] for p in decay["params"]} == set(names.values()) - expected


def test_adamw_decays_only_weights_and_keeps_zero_wd_under_the_scheduler():
    model = build_tiny_gpt()
    lr, wd = 0.1, 0.5
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=lr, weight_decay=wd), model)
    scheduler = OptimizerParamScheduler(
        optimizer, lr, lr, 0.0, 0, 10, "constant", wd, wd, 10, "constant"
    )
    scheduler.step(1)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [wd, 0.0]
    before = full_state(model)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # Adam's update is then decay alone
    update_successful, grad_norm, num_zeros = optimizer.step()
    assert (update_successful, grad_norm, num_zeros) == (True, 0.0, None)
    for name, param in model.named_parameters():
        factor = 1.0 if name.endswith(".bias") or param.ndim == 1 else 1.0 - lr * wd
        torch.testing.assert_close(param.detach(), before[name] * factor, msg=name)


def test_bad_config_raises():
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        OptimizerConfig(optimizer="lamb")
    with pytest.raises(ValueError, match="clip_grad"):
        OptimizerConfig(clip_grad=-1.0)
    with pytest.raises(ValueError, match="lr is None"):
        get_megatron_optimizer(OptimizerConfig(), build_tiny_gpt())


def test_state_dict_round_trip():
    def trained_optimizer(model) -> MegatronOptimizer:
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), model)
        tokens, labels = make_token_batches(1, 4)[0]
        model(tokens, labels=labels).mean().backward()
        optimizer.step()
        return optimizer

    model = build_tiny_gpt()
    saved = trained_optimizer(model).state_dict()
    restored = get_megatron_optimizer(OptimizerConfig(lr=1.0), build_tiny_gpt())
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["lr"] == 1e-2
    first = next(iter(saved["state"].values()))
    torch.testing.assert_close(restored.state_dict()["state"][0]["exp_avg"], first["exp_avg"])


def _train(engine: str, optimizer_name: str, loop_syncs: bool = True) -> dict:
    """Two steps of Megatron's loop on this rank's slice of each batch; `engine` is 'ddp' or a
    Megatron-FSDP sharding strategy. Without `loop_syncs` every backward runs under no_sync()
    and the loop never calls finish_grad_sync(): the optimizer must complete the reduction."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_tiny_gpt()
    if engine == "ddp":
        wrapper = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    else:
        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy=engine
        )
        wrapper = FullyShardedDataParallel(model.config, ddp_config, model)
    config = OptimizerConfig(
        optimizer=optimizer_name, lr=1e-2, weight_decay=0.1, clip_grad=CLIP_GRAD
    )
    optimizer = get_megatron_optimizer(config, wrapper)
    grad_norms = []
    for tokens, labels in make_token_batches(2, 8):
        tokens = shard_batch(tokens, rank, world_size).chunk(NUM_MICROBATCHES)
        labels = shard_batch(labels, rank, world_size).chunk(NUM_MICROBATCHES)
        wrapper.zero_grad_buffer()
        optimizer.zero_grad()
        for i in range(NUM_MICROBATCHES):
            last = i == NUM_MICROBATCHES - 1
            with contextlib.nullcontext() if last and loop_syncs else wrapper.no_sync():
                loss = wrapper(tokens[i], labels=labels[i]).mean() / NUM_MICROBATCHES
                loss.backward()
        if loop_syncs:
            wrapper.finish_grad_sync()
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful
        grad_norms.append(grad_norm)
        wrapper.start_param_sync()
    return dict(state=full_state(model), grad_norms=grad_norms)


@pytest.mark.parametrize(
    "strategy, optimizer_name, loop_syncs",
    [(s, "adam", True) for s in SHARDING_STRATEGIES]
    + [("optim_grads_params", "sgd", True), ("optim", "adam", False)],
)
def test_fsdp_matches_ddp_with_the_wrapper(strategy, optimizer_name, loop_syncs):
    fsdp = run_distributed(_train, 2, strategy, optimizer_name, loop_syncs)
    ddp = run_distributed(_train, 2, "ddp", optimizer_name, loop_syncs)
    initial = full_state(build_tiny_gpt())
    assert all(norm > CLIP_GRAD for norm in ddp[0]["grad_norms"]), "clipping never acted"
    assert any(not torch.equal(initial[n], ddp[0]["state"][n]) for n in initial)
    for fsdp_rank, ddp_rank in zip(fsdp, ddp):
        torch.testing.assert_close(fsdp_rank["grad_norms"], ddp_rank["grad_norms"])
        for name, expected in ddp_rank["state"].items():
            torch.testing.assert_close(fsdp_rank["state"][name], expected, msg=name)


def _fsdp_optimizer_steps_local_shards() -> bool:
    model = build_tiny_gpt()
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    wrapper = FullyShardedDataParallel(model.config, ddp_config, model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), wrapper)
    held = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    local = local_main_weights(wrapper)
    names = {local[p]: name for name, p in wrapper.module.named_parameters()}
    decayed = {names[p] for p in optimizer.param_groups[0]["params"]}
    tokens, labels = make_token_batches(1, 4)[0]
    wrapper(tokens, labels=labels).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return (
        not any(isinstance(p, DTensor) for p in held)
        and {id(p) for p in held} == {id(p) for p in local.values()}
        and decayed == {n for n, p in wrapper.module.named_parameters() if p.ndim > 1}
        and all(p.grad is None for p in [*held, *wrapper.parameters()])
    )


def test_fsdp_optimizer_steps_the_local_shards():
    """Plain local tensors (no DTensor dispatch in the step), grouped by the DTensors' names;
    zero_grad() drops the DTensor gradients the torch optimizer never sees."""
    assert all(run_distributed(_fsdp_optimizer_steps_local_shards, 2))


def _ddp_bf16_step() -> bool:
    config = tiny_gpt_config(bf16=True, params_dtype=torch.bfloat16)
    model = build_tiny_gpt(config)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    wrapper = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), wrapper)
    before = full_state(model)
    tokens, labels = make_token_batches(1, 4)[0]
    wrapper(tokens, labels=labels).mean().backward()
    update_successful, _, _ = optimizer.step()
    grads_cleared = all(p.grad is None for p in model.parameters())
    changed = all(not torch.equal(before[n], p.float()) for n, p in model.named_parameters())
    return update_successful and grads_cleared and changed


def test_ddp_steps_bf16_parameters_with_fp32_main_grads():
    """The DDP engine has no master weights: fp32 main_grads are cast for the bf16 step, and
    `.grad` is left None for the engine's next backward."""
    assert all(run_distributed(_ddp_bf16_step, 2))
