"""Loss scaling: Megatron-LM's dynamic rule against a hand-written sequence, the constant scaler,
their state, and `MegatronOptimizer` unscaling, skipping and checkpointing with them."""

from __future__ import annotations

import pytest
import torch

from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
from megatron.core.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    get_grad_scaler,
    unscale_and_check_for_inf,
)

# Overflow pattern and the scale after each step, worked out by hand from Megatron-LM's rule
# (initial 16, min 2, growth x2 after 3 clean steps, backoff x0.5, hysteresis 2):
# 3 clean steps grow to 32; the 1st overflow spends hysteresis (32 kept), the 2nd halves;
# from then on every overflow halves (clean steps do not restore hysteresis) down to the
# floor 2; 3 clean steps grow to 4 and restore hysteresis, so the next overflow keeps 4.
OVERFLOWS = [0, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 1, 1]
SCALES = [16, 16, 32, 32, 32, 16, 8, 8, 4, 2, 2, 2, 2, 4, 4, 2]


def _dynamic(**overrides) -> DynamicGradScaler:
    fields = dict(
        initial_scale=16.0,
        min_scale=2.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=3,
        hysteresis=2,
    )
    fields.update(overrides)
    return DynamicGradScaler(**fields)


def test_dynamic_scale_follows_the_reference_sequence():
    scaler = _dynamic()
    scales = []
    for found_inf in OVERFLOWS:
        scaler.update(bool(found_inf))
        scales.append(scaler.scale)
    assert scales == SCALES


def test_hysteresis_one_halves_at_every_overflow():
    scaler = _dynamic(hysteresis=1, min_scale=1.0)
    for expected in (8, 4, 2, 1, 1):
        scaler.update(True)
        assert scaler.scale == expected


def test_dynamic_state_round_trips_mid_sequence():
    """A scaler restored from the state after step 8 continues exactly as the original."""
    scaler = _dynamic()
    for found_inf in OVERFLOWS[:8]:
        scaler.update(bool(found_inf))
    restored = _dynamic(initial_scale=1024.0)
    restored.load_state_dict(scaler.state_dict())
    scales = []
    for found_inf in OVERFLOWS[8:]:
        restored.update(bool(found_inf))
        scales.append(restored.scale)
    assert scales == SCALES[8:]


def test_constant_scaler_never_changes():
    scaler = ConstantGradScaler(128.0)
    for found_inf in OVERFLOWS:
        scaler.update(bool(found_inf))
    assert scaler.scale == 128.0 and scaler.inv_scale == 1 / 128.0
    assert scaler.state_dict() == {}


@pytest.mark.parametrize(
    "overrides, name",
    [
        (dict(min_scale=32.0), "min_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(initial_scale=0.0), "initial loss scale"),
    ],
)
def test_bad_scaler_settings_are_refused(overrides, name):
    with pytest.raises(ValueError, match=name):
        _dynamic(**overrides)


def test_get_grad_scaler_follows_megatron():
    assert get_grad_scaler(OptimizerConfig(lr=1.0)) is None
    assert get_grad_scaler(OptimizerConfig(lr=1.0, bf16=True)) is None
    constant = get_grad_scaler(OptimizerConfig(lr=1.0, bf16=True, loss_scale=8.0))
    assert isinstance(constant, ConstantGradScaler) and constant.scale == 8.0
    dynamic = get_grad_scaler(
        OptimizerConfig(lr=1.0, fp16=True, initial_loss_scale=64.0, hysteresis=1)
    )
    assert isinstance(dynamic, DynamicGradScaler) and dynamic.scale == 64.0
    assert (dynamic.growth_factor, dynamic.backoff_factor) == (2.0, 0.5)
    assert dynamic.growth_interval == 1000 and dynamic.hysteresis == 1


def test_unscale_detects_inf_and_nan():
    grads = [torch.tensor([4.0, 8.0]), torch.tensor([2.0])]
    assert not unscale_and_check_for_inf(grads, 0.25, torch.device("cpu"))
    torch.testing.assert_close(grads[0], torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(grads[1], torch.tensor([0.5]))
    assert unscale_and_check_for_inf([torch.tensor([float("nan")])], 1.0, torch.device("cpu"))
    assert unscale_and_check_for_inf(
        [torch.ones(2), torch.tensor([float("inf")])], 1.0, torch.device("cpu")
    )


def _fp16_optimizer(initial_scale: float, hysteresis: int = 1):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).half()
    config = OptimizerConfig(
        optimizer="sgd",
        lr=0.5,
        sgd_momentum=0.0,
        weight_decay=0.0,
        clip_grad=0.0,
        fp16=True,
        initial_loss_scale=initial_scale,
        hysteresis=hysteresis,
    )
    torch_optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.0)
    return model, MegatronOptimizer(torch_optimizer, config, model, get_grad_scaler(config))


def test_optimizer_scales_the_loss_unscales_and_steps_like_fp32_sgd():
    """The gradients of the scaled loss, divided by the scale in fp32, step the fp32 masters as
    fp32 SGD on the unscaled loss; the fp16 weights are their rounded copies."""
    model, optimizer = _fp16_optimizer(initial_scale=1024.0)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    inputs = torch.randn(5, 4)
    loss = model(inputs.half()).float().square().mean()
    assert optimizer.get_loss_scale() == 1024.0
    optimizer.scale_loss(loss).backward()
    stepped, grad_norm, _ = optimizer.step()
    reference(inputs).square().mean().backward()
    expected_norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm()
    with torch.no_grad():
        for param in reference.parameters():
            param -= 0.5 * param.grad
    assert stepped
    torch.testing.assert_close(torch.tensor(grad_norm), expected_norm, rtol=1e-2, atol=0)
    masters = optimizer.state_dict()["fp32_from_fp16_params"]
    for master, expected in zip(masters, reference.parameters(), strict=True):
        torch.testing.assert_close(master, expected.detach(), rtol=1e-2, atol=1e-3)
    for param, master in zip(model.parameters(), masters, strict=True):
        assert param.dtype == torch.float16 and torch.equal(param, master.half())


def test_overflow_skips_the_step_and_lowers_the_scale():
    model, optimizer = _fp16_optimizer(initial_scale=2.0**20, hysteresis=1)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randn(5, 4).half() * 100).float().square().mean()
    optimizer.scale_loss(loss).backward()  # 2**20 x the gradients overflows fp16
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert optimizer.step() == (False, None, None)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert optimizer.get_loss_scale() == 2.0**19


def test_scaler_state_round_trips_through_the_optimizer_state_dict():
    _, optimizer = _fp16_optimizer(initial_scale=64.0, hysteresis=3)
    for found_inf in (True, False, True):
        optimizer.grad_scaler.update(found_inf)
    state = optimizer.state_dict()
    _, restored = _fp16_optimizer(initial_scale=2.0**30, hysteresis=3)
    restored.load_state_dict(state)
    assert restored.grad_scaler.state_dict().keys() == {
        "scale",
        "growth_tracker",
        "hysteresis_tracker",
    }
    for key, value in optimizer.grad_scaler.state_dict().items():
        assert torch.equal(restored.grad_scaler.state_dict()[key], value)
    # Hysteresis 3 spent by two overflows: the third halves the scale in both.
    optimizer.grad_scaler.update(True)
    restored.grad_scaler.update(True)
    assert restored.get_loss_scale() == optimizer.get_loss_scale() == 32.0
