"""`--dist-ckpt-strictness` on loading a checkpoint whose tensors differ from the model's (2 gloo
ranks, Megatron-FSDP ZeRO-3, whose weights are sharded DTensors): the raising values refuse and
name the fix, `log_all` loads the tensors both hold and logs the rest, `log_unexpected` logs only
the model's tensors the checkpoint lacks, `ignore_all` logs nothing; the tensors the checkpoint
lacks keep the model's values, and the optimizer state does not load across such a mismatch."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.checkpoint_strictness import StrictHandling
from megatron.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import build_tiny_gpt, tiny_gpt_config, wrap_for_engine
from tests.unit_tests.training.checkpoint_checks import whole_tensor
from tests.unit_tests.training.log_capture import capture_training_log


def _build(biases: bool, seed: int) -> tuple[Any, Any, OptimizerParamScheduler]:
    """A tiny GPT (with or without the linear layers' biases: the tensors that differ) under
    ZeRO-3, its Adam optimizer and a constant schedule."""
    model = build_tiny_gpt(tiny_gpt_config(add_bias_linear=biases), seed)
    wrapped = wrap_for_engine(model, "optim_grads_params")
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), wrapped)
    scheduler = OptimizerParamScheduler(
        optimizer, 0.0, 1e-3, 1e-3, 0, 10, "constant", 0.0, 0.0, 10, "constant"
    )
    return wrapped, optimizer, scheduler


def _args(root: str, strictness: str, **overrides: Any) -> argparse.Namespace:
    args = argparse.Namespace(
        save=root,
        load=root,
        ckpt_format="torch_dist",
        ckpt_step=None,
        finetune=False,
        pretrained_checkpoint=None,
        no_load_optim=True,
        no_load_rng=True,
        dist_ckpt_strictness=strictness,
    )
    vars(args).update(overrides)
    return args


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: whole_tensor(value).cpu() for name, value in model.state_dict().items()}


SIDES = ["model_has_more", "checkpoint_has_more"]
"""Which side holds the linear layers' biases the other lacks."""


def _load(root: str, saved_biases: bool, strictness: str, **overrides: Any) -> dict[str, Any]:
    parallel_state.initialize_model_parallel()
    try:
        saved = _build(saved_biases, seed=1)
        save_checkpoint(3, *saved, _args(root, strictness))
        loading = _build(not saved_biases, seed=2)
        before = _weights(loading[0])
        error = None
        with capture_training_log() as messages:
            try:
                args = _args(root, strictness, **overrides)
                iteration = load_checkpoint(*loading, args).iteration
            except CheckpointError as caught:
                error, iteration = str(caught), None
        return dict(
            error=error,
            iteration=iteration,
            saved=_weights(saved[0]),
            before=before,
            after=_weights(loading[0]),
            warnings=[m for m in messages if m.startswith("WARNING")],
            rank=dist.get_rank(),
        )
    finally:
        parallel_state.destroy_model_parallel()


def _run(root: str, saved_biases: bool, strictness: str, **overrides: Any) -> list[dict]:
    return run_distributed(_load, 2, root, saved_biases, strictness, **overrides)


def _linear_bias(name: str) -> bool:
    """The tensors `add_bias_linear` adds (the norms have biases either way)."""
    return name.endswith(".bias") and "layernorm" not in name


@pytest.mark.parametrize(
    "saved_biases", [False, True], ids=["model_has_more", "checkpoint_has_more"]
)
@pytest.mark.parametrize("strictness", ["log_all", "log_unexpected", "ignore_all"])
def test_tolerant_strictness_loads_the_tensors_both_hold(tmp_path, strictness, saved_biases):
    results = _run(str(tmp_path), saved_biases, strictness)
    handling = StrictHandling(strictness)
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["iteration"] == 3
        shared = result["saved"].keys() & result["after"].keys()
        only_model = result["after"].keys() - result["saved"].keys()
        only_saved = result["saved"].keys() - result["after"].keys()
        assert shared and bool(only_model) != saved_biases and bool(only_saved) == saved_biases
        assert all(_linear_bias(name) for name in only_model | only_saved)
        for name in shared:
            assert torch.equal(result["after"][name], result["saved"][name]), name
        assert any(not torch.equal(result["before"][n], result["saved"][n]) for n in shared)
        for name in only_model:  # not in the checkpoint: the model's own values
            assert torch.equal(result["after"][name], result["before"][name]), name
        # What is logged: the model's tensors the checkpoint lacks (log_*), the checkpoint's
        # the model lacks (log_all only); on rank 0, once.
        logged = result["warnings"]
        if result["rank"] != 0:
            assert logged == []
            continue
        action = handling.checkpoint_only if saved_biases else handling.model_only
        if action.value == "log":
            (line,) = logged
            which = "not in this model" if saved_biases else "missing from it"
            assert which in line and f"--dist-ckpt-strictness {strictness}" in line
            assert "decoder.layers.0.mlp.linear_fc1.bias" in line
        else:
            assert logged == []


@pytest.mark.parametrize("strictness", ["assume_ok_unexpected", "raise_unexpected", "raise_all"])
@pytest.mark.parametrize(
    "saved_biases", [False, True], ids=["model_has_more", "checkpoint_has_more"]
)
def test_raising_strictness_refuses_and_names_log_all(tmp_path, strictness, saved_biases):
    for result in _run(str(tmp_path), saved_biases, strictness):
        which = "not in this model" if saved_biases else "missing from it"
        assert which in result["error"]
        assert "--dist-ckpt-strictness log_all" in result["error"]
        assert all(torch.equal(result["after"][n], t) for n, t in result["before"].items())


def test_optimizer_state_does_not_load_across_a_mismatch(tmp_path):
    for result in _run(str(tmp_path), True, "log_all", no_load_optim=False):
        assert "pass --no-load-optim (or --finetune)" in result["error"]
        assert all(torch.equal(result["after"][n], t) for n, t in result["before"].items())
