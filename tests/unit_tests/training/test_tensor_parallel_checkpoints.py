"""Checkpoints of tensor-parallel models hold global tensors: a checkpoint written at TP 2 x DP 2
(Megatron-FSDP) loads at TP 1 x DP 4 (DDP engine, distributed optimizer), then TP 4 x DP 1
(Megatron-FSDP, sharded optimizer) and back at TP 2 x DP 2 (DDP engine) with the same weights
and optimizer state, bit for bit, and each resumed step has the loss and weights of an
uninterrupted single-process run. Likewise a Mixture-of-Experts GPT whose experts are split by
expert tensor parallelism: saved at TP 2 x ETP 2 x EP 2 (Megatron-FSDP), it loads at TP 1 with
whole experts (DDP engine, distributed optimizer), then TP 1 x ETP 2 x EP 2 (Megatron-FSDP,
sharded optimizer) and TP 2 x ETP 2 x EP 1 (DDP engine). 4 gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.training.checkpoint_layout import CHECKPOINT_VERSION, CheckpointError
from megatron.training.checkpointing import _check_arguments, load_checkpoint, save_checkpoint
from tests.unit_tests.distributed.moe_training import Engine, RunResult, train_steps, wrap
from tests.unit_tests.distributed.test_gpt_tensor_parallel_engines import (
    build_gpt,
    gpt_batches,
    reference_gpt_run,
)
from tests.unit_tests.distributed.tp_training import (
    build,
    global_batches,
    optimizer_config,
    reference_run,
)
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.tools.hf_models import parse_flags
from tests.unit_tests.training.test_expert_checkpoints import (
    _args,
    _assert_equal,
    _scheduler,
    _snapshot,
)

WORLD = 4
STAGES = [
    (2, Engine("fsdp", "optim_grads_params")),
    (1, Engine("ddp", distributed_optimizer=True)),
    (4, Engine("fsdp", "optim")),
    (2, Engine("ddp")),
]


def _reshard_across_tp(root: str) -> None:
    batches = global_batches(len(STAGES))
    uninterrupted = reference_run(batches, "sgd")
    save = os.path.join(root, "save")
    saved, load_dir = None, None
    for step, (tp_size, engine) in enumerate(STAGES):
        model, optimizer, groups = build(tp_size, engine, "sgd")
        expected = reference_run(batches[: step + 1], "sgd").weights
        where = f"TP{tp_size} x DP{groups.dp_cp.size()} {engine}"
        saved, loss = _resume_one_step(
            root, step, (model, optimizer, groups), load_dir, saved, batches, expected, where
        )
        torch.testing.assert_close(
            torch.tensor(loss), torch.tensor(uninterrupted.losses[step : step + 1])
        )
        load_dir = save


def _resume_one_step(root, step, built, load_dir, saved, batches, expected, where):
    """Loads `load_dir` into the built (model, optimizer, groups) (if any, checking the global
    weights and optimizer state equal `saved` bit for bit), trains global batch `step`, saves,
    and checks the weights against `expected`; returns the new snapshot and the step's loss."""
    model, optimizer, groups = built
    scheduler = _scheduler(optimizer, optimizer.param_groups[0]["lr"])
    args = _args(root, load_dir)
    if load_dir is not None:
        assert load_checkpoint(model, optimizer, scheduler, args) == step
        _assert_equal(_snapshot(model, optimizer), saved)
    result = RunResult()
    dp = groups.dp_cp
    train_steps(model, optimizer, batches[step : step + 1], result, dp.rank(), dp.size(), dp)
    save_checkpoint(step + 1, model, optimizer, scheduler, args)
    saved = _snapshot(model, optimizer)
    for name, value in expected.items():
        torch.testing.assert_close(saved[f"model.{name}"], value, msg=f"{where} {name}")
    dist.barrier()
    return saved, result.losses


def test_checkpoint_reshards_across_tensor_parallel_sizes(tmp_path):
    run_distributed(_reshard_across_tp, WORLD, str(tmp_path))


EXPERT_STAGES = [  # (tp, ep, etp, engine)
    (2, 2, 2, Engine("fsdp", "optim_grads_params")),
    (1, 1, 1, Engine("ddp", distributed_optimizer=True)),
    (1, 2, 2, Engine("fsdp", "optim")),
    (2, 1, 2, Engine("ddp")),
]


def _expert_stage(root, step, stage, load_dir, saved, batches, losses, expected) -> dict:
    tp, ep, etp, engine = stage
    parallel_state.initialize_model_parallel(
        tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    try:
        groups = ProcessGroupCollection.use_mpu_process_groups()
        model = wrap(build_gpt(True, groups), engine, TransformerLayer, pg_collection=groups)
        optimizer = get_megatron_optimizer(optimizer_config("sgd"), model)
        built = (model, optimizer, groups)
        saved, loss = _resume_one_step(
            root, step, built, load_dir, saved, batches, expected, str(stage)
        )
        torch.testing.assert_close(loss, losses[step : step + 1])
        return saved
    finally:
        parallel_state.destroy_model_parallel()


def _reshard_across_expert_tp(root: str) -> None:
    batches = gpt_batches(WORLD, len(EXPERT_STAGES))
    # The single-process runs first: with parallel_state initialised the layers would take its
    # groups.
    losses = reference_gpt_run(True, batches).losses
    steps = range(len(EXPERT_STAGES))
    weights = [reference_gpt_run(True, batches[: step + 1]).weights for step in steps]
    saved, load_dir = None, None
    for step, stage in enumerate(EXPERT_STAGES):
        saved = _expert_stage(root, step, stage, load_dir, saved, batches, losses, weights[step])
        load_dir = os.path.join(root, "save")


def test_checkpoint_reshards_across_expert_tensor_parallel_sizes(tmp_path):
    run_distributed(_reshard_across_expert_tp, WORLD, str(tmp_path))


def test_a_vocabulary_padded_for_another_tensor_parallel_size_names_the_divisor():
    """The padding is a multiple of --make-vocab-size-divisible-by x TP: a checkpoint saved at
    TP 2 (GPT-2's 50257 ids padded to 50432) refused at TP 1 (50304) says which divisor pads
    to its size, and that divisor loads."""
    model = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 50257".split()
    saved = parse_flags([*model, "--tensor-model-parallel-size", "2"], 2)
    common = {"checkpoint_version": CHECKPOINT_VERSION, "args": vars(saved)}
    assert saved.padded_vocab_size == 50432
    here = parse_flags(model)
    with pytest.raises(CheckpointError, match="--make-vocab-size-divisible-by 50432 pads it"):
        _check_arguments(common, "ckpt", here)
    fixed = parse_flags([*model, "--make-vocab-size-divisible-by", "50432"])
    _check_arguments(common, "ckpt", fixed)
