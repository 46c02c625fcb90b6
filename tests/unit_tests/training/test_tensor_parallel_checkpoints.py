"""Checkpoints of tensor-parallel models hold global tensors: a checkpoint written at TP 2 x DP 2
(Megatron-FSDP) loads at TP 1 x DP 4 (DDP engine, distributed optimizer), then TP 4 x DP 1
(Megatron-FSDP, sharded optimizer) and back at TP 2 x DP 2 (DDP engine) with the same weights
and optimizer state, bit for bit, and each resumed step has the loss and weights of an
uninterrupted single-process run. Likewise a Mixture-of-Experts GPT whose experts are split by
expert tensor parallelism: saved at TP 2 x ETP 2 x EP 2 (Megatron-FSDP), it loads at TP 1 with
whole experts (DDP engine, distributed optimizer), then TP 1 x ETP 2 x EP 2 (Megatron-FSDP,
sharded optimizer) and TP 2 x ETP 2 x EP 1 (DDP engine). 4 gloo ranks.

Training at TP 2 with dropout inside tensor-parallel regions (attention dropout; hidden dropout
under sequence parallelism), stopped by --exit-interval and resumed, is bitwise the
uninterrupted run: the checkpoint holds the RNG tracker's states (2 gloo ranks through
`pretrain_gpt.main`). A checkpoint saved without them still loads."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    rng_tracker_device_type,
)
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.training.checkpoint_layout import CHECKPOINT_VERSION, CheckpointError
from megatron.training.checkpoint_rng import set_tracker_states
from megatron.training.checkpointing import (
    _check_arguments,
    load_checkpoint,
    save_checkpoint,
)
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
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    assert_histories_equal,
    edit_common,
    main,
    resumed_part,
)
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
        assert load_checkpoint(model, optimizer, scheduler, args).iteration == step
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


TP2_DROPOUT = {
    # RUN has --attention-dropout 0.1 and --hidden-dropout 0.1: at TP 2 the attention dropout
    # forks the tracker; under sequence parallelism every dropout of the layers does.
    "attention-dropout": ["--tensor-model-parallel-size", "2"],
    "sequence-parallel": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
}


@pytest.mark.parametrize("case", TP2_DROPOUT)
def test_resume_at_tensor_parallel_size_2_with_dropout_is_bitwise_the_uninterrupted_run(
    case, tmp_path
):
    flags = [*RUN, *TP2_DROPOUT[case]]
    straight = run_distributed(main, 2, flags)[0]
    root = str(tmp_path / "ckpt")
    first = run_distributed(main, 2, [*flags, "--exit-interval", "3", "--save", root])[0]
    assert first.losses == straight.losses[:3]
    if case == "sequence-parallel":
        # A checkpoint saved before the tracker's states were: it loads, and only the dropout
        # masks of the tensor-parallel regions differ from the uninterrupted run's.
        old = str(tmp_path / "old")
        shutil.copytree(root, old)
        edit_common(os.path.join(old, "iter_0000003"), _drop_rng_tracker_states)
        resumed_old = run_distributed(main, 2, [*flags, "--load", old])[0]
        assert resumed_old.start_iteration == 3
        assert resumed_old.losses[0] != straight.losses[3]
    resumed = run_distributed(main, 2, [*flags, "--load", root, "--save", root])
    assert resumed[0].start_iteration == 3
    assert_histories_equal(resumed[0], resumed_part(straight, 3))
    assert_histories_equal(resumed[1], resumed[0])


def _drop_rng_tracker_states(common: dict) -> None:
    for state in common["rng_state"]:
        for key in ("rng_tracker_states", "rng_tracker_seeds", "rng_tracker_device"):
            del state[key]


def _saved_tracker(tp_rank: int, draws: int) -> dict:
    """A rank's RNG states as a checkpoint holds them: its tracker seeded at `tp_rank` with
    `draws` numbers drawn in each state."""
    model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank)
    tracker = get_cuda_rng_tracker()
    for name in tracker.get_states():
        with tracker.fork(name):
            torch.rand(draws, device=rng_tracker_device_type())
    return {
        "rng_tracker_states": tracker.get_states(),
        "rng_tracker_seeds": tracker.get_seeds(),
        "rng_tracker_device": rng_tracker_device_type(),
    }


def test_tracker_states_load_from_the_rank_seeded_alike():
    """Rank 1 of a TP-2 run that is resumed at another layout (the rank's own states seeded for
    another tp rank, or another world size) takes the states of the saved tp rank 1, so that
    tp ranks keep drawing different dropout masks; a state no saved rank seeded alike (tp rank
    2 of TP 4), and states of another kind of generator, keep their seeded values."""
    saved = [_saved_tracker(0, 5), _saved_tracker(1, 7)]
    tracker = get_cuda_rng_tracker()
    model_name = "model-parallel-rng"
    try:
        for rank in (None, 0):  # another world size; this rank's states seeded otherwise
            model_parallel_cuda_manual_seed(1234, tp_rank=1)
            set_tracker_states(saved, rank, "ckpt")
            assert torch.equal(
                tracker.get_states()[model_name], saved[1]["rng_tracker_states"][model_name]
            )
        model_parallel_cuda_manual_seed(1234, tp_rank=2)
        seeded = tracker.get_states()
        set_tracker_states(saved, None, "ckpt")
        assert torch.equal(tracker.get_states()[model_name], seeded[model_name])
        # The data-parallel state is seeded alike on every rank: taken from the checkpoint.
        assert torch.equal(
            tracker.get_states()["data-parallel-rng"],
            saved[0]["rng_tracker_states"]["data-parallel-rng"],
        )
        other_device = "cpu" if rng_tracker_device_type() == "cuda" else "cuda"
        foreign = [{**state, "rng_tracker_device": other_device} for state in saved]
        model_parallel_cuda_manual_seed(1234, tp_rank=1)
        seeded = tracker.get_states()
        set_tracker_states(foreign, 1, "ckpt")
        for name, state in tracker.get_states().items():
            assert torch.equal(state, seeded[name]), name
    finally:
        tracker.reset()
