"""FP8 in the multi-token prediction depths: every depth's linear layers run in FP8 (whatever
`first_last_layers_bf16` keeps in bf16, as Megatron-core), a tiny GPT with two depths trained in
FP8 equals its fake-quant twin bit for bit, the depths' delayed-scaling state is a state of its
own (its amaxes reduced once per pass over the ranks, saved and loaded with the model), and
full recompute changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.fp8.scaling import DelayedScalingState
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.fp8.reference import exact_cpu_scaled_mm
from tests.unit_tests.fp8.test_model import (
    BF16,
    FULL_RECOMPUTE,
    assert_recompute_changes_nothing,
    assert_trains_as_its_fake_quant_twin,
)
from tests.unit_tests.fp8.test_model import _train as train
from tests.unit_tests.models.fixtures import mtp_cases
from tests.unit_tests.models.test_multi_token_prediction import build

CASE = mtp_cases.CASES["rope_swiglu_untied_2_depths"]
"""Two depths, SwiGLU, grouped-query attention: every width a multiple of 16."""


def _mtp_fp8_gpt(recipe: str = "delayed", **overrides) -> GPTModel:
    fields = dict(fp8="hybrid", fp8_recipe=recipe)
    if recipe == "delayed":
        fields.update(fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    return build(CASE, CASE["seed"], **BF16, **{**fields, **overrides}).to(current_device())


def _batches(steps: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, CASE["vocab"], (steps, 3, CASE["seq"] + 1), generator=generator)
    return [(d[:, :-1].to(current_device()), d[:, 1:].to(current_device())) for d in data]


def _train(model: GPTModel, steps: int = 4) -> list[torch.Tensor]:
    """Steps of Adam on the loss with the depths' (labels given: the depths run)."""
    return train(model, steps, _batches(steps))


def _depth_linears(model: GPTModel) -> dict[str, torch.nn.Module]:
    return {
        name: module
        for name, module in model.mtp.named_modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear))
    }


def _depth_linears_in_fp8(model: GPTModel) -> list[torch.nn.Module]:
    """The depths' linear layers, each asserted to run in FP8: per depth `eh_proj` and the
    layer's qkv, proj, fc1 and fc2."""
    linears = _depth_linears(model)
    assert len(linears) == 2 * 5
    assert all(linear.fp8 is not None for linear in linears.values()), linears
    return list(linears.values())


def test_every_depth_linear_runs_in_fp8_with_a_state_of_its_own():
    model = _mtp_fp8_gpt()
    state = model.mtp.fp8_state
    assert isinstance(state, DelayedScalingState) and state is not model.decoder.fp8_state
    assert all(linear.fp8.state is state for linear in _depth_linears_in_fp8(model))


def test_the_depths_run_in_fp8_where_the_decoders_first_and_last_layers_do_not():
    """`first_last_layers_bf16` (tensorwise: delayed scaling refuses it, as upstream) keeps the
    decoder's first and last layers, here both, in bf16, and not the depths."""
    model = _mtp_fp8_gpt("tensorwise", first_last_layers_bf16=True)
    _depth_linears_in_fp8(model)
    assert all(m.fp8 is None for m in model.decoder.modules() if hasattr(m, "fp8"))


@exact_cpu_scaled_mm
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_mtp_gpt_equals_its_fake_quant_twin(recipe):
    """Losses (the depths' included in the gradients), weights and both delayed-scaling
    states, bit for bit."""
    fp8, twin = _mtp_fp8_gpt(recipe), _mtp_fp8_gpt(recipe)
    blocks = ("decoder", "mtp") if recipe == "delayed" else ()
    assert_trains_as_its_fake_quant_twin(fp8, twin, _train, blocks)
    for block in blocks:
        state = getattr(fp8, block).fp8_state.scaling_tensors()
        assert (state["scale_fwd"] != 1).all() and (state["scale_bwd"] != 1).all(), block


def test_the_depths_state_is_saved_and_loaded_with_the_model():
    trained = _mtp_fp8_gpt()
    _train(trained, steps=2)
    state_dict = trained.state_dict()
    assert "mtp.fp8_state._extra_state" in state_dict
    fresh = _mtp_fp8_gpt()
    fresh.load_state_dict(state_dict)
    for key, value in trained.mtp.fp8_state.scaling_tensors().items():
        assert torch.equal(value, fresh.mtp.fp8_state.scaling_tensors()[key]), key
    # The next step of both casts the same: the same loss and gradients.
    tokens, labels = _batches(1, seed=9)[0]
    for model in (trained, fresh):
        model(tokens, labels=labels).float().mean().backward()
    for (name, a), b in zip(trained.named_parameters(), fresh.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_full_recompute_gives_the_same_gradients_and_amax_histories():
    assert_recompute_changes_nothing(
        _mtp_fp8_gpt, FULL_RECOMPUTE, _train, _batches(1, seed=9)[0], ("decoder", "mtp")
    )


def _amax_reduction_run() -> tuple[dict[str, torch.Tensor], int]:
    """A forward and backward on this rank's own batch (no engine): the depths' state after
    them, and the all-reduces issued."""
    model = _mtp_fp8_gpt()
    tokens, labels = _batches(1, seed=dist.get_rank())[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(tokens, labels=labels).float().mean().backward()
    reduces = sum(event.name == "c10d::allreduce_" for event in profile.events())
    return model.mtp.fp8_state.scaling_tensors(), reduces


def test_the_depths_amaxes_are_reduced_over_ranks_once_per_pass():
    """Two ranks with different data: the depths' histories and scales agree, after one
    all-reduce per pass for the decoder's state and one for the depths'."""
    (state0, reduces0), (state1, reduces1) = run_distributed(_amax_reduction_run, 2)
    assert reduces0 == reduces1 == 4
    for key, value in state0.items():
        assert torch.equal(value, state1[key]), key
    assert (state0["scale_fwd"] != 1).all() and (state0["scale_bwd"] != 1).all()


def test_a_frozen_fp8_mtp_model_gives_a_loss_that_needs_no_gradient():
    model = _mtp_fp8_gpt()
    model.requires_grad_(False)
    tokens, labels = _batches(1)[0]
    assert not model(tokens, labels=labels).requires_grad
