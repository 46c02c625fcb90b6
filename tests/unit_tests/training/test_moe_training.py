"""The training loop's MoE steps: the auxiliary losses' gradient scale, the expert-bias update
after every step (seen in a checkpoint of a 2-rank run with expert parallelism), and the
process-wide MoE state reset when the run ends."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.training.train_step import _set_auxiliary_loss_scale
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.checkpoint_checks import RUN, main, read_whole_checkpoint


class _Optimizer:
    """A loss scale of 8 (fp16's grad scaler would hold it)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * 8.0


@pytest.fixture
def default_aux_loss_scale():
    """Restores the process-wide scale the test sets (1: the default)."""
    yield
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(()))


@pytest.mark.usefixtures("default_aux_loss_scale")
@pytest.mark.parametrize(
    ("per_token", "cp", "scale"), [(False, 1, 8.0 / 4), (True, 1, 8.0), (False, 2, 8.0 * 2 / 4)]
)
def test_aux_loss_gradient_is_the_loss_scale_over_the_microbatches(per_token, cp, scale):
    """4 microbatches: the main loss is divided by them (unless it is a sum over tokens), and
    so is the gradient the auxiliary losses get; under context parallelism both are multiplied
    by the cp size (the engines average the cp ranks' shares)."""
    args = argparse.Namespace(calculate_per_token_loss=per_token, context_parallel_size=cp)
    _set_auxiliary_loss_scale(_Optimizer(), 4, args)
    assert _aux_loss_gradient() == scale


ITERATIONS = 3
RATE = 0.25


def test_expert_bias_moves_by_the_rate_each_step(tmp_path):
    """Each step moves every expert's bias by -rate, 0 or +rate (by the sign of its token count
    against the mean, over both ranks), so after 3 steps it is a multiple of the rate of at most
    3; and it has moved."""
    flags = [
        *RUN,
        *f"--train-iters {ITERATIONS} --eval-interval 1000 --save {tmp_path}".split(),
        *"--num-experts 4 --expert-model-parallel-size 2 --moe-router-topk 2".split(),
        *"--moe-router-score-function sigmoid --moe-router-enable-expert-bias".split(),
        *f"--moe-router-bias-update-rate {RATE} --moe-token-dispatcher-type alltoall".split(),
    ]
    for aux_loss_gradient, metrics in run_distributed(_train_then_probe, 2, flags):
        # The run leaves no MoE state behind for the next job in the process.
        assert (aux_loss_gradient, metrics) == (1.0, {})
    state = read_whole_checkpoint(str(tmp_path / f"iter_{ITERATIONS:07d}"), str(tmp_path))
    biases = {key: value for key, value in _flatten(state).items() if key.endswith("expert_bias")}
    assert len(biases) == 2  # one router per layer
    for key, bias in biases.items():
        steps = bias / RATE  # each step adds -1, 0 or +1 rate per expert
        assert torch.equal(steps, steps.round()), key
        assert steps.abs().max() <= ITERATIONS and steps.abs().sum() > 0, (key, bias)


def _aux_loss_gradient() -> float:
    aux_loss = torch.tensor(3.0, requires_grad=True)
    MoEAuxLossAutoScaler.apply(torch.zeros(2, requires_grad=True), aux_loss).sum().backward()
    return aux_loss.grad.item()


def _train_then_probe(flags: list[str]) -> tuple[float, dict]:
    """Trains; then the gradient an auxiliary loss gets, and the tracker's metrics."""
    main(flags)
    return _aux_loss_gradient(), get_moe_metrics_tracker().metrics


def _flatten(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[f"{prefix}{key}"] = value
    return flat
