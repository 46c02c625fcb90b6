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
    device_batch,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
    wrap_for_engine,
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


def test_apply_wd_to_qk_layernorm_decays_the_query_and_key_norms_only():
    model = build_tiny_gpt(tiny_gpt_config(qk_layernorm=True))
    names = {p: n for n, p in model.named_parameters()}
    qk_norms = {n for n in names.values() if ".q_layernorm." in n or ".k_layernorm." in n}
    assert len(qk_norms) == 8  # a weight and a bias (LayerNorm) per norm and layer, as upstream
    default = get_param_groups(model, 0.1)
    decay, no_decay = get_param_groups(model, 0.1, apply_wd_to_qk_layernorm=True)
    assert {names[p] for p in decay["params"]} == {
        names[p] for p in default[0]["params"]
    } | qk_norms
    assert {names[p] for p in no_decay["params"]} == {
        names[p] for p in default[1]["params"]
    } - qk_norms


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
    wrapper = wrap_for_engine(model, engine)
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
    tokens, labels = device_batch(4)
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


def _ddp_bf16_master_weights() -> dict:
    """bf16 parameters under the DDP engine: a real step, then 10 Adam updates of 1e-3 to
    weights of 1.0, each below half a bf16 ulp just under 1.0 (2**-9): in bf16 they would round
    away."""
    config = tiny_gpt_config(bf16=True, params_dtype=torch.bfloat16)
    model = build_tiny_gpt(config)
    wrapper = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer_config = OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0)
    optimizer = get_megatron_optimizer(optimizer_config, wrapper)
    masters = optimizer.state_dict()["fp32_from_fp16_params"]
    # The masters' order: the optimizer's parameters (decayed group, then the others).
    params = [p for group in get_param_groups(wrapper, 0.0) for p in group["params"]]
    tokens, labels = device_batch(4)
    wrapper(tokens, labels=labels).mean().backward()
    wrapper.finish_grad_sync()
    update_successful, _, _ = optimizer.step()
    result = dict(
        stepped=update_successful,
        grads_cleared=all(p.grad is None for p in [*params, *masters]),
        masters_fp32=all(m.dtype == torch.float32 for m in masters),
        model_is_rounded_masters=all(
            torch.equal(p, m.bfloat16()) for p, m in zip(params, masters, strict=True)
        ),
    )

    with torch.no_grad():
        for param, master in zip(params, masters):
            param.fill_(1.0)
            master.fill_(1.0)
    optimizer.load_state_dict({**optimizer.state_dict(), "state": {}})  # fresh Adam moments
    for _ in range(10):
        wrapper.zero_grad_buffer()
        optimizer.zero_grad()
        for param in params:
            param.main_grad.fill_(1.0)  # as the reduction would leave it
        optimizer.step()
    # The same 10 steps of fp32 AdamW on one weight.
    reference = torch.ones(1, requires_grad=True)
    adamw = torch.optim.AdamW([reference], lr=1e-3, weight_decay=0.0)
    for _ in range(10):
        reference.grad = torch.ones(1)
        adamw.step()
    result.update(
        masters=torch.stack([m.flatten()[0] for m in masters]),
        reference=reference.detach().expand(len(masters)).clone(),
        model=torch.stack([p.detach().flatten()[0].float() for p in params]),
    )
    restored = get_megatron_optimizer(optimizer_config, wrapper)  # masters: bf16 values
    restored.load_state_dict(optimizer.state_dict())
    result["restored_masters"] = torch.cat(
        [m.flatten() for m in restored.state_dict()["fp32_from_fp16_params"]]
    )
    result["saved_masters"] = torch.cat([m.flatten() for m in masters])
    return result


def test_ddp_keeps_fp32_master_weights_of_bf16_parameters():
    """Megatron's Float16OptimizerWithFloat16Params: updates too small for bf16 accumulate in
    the fp32 masters, which step like fp32 AdamW; the bf16 parameters are their rounded copies,
    and the masters round-trip through the state dict."""
    for result in run_distributed(_ddp_bf16_master_weights, 2):
        assert result["stepped"] and result["grads_cleared"] and result["masters_fp32"]
        assert result["model_is_rounded_masters"]
        torch.testing.assert_close(result["masters"], result["reference"])
        assert (result["reference"] < 0.995).all()
        # bf16 rounds 1 - 10 x 1e-3 to 1 - 3 x 2**-8; updates applied in bf16 would leave 1.0.
        torch.testing.assert_close(result["model"], result["reference"].bfloat16().float())
        assert (result["model"] < 1.0).all()
        torch.testing.assert_close(result["restored_masters"], result["saved_masters"])
