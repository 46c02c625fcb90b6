"""Checkpoints of MoE models hold global experts: a checkpoint written at EP=4 (Megatron-FSDP)
loads at EP=2 (DDP engine, distributed optimizer) and then EP=1 (DDP engine) with the same
weights and optimizer state, bit for bit, and training goes on as on one process; a model with
another number of experts is refused. 4 gloo ranks."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.checkpoint_layout import CheckpointError
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.distributed.moe_training import (
    Engine,
    RunResult,
    default_builder,
    global_batches,
    global_state,
    global_tensor,
    init_groups,
    optimizer_config,
    reference_run,
    train_steps,
    wrap,
)
from tests.unit_tests.distributed_harness import run_distributed

WORLD = 4
MOMENTUM = 0.9


def _args(root: str, load: str | None = None, num_experts: int = 4) -> argparse.Namespace:
    return argparse.Namespace(
        num_experts=num_experts,
        save=os.path.join(root, "save"),
        load=load,
        ckpt_format="torch_dist",
        pretrained_checkpoint=None,
        finetune=False,
        ckpt_step=None,
        no_load_optim=False,
        no_load_rng=False,
        dist_ckpt_strictness="assume_ok_unexpected",
    )


def _scheduler(optimizer, lr: float = 0.1) -> OptimizerParamScheduler:
    """A constant learning rate `lr`."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=lr,
        max_lr=lr,
        min_lr=lr,
        lr_warmup_steps=0,
        lr_decay_steps=10,
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )


def _build(ep: int, engine: Engine, num_experts: int = 4):
    init_groups(ep)
    module = default_builder(parallel_state.get_expert_model_parallel_group(), num_experts)
    model = wrap(module, engine)
    optimizer = get_megatron_optimizer(optimizer_config(MOMENTUM), model)
    return model, optimizer, _scheduler(optimizer)


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """Global weights and optimizer states by name."""
    state = {f"model.{k}": v for k, v in global_state(model.state_dict()).items()}
    for name, values in optimizer.sharded_state_dict()["state"].items():
        for key, value in values.items():
            state[f"optimizer.{name}.{key}"] = global_tensor(value)
    return state


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=name)


def _stage(root, ep, engine, save_iteration, load_dir, batches, expected_after):
    """Builds the model at `ep` under `engine`, loads `load_dir` (if any, checking it equals
    `expected_after` of the previous stage), trains on `batches`, saves `save_iteration`."""
    model, optimizer, scheduler = _build(ep, engine)
    args = _args(root, load_dir)
    if load_dir is not None:
        loaded = load_checkpoint(model, optimizer, scheduler, args)
        assert loaded.iteration == save_iteration - len(batches)
        _assert_equal(_snapshot(model, optimizer), expected_after)
    result = RunResult()
    train_steps(model, optimizer, batches, result, dist.get_rank(), WORLD)
    save_checkpoint(save_iteration, model, optimizer, scheduler, args)
    snapshot = _snapshot(model, optimizer)
    weights = {k[len("model.") :]: v for k, v in snapshot.items() if k.startswith("model.")}
    parallel_state.destroy_model_parallel()
    return snapshot, weights


def _reshard_4_2_1(root: str) -> None:
    batches = global_batches(WORLD, steps=4)
    reference = [reference_run(default_builder, batches[:n], MOMENTUM) for n in (2, 3, 4)]
    save = os.path.join(root, "save")
    stages = [
        (4, Engine("fsdp", "optim_grads_params"), batches[0:2]),
        (2, Engine("ddp", distributed_optimizer=True), batches[2:3]),
        (1, Engine("ddp"), batches[3:4]),
    ]
    snapshot, load_dir, iteration = None, None, 0
    for (ep, engine, steps), expected in zip(stages, reference):
        iteration += len(steps)
        snapshot, weights = _stage(root, ep, engine, iteration, load_dir, steps, snapshot)
        for name, value in expected.weights.items():
            torch.testing.assert_close(weights[name], value, msg=f"EP={ep} {name}")
        load_dir = save
    # A model with another number of experts is refused before anything loads: by the flag
    # the checkpoint recorded, and by the tensors' shapes where the flags agree.
    model, optimizer, scheduler = _build(1, Engine("ddp"), num_experts=8)
    before = global_state(model.state_dict())
    with pytest.raises(CheckpointError, match=r"--num-experts 4 \(here 8\)"):
        load_checkpoint(model, optimizer, scheduler, _args(root, save, num_experts=8))
    with pytest.raises(CheckpointError, match="MoE layers have 4 experts, this model 8"):
        load_checkpoint(model, optimizer, scheduler, _args(root, save))
    _assert_equal(global_state(model.state_dict()), before)


def test_checkpoint_reshards_experts_across_ep_sizes_and_engines(tmp_path):
    run_distributed(_reshard_4_2_1, WORLD, str(tmp_path))
