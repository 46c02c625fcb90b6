"""`MegatronOptimizer.step_on_device`, the step a CUDA graph captures, run eagerly on CPU: it
equals the usual optimizer's `step()` on the same gradients (norm, clipping, update, zero
count) for Adam and SGD, skips a step with a non-finite gradient leaving weights and optimizer
state unchanged, reads the scheduler's learning rates from device tensors (rounded to fp32),
and does so under every engine; and what it refuses."""

from __future__ import annotations

import copy
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import (
    MegatronOptimizer,
    OptimizerConfig,
    clip_grads,
    get_megatron_optimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from tests.unit_tests.distributed.fsdp.fsdp_training import full_state
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
    wrap_for_engine,
)

LR = 2.0**-7
"""Exact in fp32: the device step reads the rate as fp32, the host step as float64."""
CLIP_ACTIVE = 0.05
NUM_STEPS = 3


def _pair(
    name: str, clip_grad: float
) -> tuple[tuple[torch.nn.Module, MegatronOptimizer], tuple[torch.nn.Module, MegatronOptimizer]]:
    """Two identical models, one with the optimizer a run without graphs builds (for `step()`),
    one with the capturable one (for `step_on_device()`)."""
    config = OptimizerConfig(
        optimizer=name, lr=LR, weight_decay=0.1, clip_grad=clip_grad, log_num_zeros_in_grad=True
    )
    host_model, device_model = build_tiny_gpt(), build_tiny_gpt()
    return (
        (host_model, get_megatron_optimizer(config, host_model)),
        (device_model, get_megatron_optimizer(config, device_model, capturable=True)),
    )


def _set_grads(model: torch.nn.Module, step: int, non_finite: bool) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator).to(param.device)
        param.grad[param.grad.abs() < 0.1] = 0.0  # some zeros to count
    if non_finite:
        next(model.parameters()).grad.view(-1)[0] = float("nan")


def _optimizer_state(optimizer: MegatronOptimizer) -> list[dict[str, torch.Tensor]]:
    return copy.deepcopy(list(optimizer.state_dict()["state"].values()))


def _assert_states_equal(actual: list[dict], expected: list[dict]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("clip_grad", [0.0, CLIP_ACTIVE, 1e3], ids=["no-clip", "clip", "wide"])
@pytest.mark.parametrize("non_finite_step", [None, 0, 1], ids=["finite", "nan-first", "nan"])
def test_device_step_equals_the_host_step(name, clip_grad, non_finite_step):
    (host_model, host), (device_model, device) = _pair(name, clip_grad)
    for step in range(NUM_STEPS):
        non_finite = step == non_finite_step
        _set_grads(host_model, step, non_finite)
        _set_grads(device_model, step, non_finite)
        weights_before = full_state(device_model)
        state_before = _optimizer_state(device)
        updated, grad_norm, num_zeros = host.step()
        device.write_learning_rates_to_device()
        result = device.step_on_device()
        assert result.found_inf.item() == float(not updated)
        assert updated == (not non_finite)
        if non_finite:
            assert math.isnan(result.grad_norm.item()) and math.isnan(grad_norm)
            # Skipped: weights unchanged, and the optimizer state too (for a skipped first
            # step, none was made but SGD's zero buffers, which the next step tests).
            for key, value in full_state(device_model).items():
                assert torch.equal(value, weights_before[key]), key
            if state_before:
                _assert_states_equal(_optimizer_state(device), state_before)
        else:
            assert result.grad_norm.item() == grad_norm  # bitwise: the same float64
            if clip_grad == CLIP_ACTIVE:
                assert grad_norm > clip_grad  # the clipping acted
        assert result.num_zeros.item() == num_zeros
        assert all(isinstance(group["lr"], float) for group in device.param_groups)
        host_weights = full_state(host_model)
        for key, value in full_state(device_model).items():
            assert torch.equal(value, host_weights[key]), key
    _assert_states_equal(_optimizer_state(device), _optimizer_state(host))


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [False, True], ids=["step", "step_on_device"])
def test_clipping_runs_in_the_fused_step(on_device):
    """On a GPU the clipping coefficient goes to the fused step's kernel, which multiplies the
    gradients as it reads them: after the first step (torch's, which makes the moments) nothing
    scales them in place, and the weights equal, bitwise, those of steps without clipping over
    gradients multiplied by the coefficient in place."""
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.1, clip_grad=CLIP_ACTIVE)
    unclipped = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.1, clip_grad=0.0)
    model, reference_model = build_tiny_gpt().cuda(), build_tiny_gpt().cuda()
    optimizer = get_megatron_optimizer(config, model, capturable=on_device)
    reference = get_megatron_optimizer(unclipped, reference_model, capturable=on_device)
    in_place = "_scale_on_device" if on_device else "_scale"
    with mock.patch.object(clip_grads, in_place, wraps=getattr(clip_grads, in_place)) as scale:
        for step in range(NUM_STEPS):
            _set_grads(model, step, non_finite=False)
            _set_grads(reference_model, step, non_finite=False)
            if on_device:
                optimizer.write_learning_rates_to_device()
                reference.write_learning_rates_to_device()
                grad_norm = optimizer.step_on_device().grad_norm.item()
            else:
                grad_norm = optimizer.step()[1]
            assert scale.call_count == 1  # the first step's, in torch's step
            coefficient = CLIP_ACTIVE / (grad_norm + 1.0e-6)
            assert coefficient < 1.0
            grads = [param.grad for param in reference_model.parameters()]
            torch._foreach_mul_(grads, coefficient)
            reference.step_on_device() if on_device else reference.step()
            reference_weights = full_state(reference_model)
            for key, value in full_state(model).items():
                assert torch.equal(value, reference_weights[key]), (step, key)


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [False, True], ids=["step", "step_on_device"])
def test_clipped_fused_step_matches_torch_clip_and_adamw(on_device):
    """The reference a user compares with: `torch.nn.utils.clip_grad_norm_` and then torch's
    fused AdamW, with the same parameter groups. The fused kernel's update agrees with torch's
    to fp32 rounding (its norm sums the squares in another order than torch's)."""
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.1, clip_grad=CLIP_ACTIVE)
    model, reference_model = build_tiny_gpt().cuda(), build_tiny_gpt().cuda()
    optimizer = get_megatron_optimizer(config, model, capturable=on_device)
    index = {id(param): i for i, param in enumerate(model.parameters())}
    reference_params = list(reference_model.parameters())
    groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [reference_params[index[id(param)]] for param in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    reference = type(optimizer.optimizer)(groups)
    for step in range(NUM_STEPS):
        _set_grads(model, step, non_finite=False)
        _set_grads(reference_model, step, non_finite=False)
        if on_device:
            optimizer.write_learning_rates_to_device()
            grad_norm = optimizer.step_on_device().grad_norm.item()
        else:
            grad_norm = optimizer.step()[1]
        reference_norm = torch.nn.utils.clip_grad_norm_(reference_params, CLIP_ACTIVE)
        assert grad_norm > CLIP_ACTIVE  # the clipping acted
        assert grad_norm == pytest.approx(reference_norm.item(), rel=1e-6)
        reference.step()
        reference_weights = full_state(reference_model)
        for key, value in full_state(model).items():
            torch.testing.assert_close(value, reference_weights[key], msg=f"{step} {key}")


def test_learning_rates_come_from_the_scheduler_rounded_to_fp32():
    """Several parameter groups (decoupled rate), rates of a warmup that fp32 cannot represent:
    the device step equals the host step at the fp32-rounded rates, and leaves the scheduler's
    numbers in the groups."""
    config = OptimizerConfig(lr=1e-3, decoupled_lr=3e-3, weight_decay=0.1, clip_grad=0.0)
    host_model, device_model = build_tiny_gpt(), build_tiny_gpt()
    host = get_megatron_optimizer(config, host_model)
    device = get_megatron_optimizer(config, device_model, capturable=True)
    scheduler = OptimizerParamScheduler(
        device, 0.0, 1e-3, 0.0, 3, 10, "cosine", 0.1, 0.1, 10, "constant"
    )
    assert len(device.param_groups) > 2
    for step in range(NUM_STEPS):
        scheduler.step(1)
        rates = [group["lr"] for group in device.param_groups]
        assert any(float(torch.tensor(rate, dtype=torch.float32)) != rate for rate in rates)
        for group, rate in zip(host.param_groups, rates):
            group["lr"] = float(torch.tensor(rate, dtype=torch.float32))
        _set_grads(host_model, step, False)
        _set_grads(device_model, step, False)
        host.step()
        device.write_learning_rates_to_device()
        device.step_on_device()
        assert [group["lr"] for group in device.param_groups] == rates
        host_weights = full_state(host_model)
        for key, value in full_state(device_model).items():
            assert torch.equal(value, host_weights[key]), key


@pytest.mark.parametrize("non_finite_step", [None, 1], ids=["finite", "nan"])
def test_step_without_host_sync_equals_the_host_step(non_finite_step):
    """The eager loop's step (`step_without_host_sync`, read later) on the optimizer built
    without `capturable`: the scheduler's rates as they are (fp32 cannot represent them), no
    device rates written, and the same norms, skips, zero counts, weights and state as `step()`,
    bitwise."""
    config = OptimizerConfig(
        lr=1e-3, weight_decay=0.1, clip_grad=CLIP_ACTIVE, log_num_zeros_in_grad=True
    )
    host_model, device_model = build_tiny_gpt(), build_tiny_gpt()
    host = get_megatron_optimizer(config, host_model)
    device = get_megatron_optimizer(config, device_model)
    for step in range(NUM_STEPS):
        non_finite = step == non_finite_step
        _set_grads(host_model, step, non_finite)
        _set_grads(device_model, step, non_finite)
        updated, grad_norm, num_zeros = host.step()
        result = device.step_without_host_sync()
        assert result.found_inf.item() == float(not updated)
        norms = (result.grad_norm.item(), grad_norm)
        assert norms[0] == norms[1] or (non_finite and all(map(math.isnan, norms)))
        assert result.num_zeros.item() == num_zeros
        host_weights = full_state(host_model)
        for key, value in full_state(device_model).items():
            assert torch.equal(value, host_weights[key]), key
    _assert_states_equal(_optimizer_state(device), _optimizer_state(host))


def test_steps_without_host_sync_where_the_step_can_skip_on_the_device():
    """A first step of an optimizer that keeps state (a skipped one would make state `step()`
    does not), fp16's loss scaler and torch's unfused SGD need the host: their steps are read
    at once, and `step_without_host_sync` says why it cannot take the last two. Fused SGD
    without momentum keeps no state: its first step may skip on the device too."""
    model = build_tiny_gpt()
    adam = get_megatron_optimizer(OptimizerConfig(lr=LR), model)
    assert not adam.steps_without_host_sync
    _set_grads(model, 0, False)
    adam.step()
    assert adam.steps_without_host_sync
    sgd_configs = [OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=m) for m in (0.0, 0.9)]
    plain, with_momentum = (get_megatron_optimizer(c, model, True) for c in sgd_configs)
    assert plain.steps_without_host_sync and not with_momentum.steps_without_host_sync
    _set_grads(model, 1, False)
    with_momentum.step()
    assert with_momentum.steps_without_host_sync
    sgd = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=LR), model)
    scaled = get_megatron_optimizer(OptimizerConfig(lr=LR, fp16=True), model)
    assert not sgd.steps_without_host_sync and not scaled.steps_without_host_sync
    with pytest.raises(ValueError, match="fused=True"):
        sgd.step_without_host_sync()
    with pytest.raises(ValueError, match="loss scaler decides on the host"):
        scaled.step_without_host_sync()


def test_capturable_construction_picks_fused_kernels():
    model = build_tiny_gpt()
    adam = get_megatron_optimizer(OptimizerConfig(lr=LR), model, capturable=True).optimizer
    assert all(g["fused"] and g["capturable"] for g in adam.param_groups)
    sgd_config = OptimizerConfig(optimizer="sgd", lr=LR)
    sgd = get_megatron_optimizer(sgd_config, model, capturable=True).optimizer
    assert all(g["fused"] for g in sgd.param_groups)
    # Without it, the defaults are untouched: SGD's foreach/single-tensor kernels.
    assert not get_megatron_optimizer(sgd_config, model).optimizer.param_groups[0]["fused"]


def test_step_on_device_refuses_what_needs_the_host():
    model = build_tiny_gpt()
    _set_grads(model, 0, False)
    scaled = get_megatron_optimizer(OptimizerConfig(lr=LR, fp16=True), model, capturable=True)
    with pytest.raises(ValueError, match="loss scaler decides on the host"):
        scaled.step_on_device()
    capturable = get_megatron_optimizer(OptimizerConfig(lr=LR), model, capturable=True)
    with pytest.raises(RuntimeError, match="call write_learning_rates_to_device"):
        capturable.step_on_device()
    eager_adam = get_megatron_optimizer(OptimizerConfig(lr=LR), model)
    eager_adam.write_learning_rates_to_device()
    with pytest.raises(ValueError, match="capturable=False"):
        eager_adam.step_on_device()
    eager_sgd = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=LR), model)
    eager_sgd.write_learning_rates_to_device()
    with pytest.raises(ValueError, match="fused=True"):
        eager_sgd.step_on_device()
    # A group changed after construction (the optimizer's param_groups are the user's to edit).
    sgd_config = OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.9)
    damped = get_megatron_optimizer(sgd_config, model, capturable=True)
    damped.optimizer.param_groups[0]["dampening"] = 0.5
    damped.write_learning_rates_to_device()
    with pytest.raises(ValueError, match="dampening 0.5"):
        damped.step_on_device()


NON_FINITE_STEP = 1


def _engine_steps(engine: str, bf16: bool) -> dict:
    """Three steps of Megatron's loop with the usual optimizer's `step()` and, on a second
    model, the capturable one's `step_on_device()` (the second step's loss made nan); this
    rank's results and the compute weights."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = OptimizerConfig(
        lr=LR, weight_decay=0.1, clip_grad=CLIP_ACTIVE, log_num_zeros_in_grad=True
    )
    runs = {}
    for on_device in (False, True):
        fields = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}
        model = build_tiny_gpt(tiny_gpt_config(**fields))
        if engine == "distributed_optimizer":
            ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
            wrapper = DistributedDataParallel(model.config, ddp_config, model)
        else:
            wrapper = wrap_for_engine(model, engine)
        optimizer = get_megatron_optimizer(config, wrapper, capturable=on_device)
        results = []
        for step, (tokens, labels) in enumerate(make_token_batches(NUM_STEPS, 8)):
            wrapper.zero_grad_buffer()
            optimizer.zero_grad()
            tokens, labels = (
                shard_batch(tokens, rank, world_size),
                shard_batch(labels, rank, world_size),
            )
            loss = wrapper(tokens, labels=labels).float().mean()
            (loss * float("nan") if step == NON_FINITE_STEP else loss).backward()
            wrapper.finish_grad_sync()
            if on_device:
                optimizer.write_learning_rates_to_device()
                result = optimizer.step_on_device()
                outcome = (result.found_inf.item() == 0.0, result.grad_norm.item())
                results.append((*outcome, result.num_zeros.item()))
            else:
                results.append(optimizer.step())
            wrapper.start_param_sync()
        runs[on_device] = dict(results=results, state=full_state(model))
    return runs


@pytest.mark.parametrize(
    "engine, bf16",
    [
        ("optim_grads_params", True),
        ("optim_grads", False),
        ("ddp", True),
        ("distributed_optimizer", False),
    ],
)
def test_device_step_equals_the_host_step_under_every_engine(engine, bf16):
    """Megatron-FSDP (ZeRO-3 with bf16 gradients, whose clipping rounds once as the host's
    does; ZeRO-2), the DDP engine (bf16 parameters with fp32 masters) and its distributed
    optimizer: the same norms, skips, zero counts and weights, bitwise."""
    for rank in run_distributed(_engine_steps, 2, engine, bf16):
        host, device = rank[False], rank[True]
        for (updated, norm, zeros), (stepped, device_norm, device_zeros) in zip(
            host["results"], device["results"]
        ):
            assert updated == stepped and zeros == device_zeros
            assert norm == device_norm or (math.isnan(norm) and math.isnan(device_norm))
        assert [r[0] for r in host["results"]] == [i != NON_FINITE_STEP for i in range(3)]
        assert host["results"][0][1] > CLIP_ACTIVE
        for key, value in device["state"].items():
            assert torch.equal(value, host["state"][key]), key
