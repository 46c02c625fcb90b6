"""Checkpoints (`megatron.training.checkpointing`) of hand-built models on spawned gloo ranks.

- A save loads back exactly (full weights, fp32 masters, optimizer state per parameter name,
  schedule, RNG states) under the DDP engine and every sharding strategy, and one more step
  from the saved and the loaded state is the same step.
- Loading at another data-parallel size, strategy or hybrid layout reshards exactly.
- A mismatched optimizer state fails before the model changes.
- The FP8 delayed-scaling state (amax histories and scales) loads exactly; a checkpoint without
  it (bf16, current scaling) loads into a delayed-scaling model as the initial state and one
  with it into a model without it; a history saved with another length is resized.
- A save beside another job writing into the directory is refused and removes nothing of it.

`test_checkpoint_resume.py` covers whole runs: exact resume, killed saves, bad checkpoints.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.saved_param_groups import IMPLEMENTATION_KEYS
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import checkpoint_layout
from megatron.training.checkpointing import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from megatron.training.train_state import TrainState
from megatron.training.training import train_step
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    VOCAB_SIZE,
    build_tiny_gpt,
    shard_batch,
    tiny_gpt_config,
    wrap_for_engine,
)
from tests.unit_tests.training.checkpoint_checks import (
    assert_same,
    directory_hashes,
    lock_held_by_another_process,
    read_whole_checkpoint,
    whole_tensor,
    whole_value,
)

# --- Engine-level round trips: save_checkpoint() / load_checkpoint() on hand-built models ---

POSITIONS = 3
"""Sequence length and position-embedding rows: at 4 ranks one rank's shard of the position
embedding is empty, at 2 ranks the shards are uneven."""

GLOBAL_BATCH = 8
NUM_MICROBATCHES = 2
LR = 1e-2


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB_SIZE, (steps, GLOBAL_BATCH, POSITIONS + 1), generator=generator)
    return [(batch[:, :-1].contiguous(), batch[:, 1:].contiguous()) for batch in data]


def _build(
    engine: str,
    *,
    seed: int = 1234,
    bf16: bool = False,
    replicas: int = 1,
    outer: str = "no_shard",
    optimizer: str = "adam",
    momentum: float = 0.0,
    frozen: tuple[str, ...] = (),
    fp8: dict[str, Any] | None = None,
    fp8_param_gather: bool = False,
    distributed_optimizer: bool = False,
) -> tuple[torch.nn.Module, Any, OptimizerParamScheduler]:
    """A tiny GPT with dropout and tied embeddings under `engine` ("ddp", with
    `distributed_optimizer` or not, or a sharding strategy; HSDP / HFSDP with `replicas` > 1),
    its optimizer and a warmup-cosine schedule; `fp8`: the config's FP8 fields."""
    dtypes = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}
    config = tiny_gpt_config(hidden_dropout=0.1, attention_dropout=0.1, **dtypes, **(fp8 or {}))
    model = build_tiny_gpt(
        config, seed, max_sequence_length=POSITIONS, share_embeddings_and_output_weights=True
    )
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    fields = dict(outer_dp_sharding_strategy=outer, num_distributed_optimizer_instances=replicas)
    fields = fields if replicas > 1 else {}
    if fp8_param_gather:
        fields["fp8_param_gather"] = True
    if distributed_optimizer:
        fields["use_distributed_optimizer"] = True
    wrapped = wrap_for_engine(model, engine, **fields)
    config = OptimizerConfig(optimizer=optimizer, lr=LR, sgd_momentum=momentum, clip_grad=1.0)
    megatron_optimizer = get_megatron_optimizer(config, wrapped)
    scheduler = OptimizerParamScheduler(
        megatron_optimizer, 0.0, LR, LR / 10, 2, 10, "cosine", 0.01, 0.05, 10, "linear"
    )
    return wrapped, megatron_optimizer, scheduler


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    return model(tokens, labels=labels), _mean_loss


def _mean_loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def _train(state: tuple, batches: list) -> list[tuple[dict[str, float], float]]:
    """Megatron's iterations (`train_step`) on this rank's microbatches of `batches`."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    microbatches = iter(
        [
            micro
            for tokens, labels in batches
            for micro in zip(
                shard_batch(tokens, rank, world_size).chunk(NUM_MICROBATCHES),
                shard_batch(labels, rank, world_size).chunk(NUM_MICROBATCHES),
            )
        ]
    )
    args = argparse.Namespace(
        num_microbatches=NUM_MICROBATCHES,
        micro_batch_size=GLOBAL_BATCH // (NUM_MICROBATCHES * world_size),
        seq_length=POSITIONS,
        data_parallel_size=world_size,
        check_for_nan_in_loss_and_grad=True,
        calculate_per_token_loss=False,
        empty_unused_memory_level=0,
    )
    results = []
    for _ in batches:
        losses, skipped, grad_norm, _ = train_step(_forward_step, microbatches, *state, args)
        assert not skipped
        results.append((losses.read(), grad_norm))
    return results


def _args(root: str, **overrides: Any) -> argparse.Namespace:
    args = argparse.Namespace(
        save=root,
        load=root,
        ckpt_format="torch_dist",
        ckpt_step=None,
        finetune=False,
        pretrained_checkpoint=None,
        no_load_optim=False,
        no_load_rng=False,
        dist_ckpt_strictness="assume_ok_unexpected",
        num_layers=2,
        hidden_size=32,
    )
    vars(args).update(overrides)
    return args


def _rng_states() -> dict[str, Any]:
    numpy_state = numpy.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout's on GPU (NCCL)
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    random.setstate(states["random"])
    name, keys, *rest = states["numpy"]
    numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), *rest))


def _snapshot(state: tuple) -> dict[str, Any]:
    """Everything a checkpoint holds, whole: weights as the model keeps them (fp32 DTensor main
    weights gathered, or the DDP engine's parameters) and the FP8 delayed-scaling state's
    tensors (`FP8_STATE`), fp32 masters and optimizer states by parameter name,
    hyperparameters, schedule, and this rank's RNG states."""
    model, optimizer, scheduler = state
    sharded = optimizer.sharded_state_dict()
    return {
        "weights": {name: whole_value(value) for name, value in model.state_dict().items()},
        "masters": {name: whole_tensor(t) for name, t in sharded["fp32_from_fp16_params"].items()},
        "optimizer": {
            name: {key: whole_tensor(value) for key, value in values.items()}
            for name, values in sharded["state"].items()
        },
        "param_groups": [
            {
                **{k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS},
                "params": sorted(group["params"]),
            }
            for group in sharded["param_groups"]
        ],
        "scheduler": scheduler.state_dict(),
        "rng": _rng_states(),
    }


def _round_trip(engine: str, root: str, build: dict[str, Any]) -> dict[str, Any]:
    """2 steps, save; load into a model, optimizer and schedule built with other weights and
    other RNG states; then one more step from the saved state and from the loaded one."""
    parallel_state.initialize_model_parallel()
    batches = _batches(3)
    saved_state = _build(engine, **build)
    _train(saved_state, batches[:2])
    save_checkpoint(TrainState(iteration=2, consumed_train_samples=16), *saved_state, _args(root))
    saved = _snapshot(saved_state)

    loaded_state = _build(engine, seed=4321, **build)
    random.seed(4321)
    numpy.random.seed(4321)
    args = _args(root)
    loaded_progress = load_checkpoint(*loaded_state, args)
    loaded = _snapshot(loaded_state)
    # The loaded RNG states are the saved ones: both steps draw the same dropout masks.
    step_loaded = _train(loaded_state, batches[2:])
    _set_rng_states(saved["rng"])
    step_saved = _train(saved_state, batches[2:])
    return dict(
        iteration=loaded_progress.iteration,
        consumed=loaded_progress.consumed_train_samples,
        saved=saved,
        loaded=loaded,
        step_saved=(step_saved, _snapshot(saved_state)),
        step_loaded=(step_loaded, _snapshot(loaded_state)),
    )


FP8_DELAYED = dict(fp8="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
FP8_TENSORWISE = dict(fp8="hybrid", fp8_recipe="tensorwise")
FP8_STATE = "decoder.fp8_state._extra_state"
"""The model state dict's entry of the FP8 delayed-scaling state."""
ENGINES_WITH_FP8 = ("ddp", "optim_grads_params")

ROUND_TRIPS = {
    **{f"{engine}-fp32": (engine, {}) for engine in ("ddp", "no_shard", "optim", "optim_grads")},
    "optim_grads_params-fp32": ("optim_grads_params", {}),
    **{f"{e}-bf16": (e, {"bf16": True}) for e in ("ddp", "optim", "optim_grads_params")},
    "ddp-sgd-no-momentum": ("ddp", {"optimizer": "sgd"}),
    "optim_grads_params-sgd-no-momentum": ("optim_grads_params", {"optimizer": "sgd"}),
    "optim_grads-sgd-momentum": ("optim_grads", {"optimizer": "sgd", "momentum": 0.9}),
    "ddp-bf16-frozen": ("ddp", {"bf16": True, "frozen": ("decoder.final_layernorm.weight",)}),
    **{
        f"{e}-fp8-param-gather": (e, dict(bf16=True, fp8=FP8_DELAYED, fp8_param_gather=True))
        for e in ("optim", "optim_grads_params")
    },
    "ddp-distributed-optimizer-fp8-param-gather": (
        "ddp",
        dict(bf16=True, fp8=FP8_DELAYED, fp8_param_gather=True, distributed_optimizer=True),
    ),
    "optim_grads_params-frozen": (
        "optim_grads_params",
        {"frozen": ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.final_layernorm.bias")},
    ),
    **{f"{e}-fp8-delayed": (e, {"bf16": True, "fp8": FP8_DELAYED}) for e in ENGINES_WITH_FP8},
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_save_load_round_trip(case, tmp_path):
    engine, build = ROUND_TRIPS[case]
    results = run_distributed(_round_trip, 2, engine, str(tmp_path), build)
    for rank, result in enumerate(results):
        assert result["iteration"] == 2 and result["consumed"] == 16
        saved = result["saved"]
        trainable = {
            name
            for name, value in saved["weights"].items()
            if isinstance(value, torch.Tensor) and name not in build.get("frozen", ())
        }
        if build.get("fp8"):  # the state two steps made: not the initial one
            fp8_state = saved["weights"][FP8_STATE]
            assert (fp8_state["scale_fwd"] != 1).all() and (fp8_state["scale_bwd"] != 1).all()
        if build.get("optimizer") == "sgd" and not build.get("momentum"):
            assert not any(saved["optimizer"].values())  # nothing but hyperparameters
        else:
            assert saved["optimizer"].keys() == trainable, f"rank {rank}: state is missing"
        if build.get("bf16") and engine == "ddp":
            assert saved["masters"].keys() == trainable
            assert all(m.dtype == torch.float32 for m in saved["masters"].values())
        assert_same(result["loaded"], saved, f"rank {rank} loaded")
        assert_same(result["step_loaded"], result["step_saved"], f"rank {rank} next step")
    # The next step changed the weights: the comparison above is not of two idle models.
    first = results[0]
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    assert not torch.equal(first["step_saved"][1]["weights"][name], first["saved"]["weights"][name])


def _no_load_optim_into_bf16_masters(root: str) -> dict[str, Any]:
    parallel_state.initialize_model_parallel()
    saved_state = _build("ddp", bf16=True)
    _train(saved_state, _batches(2))
    save_checkpoint(2, *saved_state, _args(root))
    model, optimizer, scheduler = _build("ddp", bf16=True, seed=4321)
    loaded = load_checkpoint(model, optimizer, scheduler, _args(root, no_load_optim=True))
    iteration = loaded.iteration
    params = dict(model.module.named_parameters())
    masters = optimizer.sharded_state_dict()["fp32_from_fp16_params"]
    return dict(
        iteration=iteration,
        saved=_snapshot(saved_state)["weights"],
        loaded={name: params[name].detach().clone() for name in masters},
        masters={name: master.detach().clone() for name, master in masters.items()},
        optimizer_state=optimizer.sharded_state_dict()["state"],
        scheduler_steps=scheduler.num_steps,
    )


def test_no_load_optim_refreshes_the_fp32_masters_from_the_loaded_weights(tmp_path):
    """The DDP engine's masters are the optimizer's: without its state they must be copied
    from the loaded bf16 weights, or the next step would write the old weights back."""
    result = run_distributed(_no_load_optim_into_bf16_masters, 2, str(tmp_path))[0]
    assert result["iteration"] == 2
    assert result["optimizer_state"] == {} and result["scheduler_steps"] == 0
    assert result["masters"]
    for name, master in result["masters"].items():
        assert result["loaded"][name].dtype == torch.bfloat16
        assert_same(result["loaded"][name], result["saved"][name], name)
        assert_same(master, result["loaded"][name].float(), name)


def _mismatched_load(root: str, saving: tuple, loading: tuple) -> dict[str, Any]:
    """Saves a model built as `saving` (engine, build kwargs), then loads it into one built as
    `loading`; the error, and the loading model's weights before and after."""
    parallel_state.initialize_model_parallel()
    saved_state = _build(saving[0], **saving[1])
    _train(saved_state, _batches(1))
    save_checkpoint(1, *saved_state, _args(root))
    state = _build(loading[0], seed=4321, **loading[1])
    before = _snapshot(state)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(*state, _args(root))
    return dict(error=str(error.value), before=before, after=_snapshot(state))


MISMATCHED_LOADS = {
    # id: (saving, loading, fragments of the error)
    "frozen-parameter": (
        ("optim_grads_params", {"frozen": ("decoder.final_layernorm.weight",)}),
        ("optim_grads_params", {}),
        ["group 1 holds other parameters", "['decoder.final_layernorm.weight']"],
    ),
    "bf16-ddp-engine-to-fsdp": (
        ("ddp", {"bf16": True}),
        ("optim_grads", {"bf16": True}),
        ["it holds 28 (saved by the DDP engine", "keeps no fp32 masters"],
    ),
    "adam-to-sgd": (
        ("no_shard", {}),
        ("no_shard", {"optimizer": "sgd", "momentum": 0.9}),
        ["optimizer is of another kind", "this SGD's ['dampening', 'momentum', 'nesterov']"],
    ),
}


@pytest.mark.parametrize("case", MISMATCHED_LOADS)
def test_mismatched_optimizer_state_fails_before_the_model_changes(case, tmp_path):
    saving, loading, fragments = MISMATCHED_LOADS[case]
    for result in run_distributed(_mismatched_load, 2, str(tmp_path), saving, loading):
        for fragment in fragments:
            assert fragment in result["error"], result["error"]
        assert_same(result["after"], result["before"], case)


def _load_across_fp8_recipes(root: str, saving: dict, loading: dict) -> dict[str, Any]:
    """Saves a bf16 ZeRO-3 model with the FP8 fields `saving` after two steps, loads it into
    one with `loading` that took a step of its own first (so that its FP8 state after the load
    comes from the load), and takes one more step from it."""
    parallel_state.initialize_model_parallel()
    batches = _batches(4)
    saved_state = _build("optim_grads_params", bf16=True, fp8=saving)
    _train(saved_state, batches[:2])
    save_checkpoint(2, *saved_state, _args(root))
    state = _build("optim_grads_params", seed=4321, bf16=True, fp8=loading)
    _train(state, batches[3:])
    load_checkpoint(*state, _args(root))
    loaded = _snapshot(state)
    _train(state, batches[2:3])
    return dict(saved=_snapshot(saved_state), loaded=loaded)


FP8_LOADS = {
    # id: (the saving model's FP8 fields, the loading model's)
    "bf16-to-delayed": ({}, FP8_DELAYED),
    "tensorwise-to-delayed": (FP8_TENSORWISE, FP8_DELAYED),
    "delayed-to-bf16": (FP8_DELAYED, {}),
    "delayed-to-tensorwise": (FP8_DELAYED, FP8_TENSORWISE),
    "history-4-to-2": (FP8_DELAYED, {**FP8_DELAYED, "fp8_amax_history_len": 2}),
    "history-4-to-6": (FP8_DELAYED, {**FP8_DELAYED, "fp8_amax_history_len": 6}),
}


@pytest.mark.parametrize("case", FP8_LOADS)
def test_fp8_state_loads_across_recipes_and_history_lengths(case, tmp_path):
    """Weights and optimizer state load whatever the FP8 recipes; the delayed-scaling state:
    the initial one from a checkpoint without it, none into a model without it, and a history
    of another length resized as Transformer Engine does (the first rows kept, zero rows
    added at the end), the scales kept."""
    saving, loading = FP8_LOADS[case]
    for result in run_distributed(_load_across_fp8_recipes, 2, str(tmp_path), saving, loading):
        saved, loaded = result["saved"], result["loaded"]
        saved_state = saved["weights"].pop(FP8_STATE, None)
        loaded_state = loaded["weights"].pop(FP8_STATE, None)
        assert_same(loaded["weights"], saved["weights"], f"{case} weights")
        assert_same(loaded["optimizer"], saved["optimizer"], f"{case} optimizer")
        if loading.get("fp8_recipe", "delayed") != "delayed" or not loading:
            assert loaded_state is None
            continue
        if saved_state is None:  # the initial state
            length, slots = FP8_DELAYED["fp8_amax_history_len"], 4 * 2  # 4 linears a layer
            expected = {
                "amax_history_fwd": torch.zeros(length, slots),
                "scale_fwd": torch.ones(slots),
                "amax_history_bwd": torch.zeros(length, slots),
                "scale_bwd": torch.ones(slots),
            }
        else:
            length = loading["fp8_amax_history_len"]
            expected = dict(saved_state)
            for key in ("amax_history_fwd", "amax_history_bwd"):
                history = saved_state[key]
                extra = torch.zeros(max(length - len(history), 0), history.shape[1])
                expected[key] = torch.cat([history[:length], extra])
            assert (saved_state["amax_history_fwd"][1:] != 0).all()  # a full window
        assert_same(loaded_state, expected, f"{case} FP8 state")


# --- Resharding: another data-parallel size, sharding strategy or hybrid layout ---

SOURCES = {
    # name: (world size, strategy, replicas, outer strategy)
    "zero3@4": (4, "optim_grads_params", 1, "no_shard"),
    "zero3@2": (2, "optim_grads_params", 1, "no_shard"),
    "hsdp@4": (4, "optim_grads_params", 2, "no_shard"),
    "hfsdp@4": (4, "optim_grads_params", 2, "optim"),
}


def _train_and_save(root: str, strategy: str, replicas: int, outer: str) -> dict[str, Any]:
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=replicas)
    state = _build(strategy, replicas=replicas, outer=outer)
    batches = _batches(3)
    _train(state, batches[:2])
    save_checkpoint(2, *state, _args(root))
    snapshot = _snapshot(state)
    # The next iteration's loss: its forward runs on the saved weights.
    snapshot["next_loss"] = _train(state, batches[2:])[0][0]
    return snapshot


def _load(root: str, strategy: str, replicas: int, outer: str) -> dict[str, Any]:
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=replicas)
    state = _build(strategy, seed=4321, replicas=replicas, outer=outer)
    assert load_checkpoint(*state, _args(root)).iteration == 2
    snapshot = _snapshot(state)
    # Compute weights come from the loaded main weights (all-gathered, or HFSDP's model shard).
    snapshot["next_loss"] = _train(state, _batches(3)[2:])[0][0]
    return snapshot


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory) -> Callable[[str], tuple[str, dict[str, Any]]]:
    """name in SOURCES -> (the --save directory, rank 0's snapshot at the save), each saved
    once, when a test first asks for it."""
    cache: dict[str, tuple[str, dict[str, Any]]] = {}

    def get(name: str) -> tuple[str, dict[str, Any]]:
        if name not in cache:
            world_size, *layout = SOURCES[name]
            root = str(tmp_path_factory.mktemp(name.replace("@", "-at-")))
            cache[name] = (root, run_distributed(_train_and_save, world_size, root, *layout)[0])
        return cache[name]

    return get


RESHARDS = {
    # id: (source, world size, strategy, replicas, outer strategy)
    "4-zero3-to-2-zero2": ("zero3@4", 2, "optim_grads", 1, "no_shard"),
    "4-zero3-to-1-zero3": ("zero3@4", 1, "optim_grads_params", 1, "no_shard"),
    "4-zero3-to-1-ddp": ("zero3@4", 1, "ddp", 1, "no_shard"),
    "2-zero3-to-4-zero3": ("zero3@2", 4, "optim_grads_params", 1, "no_shard"),
    "2-zero3-to-2-zero2": ("zero3@2", 2, "optim_grads", 1, "no_shard"),
    "4-hsdp-to-4-fsdp": ("hsdp@4", 4, "optim_grads_params", 1, "no_shard"),
    "4-hfsdp-to-4-fsdp": ("hfsdp@4", 4, "optim_grads_params", 1, "no_shard"),
    "4-fsdp-to-4-hfsdp": ("zero3@4", 4, "optim_grads_params", 2, "optim"),
    "4-hfsdp-to-2-hsdp": ("hfsdp@4", 2, "optim_grads_params", 2, "no_shard"),
}


@pytest.mark.parametrize("case", RESHARDS)
def test_load_reshards_exactly(case, saved_checkpoints):
    source, world_size, *layout = RESHARDS[case]
    root, saved = saved_checkpoints(source)
    loaded = run_distributed(_load, world_size, root, *layout)[0]
    # At another world size every rank takes rank 0's RNG states: those compared here.
    assert_same({**loaded, "next_loss": None}, {**saved, "next_loss": None}, case)
    if world_size == SOURCES[source][0]:
        # The same weights, samples per rank and dropout masks: the same forward, bitwise.
        assert loaded["next_loss"] == saved["next_loss"]


def test_checkpoint_on_disk_holds_the_whole_tensors(saved_checkpoints, tmp_path):
    """Read without the code that wrote it: every saved shard is where DCP says it is,
    including the empty shard of rank 3 and the uneven ones."""
    root, saved = saved_checkpoints("zero3@4")
    whole = read_whole_checkpoint(os.path.join(root, "iter_0000002"), str(tmp_path))
    assert saved["weights"]["embedding.position_embeddings.weight"].shape[0] == POSITIONS
    assert_same(whole["model"], saved["weights"], "model")
    assert_same(whole["optimizer"]["state"], saved["optimizer"], "optimizer")
    assert "fp32_from_fp16_params" not in whole["optimizer"]  # fp32 main weights: no masters


def test_files_named_like_checkpoint_directories_are_left_alone(tmp_path):
    """A file where a save's directory goes is refused by name before anything moves (before:
    the save renamed it aside, committed, then failed deleting it; leftover cleanup deleted
    files named like staging directories)."""
    root = str(tmp_path)
    for name in ("iter_0000004", "iter_0000006.tmp"):
        with open(os.path.join(root, name), "w") as file:
            file.write("user notes")
    checkpoint_layout.remove_leftovers(root)
    staging = os.path.join(root, "iter_0000004.tmp")
    os.makedirs(staging)
    with pytest.raises(NotADirectoryError, match="iter_0000004 is not a directory"):
        checkpoint_layout.commit_checkpoint(staging, os.path.join(root, "iter_0000004"))
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000004.tmp", "iter_0000006.tmp"]
    for name in ("iter_0000004", "iter_0000006.tmp"):
        with open(os.path.join(root, name)) as file:
            assert file.read() == "user notes"


def _save_error(root: str) -> str | None:
    try:
        save_checkpoint(2, *_build("optim_grads_params"), _args(root))
    except CheckpointError as error:
        return str(error)
    return None


def test_a_save_beside_another_writer_is_refused_and_removes_nothing(tmp_path):
    """A save outside a training run takes the directory's lock for itself (before: it removed
    every leftover iter_*.tmp, another job's save in progress among them)."""
    root = str(tmp_path / "save")
    with lock_held_by_another_process(root) as pid:
        os.makedirs(os.path.join(root, "iter_0000007.tmp"))
        with open(os.path.join(root, "iter_0000007.tmp", "__0_0.distcp"), "wb") as shard:
            shard.write(b"the other job's shard")
        before = directory_hashes(root)
        for message in run_distributed(_save_error, 2, root):
            assert message is not None, "saved beside another writer"
            assert "Saving failed on rank 0 while creating" in message, message
            assert "is in use by another job (host " in message, message
            assert f", pid {pid}, started " in message, message
        assert directory_hashes(root) == before
    # Without a holder it takes the lock for the save alone, and leaves no lock behind.
    assert run_distributed(_save_error, 2, root) == [None, None]
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
