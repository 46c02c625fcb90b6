"""Checkpoints (`megatron.training.checkpointing`) on spawned gloo ranks.

- A save loads back exactly (full weights, fp32 masters, optimizer state per parameter name,
  schedule, RNG states) under the DDP engine and every sharding strategy, and one more step
  from the saved and the loaded state is the same step.
- Loading at another data-parallel size, strategy or hybrid layout reshards exactly.
- Training resumed through `pretrain_gpt.main` is bitwise the uninterrupted run.
- A save killed part-way leaves the previous checkpoint, which resumes exactly.
- Missing, damaged and mismatched checkpoints fail naming what differs, and leave the
  directory byte-identical; --finetune, --no-load-optim and --no-load-rng load what they say.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import shutil
import signal
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

import pretrain_gpt
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training import checkpointing, training
from megatron.training.checkpointing import (
    TRACKER_FILENAME,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from megatron.training.training import TrainingHistory, train_step
from tests.unit_tests.distributed_harness import DistributedTestError, run_distributed
from tests.unit_tests.model_builders import (
    VOCAB_SIZE,
    build_tiny_gpt,
    shard_batch,
    tiny_gpt_config,
    wrap_for_engine,
)

# --- Engine-level round trips: save_checkpoint() / load_checkpoint() on hand-built models ---

POSITIONS = 3
"""Sequence length and position-embedding rows: at 4 ranks one rank's shard of the position
embedding is empty, at 2 ranks the shards are uneven."""

GLOBAL_BATCH = 8
NUM_MICROBATCHES = 2
LR = 1e-2
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""How a process steps, not what: may differ between the saving and the loading optimizer."""


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
) -> tuple[torch.nn.Module, Any, OptimizerParamScheduler]:
    """A tiny GPT with dropout and tied embeddings under `engine` ("ddp" or a sharding
    strategy; HSDP / HFSDP with `replicas` > 1), its optimizer and a warmup-cosine schedule."""
    dtypes = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}
    config = tiny_gpt_config(hidden_dropout=0.1, attention_dropout=0.1, **dtypes)
    model = build_tiny_gpt(
        config, seed, max_sequence_length=POSITIONS, share_embeddings_and_output_weights=True
    )
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    if replicas == 1:
        wrapped = wrap_for_engine(model, engine)
    else:
        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=engine,
            outer_dp_sharding_strategy=outer,
            num_distributed_optimizer_instances=replicas,
        )
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        wrapped = FullyShardedDataParallel(config, ddp_config, model, pg_collection=pg_collection)
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
        num_microbatches=NUM_MICROBATCHES, check_for_nan_in_loss_and_grad=True
    )
    results = []
    for _ in batches:
        losses, skipped, grad_norm = train_step(_forward_step, microbatches, *state, args)
        assert not skipped
        results.append((losses, grad_norm))
    return results


def _args(root: str, **overrides: Any) -> argparse.Namespace:
    args = argparse.Namespace(
        save=root,
        load=root,
        ckpt_format="torch_dist",
        ckpt_step=None,
        finetune=False,
        no_load_optim=False,
        no_load_rng=False,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        num_layers=2,
        hidden_size=32,
    )
    vars(args).update(overrides)
    return args


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


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
    weights gathered, or the DDP engine's parameters), fp32 masters and optimizer states by
    parameter name, hyperparameters, schedule, and this rank's RNG states."""
    model, optimizer, scheduler = state
    sharded = optimizer.sharded_state_dict()
    return {
        "weights": {name: _full(t) for name, t in model.state_dict().items()},
        "masters": {name: _full(t) for name, t in sharded["fp32_from_fp16_params"].items()},
        "optimizer": {
            name: {key: _full(value) for key, value in values.items()}
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


def _assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Recursive exact equality: tensors bitwise, with the same dtype and shape."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (
            f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        )
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _round_trip(engine: str, root: str, build: dict[str, Any]) -> dict[str, Any]:
    """2 steps, save; load into a model, optimizer and schedule built with other weights and
    other RNG states; then one more step from the saved state and from the loaded one."""
    parallel_state.initialize_model_parallel()
    batches = _batches(3)
    saved_state = _build(engine, **build)
    _train(saved_state, batches[:2])
    save_checkpoint(2, *saved_state, _args(root, consumed_train_samples=16))
    saved = _snapshot(saved_state)

    loaded_state = _build(engine, seed=4321, **build)
    random.seed(4321)
    numpy.random.seed(4321)
    args = _args(root)
    iteration = load_checkpoint(*loaded_state, args)
    loaded = _snapshot(loaded_state)
    # The loaded RNG states are the saved ones: both steps draw the same dropout masks.
    step_loaded = _train(loaded_state, batches[2:])
    _set_rng_states(saved["rng"])
    step_saved = _train(saved_state, batches[2:])
    return dict(
        iteration=iteration,
        consumed=args.consumed_train_samples,
        saved=saved,
        loaded=loaded,
        step_saved=(step_saved, _snapshot(saved_state)),
        step_loaded=(step_loaded, _snapshot(loaded_state)),
    )


ROUND_TRIPS = {
    **{f"{engine}-fp32": (engine, {}) for engine in ("ddp", "no_shard", "optim", "optim_grads")},
    "optim_grads_params-fp32": ("optim_grads_params", {}),
    **{f"{e}-bf16": (e, {"bf16": True}) for e in ("ddp", "optim", "optim_grads_params")},
    "ddp-sgd-no-momentum": ("ddp", {"optimizer": "sgd"}),
    "optim_grads_params-sgd-no-momentum": ("optim_grads_params", {"optimizer": "sgd"}),
    "optim_grads-sgd-momentum": ("optim_grads", {"optimizer": "sgd", "momentum": 0.9}),
    "ddp-bf16-frozen": ("ddp", {"bf16": True, "frozen": ("decoder.final_layernorm.weight",)}),
    "optim_grads_params-frozen": (
        "optim_grads_params",
        {"frozen": ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.final_layernorm.bias")},
    ),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_save_load_round_trip(case, tmp_path):
    engine, build = ROUND_TRIPS[case]
    results = run_distributed(_round_trip, 2, engine, str(tmp_path), build)
    for rank, result in enumerate(results):
        assert result["iteration"] == 2 and result["consumed"] == 16
        saved = result["saved"]
        trainable = {n for n in saved["weights"] if n not in build.get("frozen", ())}
        if build.get("optimizer") == "sgd" and not build.get("momentum"):
            assert not any(saved["optimizer"].values())  # nothing but hyperparameters
        else:
            assert saved["optimizer"].keys() == trainable, f"rank {rank}: state is missing"
        if build.get("bf16") and engine == "ddp":
            assert saved["masters"].keys() == trainable
            assert all(m.dtype == torch.float32 for m in saved["masters"].values())
        _assert_same(result["loaded"], saved, f"rank {rank} loaded")
        _assert_same(result["step_loaded"], result["step_saved"], f"rank {rank} next step")
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
    iteration = load_checkpoint(model, optimizer, scheduler, _args(root, no_load_optim=True))
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
        _assert_same(result["loaded"][name], result["saved"][name], name)
        _assert_same(master, result["loaded"][name].float(), name)


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
        _assert_same(result["after"], result["before"], case)


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
    assert load_checkpoint(*state, _args(root)) == 2
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
    _assert_same({**loaded, "next_loss": None}, {**saved, "next_loss": None}, case)
    if world_size == SOURCES[source][0]:
        # The same weights, samples per rank and dropout masks: the same forward, bitwise.
        assert loaded["next_loss"] == saved["next_loss"]


def _read_whole(path: str, scratch: str) -> dict[str, Any]:
    """A checkpoint's tensors, whole, read in this process (DCP's own converter)."""
    os.makedirs(scratch, exist_ok=True)
    output = os.path.join(scratch, "whole.pt")
    dcp_to_torch_save(path, output)
    whole = torch.load(output, weights_only=False)
    os.remove(output)
    return whole


def test_checkpoint_on_disk_holds_the_whole_tensors(saved_checkpoints, tmp_path):
    """Read without the code that wrote it: every saved shard is where DCP says it is,
    including the empty shard of rank 3 and the uneven ones."""
    root, saved = saved_checkpoints("zero3@4")
    whole = _read_whole(os.path.join(root, "iter_0000002"), str(tmp_path))
    assert saved["weights"]["embedding.position_embeddings.weight"].shape[0] == POSITIONS
    _assert_same(whole["model"], saved["weights"], "model")
    _assert_same(whole["optimizer"]["state"], saved["optimizer"], "optimizer")
    assert "fp32_from_fp16_params" not in whole["optimizer"]  # fp32 main weights: no masters


# --- Through pretrain_gpt.main: resume, kill, bad checkpoints, load options ---

RUN = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 1e-2 --lr-warmup-iters 2 "
    "--lr-decay-style cosine --min-lr 1e-3 --mock-data --vocab-size 64 --hidden-dropout 0.1 "
    "--attention-dropout 0.1 --num-workers 0 --eval-interval 2 --eval-iters 1 "
    "--log-interval 10 --clip-grad 1.0"
).split()
"""6 iterations of 2 microbatches per rank at 2 ranks, dropout on, validation every 2."""

ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
ENGINES = {
    "fsdp_zero3": ZERO3,
    "ddp": [],
    "fsdp_zero3_bf16": [*ZERO3, "--bf16"],
    "ddp_bf16": ["--bf16"],  # the optimizer's fp32 masters are state to restore
}


def _main(flags: list[str]) -> TrainingHistory:
    return pretrain_gpt.main([*flags, "--distributed-backend", dist.get_backend()])


def _main_error(flags: list[str]) -> tuple[str, str] | None:
    """(exception type, message) of a run that fails; None if it trains."""
    try:
        _main(flags)
    except Exception as error:  # noqa: BLE001 - the test checks which
        return type(error).__name__, str(error)
    return None


def _dropout_rng() -> str:
    """The generator dropout draws from on this rank (the key of its state in a checkpoint's
    RNG states): only its state tells a loaded RNG from a kept one, as training leaves the
    other one untouched."""
    return "cuda" if dist.get_backend() == "nccl" else "torch"


def _dropout_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _dropout_rng() == "cuda" else torch.get_rng_state()


def _main_observing_load(flags: list[str]) -> tuple[TrainingHistory, dict[str, Any]]:
    """Runs training and records what `load_checkpoint()` left: the iteration, the whole
    weights, the optimizer state, the schedule's step, the consumed samples, and dropout's RNG
    state before and after it."""
    observed: dict[str, Any] = {}
    original = training.load_checkpoint

    def observe(model, optimizer, scheduler, args):
        observed["rng_before"] = _dropout_rng_state()
        iteration = original(model, optimizer, scheduler, args)
        observed.update(
            iteration=iteration,
            weights={name: _full(t) for name, t in model.state_dict().items()},
            optimizer_state=sum(map(len, optimizer.sharded_state_dict()["state"].values())),
            scheduler_steps=scheduler.num_steps,
            consumed=(args.consumed_train_samples, args.consumed_valid_samples),
            rng_after=_dropout_rng_state(),
            rng=_dropout_rng(),
        )
        return iteration

    with mock.patch.object(training, "load_checkpoint", observe):
        history = _main(flags)
    return history, observed


def _read_tracker(root: str) -> str:
    with open(os.path.join(root, TRACKER_FILENAME)) as tracker:
        return tracker.read()


def _hashes(root: str) -> dict[str, str]:
    """Every file under `root` -> the SHA-256 of its bytes."""
    hashes = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as file:
                hashes[os.path.relpath(path, root)] = hashlib.sha256(file.read()).hexdigest()
    return hashes


def _assert_histories_equal(actual: TrainingHistory, expected: TrainingHistory) -> None:
    """Bitwise: Python floats compare exactly."""
    assert actual.losses == expected.losses
    assert actual.grad_norms == expected.grad_norms
    assert actual.learning_rates == expected.learning_rates
    assert actual.validation_losses == expected.validation_losses
    assert actual.final_validation_losses == expected.final_validation_losses
    assert actual.test_losses == expected.test_losses


def _resumed_part(straight: TrainingHistory, after: int) -> TrainingHistory:
    """What a run resumed after iteration `after` must report of `straight`."""
    return TrainingHistory(
        start_iteration=after,
        losses=straight.losses[after:],
        grad_norms=straight.grad_norms[after:],
        learning_rates=straight.learning_rates[after:],
        validation_losses={i: v for i, v in straight.validation_losses.items() if i > after},
        final_validation_losses=straight.final_validation_losses,
        test_losses=straight.test_losses,
    )


@pytest.fixture(scope="module")
def straight_runs() -> Callable[[str], TrainingHistory]:
    """engine -> its 6 iterations without checkpoints, run once when first asked for."""
    cache: dict[str, TrainingHistory] = {}

    def get(engine: str) -> TrainingHistory:
        if engine not in cache:
            histories = run_distributed(_main, 2, [*RUN, *ENGINES[engine]])
            assert histories[0].losses == histories[1].losses
            cache[engine] = histories[0]
        return cache[engine]

    return get


@pytest.fixture(scope="module")
def zero3_first_half(tmp_path_factory) -> str:
    """A --save directory of ZeRO-3 stopped by --exit-interval 3: iterations 2 and 3 saved."""
    root = str(tmp_path_factory.mktemp("first-half"))
    flags = [*RUN, *ZERO3, "--exit-interval", "3", "--save", root, "--save-interval", "2"]
    history = run_distributed(_main, 2, flags)[0]
    assert len(history.losses) == 3
    return root


@pytest.mark.parametrize("engine", ENGINES)
def test_resumed_training_is_bitwise_the_uninterrupted_run(
    engine, tmp_path, straight_runs, zero3_first_half
):
    straight = straight_runs(engine)
    if engine == "fsdp_zero3":
        root = zero3_first_half
    else:
        root = str(tmp_path)
        flags = [*RUN, *ENGINES[engine], "--exit-interval", "3", "--save", root]
        flags += ["--save-interval", "2"]
        first = run_distributed(_main, 2, flags)[0]
        # Saving changes nothing in training; the first half evaluated at iteration 2.
        assert first.losses == straight.losses[:3]
        assert first.validation_losses == {2: straight.validation_losses[2]}
    assert _read_tracker(root) == "3\n"
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", TRACKER_FILENAME]
    # Resuming into a copy: the module's first half stays as it was for the other tests.
    resume_root = str(tmp_path / "resume")
    shutil.copytree(root, resume_root)
    flags = [*RUN, *ENGINES[engine], "--load", resume_root, "--save", resume_root]
    second = run_distributed(_main, 2, flags)
    assert second[0].start_iteration == 3
    # The data order too: each iteration's loss is of its own samples and dropout masks.
    _assert_histories_equal(second[0], _resumed_part(straight, 3))
    _assert_histories_equal(second[1], second[0])
    assert _read_tracker(resume_root) == "6\n"


class _DyingWriter(FileSystemWriter):
    """Writes this rank's shards of the save into `iter_0000004.tmp`, then SIGKILLs its own
    process: before it reports them, so no rank can finish the save."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if str(self.path).endswith("iter_0000004.tmp"):
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return future


def _main_killed_in_save(flags: list[str], where: str) -> TrainingHistory:
    """Trains, and dies in the save of iteration 4: rank 1 after writing its shards
    ("writing"), or rank 0 after the commit, before the tracker names it ("tracker")."""
    rank = dist.get_rank()
    if where == "writing" and rank == 1:
        patch = mock.patch.object(checkpointing, "FileSystemWriter", _DyingWriter)
    elif where == "tracker" and rank == 0:
        original = checkpointing.atomic_write_text

        def write_then_die(path: str, text: str) -> None:
            if text == "4\n":
                os.kill(os.getpid(), signal.SIGKILL)
            original(path, text)

        patch = mock.patch.object(checkpointing, "atomic_write_text", write_then_die)
    else:
        patch = contextlib.nullcontext()
    with patch:
        return _main(flags)


@pytest.mark.parametrize("where", ["writing", "tracker"])
def test_save_killed_part_way_leaves_the_previous_checkpoint(where, tmp_path, straight_runs):
    root = str(tmp_path / "ckpt")
    flags = [*RUN, *ZERO3, "--save", root, "--save-interval", "2"]
    dying = 1 if where == "writing" else 0
    with pytest.raises(DistributedTestError, match=f"rank {dying} died"):
        run_distributed(_main_killed_in_save, 2, flags, where)
    assert _read_tracker(root) == "2\n"
    if where == "writing":
        staging = os.path.join(root, "iter_0000004.tmp")
        assert not os.path.exists(os.path.join(root, "iter_0000004"))
        # Killed mid-save: rank 1's shards are there, the save's metadata never was.
        assert "__1_0.distcp" in os.listdir(staging)
        assert not {".metadata", "common.pt"} & set(os.listdir(staging))
    else:
        # Committed but never tracked: not loaded, and replaced by the next save of 4.
        assert os.path.isfile(os.path.join(root, "iter_0000004", "common.pt"))
    previous = _hashes(os.path.join(root, "iter_0000002"))

    flags = [*flags, "--load", root]
    resumed = run_distributed(_main, 2, flags)[0]
    _assert_histories_equal(resumed, _resumed_part(straight_runs("fsdp_zero3"), 2))
    assert _hashes(os.path.join(root, "iter_0000002")) == previous
    assert sorted(os.listdir(root)) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000006",
        TRACKER_FILENAME,
    ]
    assert _read_tracker(root) == "6\n"


def _save_in_this_process(state: dict[str, Any], path: str) -> None:
    with warnings.catch_warnings():  # DCP's note that it runs without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)


def _weights_only(source: str, target: str) -> None:
    """`target`: the checkpoint of `source` less its optimizer state, as a conversion from
    model weights writes it (no parameter groups, schedule or RNG states)."""
    whole = _read_whole(source, target)
    _save_in_this_process({"model": whole["model"]}, target)
    common = torch.load(os.path.join(source, "common.pt"), weights_only=False)
    common.update(param_groups=None, opt_param_scheduler=None, rng_state=[])
    torch.save(common, os.path.join(target, "common.pt"))


def _edit(path: str, text: str | bytes) -> None:
    with open(path, "wb" if isinstance(text, bytes) else "w") as file:
        file.write(text)


def _truncate(path: str) -> None:
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)


def _drop_model_args(path: str) -> None:
    common = torch.load(path, weights_only=False)
    common["args"] = {}
    torch.save(common, path)


ITER_3 = "iter_0000003"
BAD_LOADS = {
    # id: (edit of a copy of the first half's directory, extra flags, fragments of the error)
    "hidden-size": (None, ["--hidden-size", "64"], ["--hidden-size 32 (here 64)"]),
    "num-layers": (None, ["--num-layers", "3"], ["--num-layers 2 (here 3)"]),
    "tensor-shapes": (
        lambda root: _drop_model_args(os.path.join(root, ITER_3, "common.pt")),
        ["--hidden-size", "64"],
        ["differ in shape", "embedding.word_embeddings.weight: saved [128, 32], model [128, 64]"],
    ),
    "no-such-directory": (None, ["--load", "{root}/missing"], ["missing: no such directory"]),
    "tracker-to-missing": (
        lambda root: _edit(os.path.join(root, TRACKER_FILENAME), "7\n"),
        [],
        ["names iteration 7, but", "iter_0000007 does not exist"],
    ),
    "ckpt-step-missing": (None, ["--ckpt-step", "5"], ["--ckpt-step 5 names iteration 5"]),
    "corrupt-tracker": (
        lambda root: _edit(os.path.join(root, TRACKER_FILENAME), "banana\n"),
        [],
        ["holds 'banana', not an iteration number"],
    ),
    "no-metadata": (
        lambda root: os.remove(os.path.join(root, ITER_3, ".metadata")),
        [],
        ["iter_0000003 is incomplete (no .metadata)"],
    ),
    "no-common": (
        lambda root: os.remove(os.path.join(root, ITER_3, "common.pt")),
        [],
        ["iter_0000003 is incomplete (no common.pt)"],
    ),
    "truncated-common": (
        lambda root: _truncate(os.path.join(root, ITER_3, "common.pt")),
        [],
        ["common.pt cannot be read", "damaged"],
    ),
    "missing-shard": (
        lambda root: os.remove(os.path.join(root, ITER_3, "__1_0.distcp")),
        [],
        ["iter_0000003 is incomplete: __1_0.distcp is missing"],
    ),
    "truncated-shard": (
        lambda root: _truncate(os.path.join(root, ITER_3, "__0_0.distcp")),
        [],
        ["iter_0000003 is incomplete: __0_0.distcp has "],
    ),
    "weights-only": (
        lambda root: (
            shutil.move(os.path.join(root, ITER_3), os.path.join(root, "adam")),
            _weights_only(os.path.join(root, "adam"), os.path.join(root, ITER_3)),
            shutil.rmtree(os.path.join(root, "adam")),
        ),
        [],
        ["holds no optimizer state", "pass --no-load-optim or --finetune"],
    ),
    "renamed-iteration": (
        lambda root: (
            os.rename(os.path.join(root, ITER_3), os.path.join(root, "iter_0000005")),
            _edit(os.path.join(root, TRACKER_FILENAME), "5\n"),
        ),
        [],
        ["iter_0000005 holds the checkpoint of iteration 3, not 5"],
    ),
    "bf16-ddp-engine-from-fp32-fsdp": (
        None,
        ["--bf16"],
        ["fp32 master weights do not fit", "lacks 28 of them", "--no-load-optim"],
    ),
    "other-optimizer": (
        None,
        ["--optimizer", "sgd"],
        ["optimizer is of another kind", "'betas'", "'momentum'", "--no-load-optim"],
    ),
}


DDP_ENGINE_LOADS = {"bf16-ddp-engine-from-fp32-fsdp"}
"""Cases that load the ZeRO-3 checkpoint into the DDP engine."""


@pytest.mark.parametrize("case", BAD_LOADS)
def test_bad_load_fails_naming_the_difference_and_leaves_the_directory(
    case, tmp_path, zero3_first_half
):
    edit, extra, fragments = BAD_LOADS[case]
    root = str(tmp_path / "ckpt")
    shutil.copytree(zero3_first_half, root)
    if edit is not None:
        edit(root)
    before = _hashes(root)
    engine = [] if case in DDP_ENGINE_LOADS else ZERO3
    flags = [*RUN, *engine, "--load", root, *(f.format(root=root) for f in extra)]
    errors = run_distributed(_main_error, 2, flags)
    for error in errors:
        assert error is not None, "loaded a bad checkpoint"
        kind, message = error
        assert kind == CheckpointError.__name__, message
        for fragment in fragments:
            assert fragment in message, message
    assert _hashes(root) == before


def test_weights_only_checkpoint_loads_with_no_load_optim(tmp_path, zero3_first_half):
    source = os.path.join(zero3_first_half, ITER_3)
    root = str(tmp_path / "ckpt")
    _weights_only(source, os.path.join(root, ITER_3))
    _edit(os.path.join(root, TRACKER_FILENAME), "3\n")
    flags = [*RUN, *ZERO3, "--load", root, "--no-load-optim"]
    history, observed = run_distributed(_main_observing_load, 2, flags)[0]
    assert observed["iteration"] == 3 and history.start_iteration == 3
    _assert_same(observed["weights"], _read_whole(source, str(tmp_path))["model"])
    # No RNG states in it: the generators keep their seeded states.
    assert torch.equal(observed["rng_after"], observed["rng_before"])
    assert observed["optimizer_state"] == 0 and len(history.losses) == 3


def test_load_of_the_empty_save_directory_starts_from_scratch(tmp_path, straight_runs):
    root = str(tmp_path)
    assert os.listdir(root) == []
    history = run_distributed(_main, 2, [*RUN, *ZERO3, "--load", root, "--save", root])[0]
    assert history.start_iteration == 0
    _assert_histories_equal(history, straight_runs("fsdp_zero3"))
    assert _read_tracker(root) == "6\n"


LOAD_OPTIONS = ["--finetune", "--no-load-optim", "--no-load-rng"]


@pytest.mark.parametrize("option", LOAD_OPTIONS)
def test_load_options(option, tmp_path, straight_runs, zero3_first_half):
    """--finetune: weights only, iteration 0, fresh optimizer, schedule and data. --no-load-optim:
    weights, iteration, data position and RNG, fresh optimizer and schedule. --no-load-rng:
    everything but the RNG states."""
    straight = straight_runs("fsdp_zero3")
    path = os.path.join(zero3_first_half, ITER_3)
    before = _hashes(zero3_first_half)
    flags = [*RUN, *ZERO3, "--load", zero3_first_half, option]
    results = run_distributed(_main_observing_load, 2, flags)
    saved = _read_whole(path, str(tmp_path))
    common = torch.load(os.path.join(path, "common.pt"), weights_only=False)
    for rank, (history, observed) in enumerate(results):
        _assert_same(observed["weights"], saved["model"], f"rank {rank} weights")
        saved_rng = common["rng_state"][rank][observed["rng"]]
        rng_loaded = torch.equal(observed["rng_after"], saved_rng)
        rng_kept = torch.equal(observed["rng_after"], observed["rng_before"])
        if option == "--finetune":
            assert observed["iteration"] == 0 and history.start_iteration == 0
            assert observed["consumed"] == (0, 0)
            assert observed["optimizer_state"] == 0 and observed["scheduler_steps"] == 0
            assert rng_kept and not rng_loaded
            assert len(history.losses) == 6
            # A new run from the weights: the schedule starts again, and is the straight one.
            assert history.learning_rates == straight.learning_rates
            assert history.losses[0] != straight.losses[0]  # other weights than at the start
        elif option == "--no-load-optim":
            assert observed["iteration"] == 3 and history.start_iteration == 3
            assert observed["consumed"] == (24, 8)
            assert observed["optimizer_state"] == 0 and observed["scheduler_steps"] == 0
            assert rng_loaded and not rng_kept
            # Same weights, samples and dropout masks: the 4th loss is the straight run's; then
            # the fresh optimizer (and restarted schedule) takes another step.
            assert history.losses[0] == straight.losses[3]
            assert history.losses[1] != straight.losses[4]
        else:
            assert observed["iteration"] == 3 and observed["consumed"] == (24, 8)
            assert observed["optimizer_state"] > 0 and observed["scheduler_steps"] == 3
            assert rng_kept and not rng_loaded
            # The same weights and samples, other dropout masks.
            assert history.losses[0] != straight.losses[3]
            assert history.learning_rates == straight.learning_rates[3:]
    assert _hashes(zero3_first_half) == before


# --- Without processes ---


def test_interrupted_replacement_is_restored_by_the_next_save(tmp_path):
    """A save replacing a committed checkpoint renames it aside, then renames the new one in:
    killed between the two, the next save puts the old one back instead of deleting it."""
    root = str(tmp_path)
    for name, content in [
        ("iter_0000004.replaced.tmp", "old 4"),  # its replacement never took its place
        ("iter_0000006.replaced.tmp", "old 6"),  # replaced: iter_0000006 is there
        ("iter_0000006", "new 6"),
        ("iter_0000008.tmp", "staging"),
    ]:
        os.makedirs(os.path.join(root, name))
        _edit(os.path.join(root, name, "common.pt"), content)
    args = argparse.Namespace(load=root, save=None, ckpt_step=4)
    with pytest.raises(CheckpointError, match="rename .*iter_0000004.replaced.tmp to"):
        checkpointing._check_complete(os.path.join(root, "iter_0000004"), 4, args)
    checkpointing._remove_leftovers(root)
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000006"]
    with open(os.path.join(root, "iter_0000004", "common.pt")) as file:
        assert file.read() == "old 4"
    with open(os.path.join(root, "iter_0000006", "common.pt")) as file:
        assert file.read() == "new 6"


def test_tracker_is_read_strictly(tmp_path):
    assert checkpointing.read_tracker(str(tmp_path)) is None
    _edit(os.path.join(tmp_path, TRACKER_FILENAME), " 12\n")
    assert checkpointing.read_tracker(str(tmp_path)) == 12
    _edit(os.path.join(tmp_path, TRACKER_FILENAME), "release")
    with pytest.raises(CheckpointError, match="'release', not an iteration number"):
        checkpointing.read_tracker(str(tmp_path))


def test_saved_tensor_paths_are_read_from_the_metadata(tmp_path):
    """`_saved_tensors` groups DCP's flattened keys by their top-level entry."""
    state = {
        "model": {"a.weight": torch.zeros(2, 3)},
        "optimizer": {
            "state": {"a.weight": {"exp_avg": torch.ones(2, 3), "step": torch.tensor(3.0)}}
        },
    }
    _save_in_this_process(state, str(tmp_path))
    saved = checkpointing._saved_tensors(FileSystemReader(str(tmp_path)).read_metadata())
    assert saved["model"] == {("a.weight",): (torch.Size([2, 3]), torch.float32)}
    assert saved["optimizer"] == {
        ("state", "a.weight", "exp_avg"): (torch.Size([2, 3]), torch.float32),
        ("state", "a.weight", "step"): (torch.Size([]), torch.float32),
    }


def test_which_checkpoint_the_tracker_names(tmp_path):
    """`--load` == `--save` without a committed checkpoint (missing, empty, or holding only an
    interrupted first save) starts from scratch; any other `--load` without a tracker fails."""
    root = str(tmp_path / "ckpt")

    def tracked(load: str, save: str | None) -> int | None:
        return checkpointing._tracked_iteration(argparse.Namespace(load=load, save=save))

    assert tracked(root, root) is None  # not created yet
    os.makedirs(os.path.join(root, "iter_0000002.tmp"))
    assert tracked(root, root + "/") is None
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt"):
        tracked(root, None)
    with pytest.raises(CheckpointError, match="missing: no such directory"):
        tracked(root + "/missing", None)
    os.makedirs(os.path.join(root, "iter_0000004"))
    with pytest.raises(CheckpointError, match="It holds iter_0000004: pass --ckpt-step"):
        tracked(root, root)
    _edit(os.path.join(root, TRACKER_FILENAME), "4\n")
    assert tracked(root, None) == 4
