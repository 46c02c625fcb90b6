"""Training checkpoints: `save_checkpoint()` and `load_checkpoint()` (Megatron-LM's names).

A `--save` directory holds::

    latest_checkpointed_iteration.txt   the newest complete checkpoint's iteration (Megatron-LM's
                                        tracker file), replaced last and atomically
    iter_0000100/                       one checkpoint
        .metadata, __0_0.distcp, ...    torch.distributed.checkpoint (DCP): the tensors
        common.pt                       the rest (written by rank 0): iteration, consumed
                                        samples, arguments, schedule, optimizer hyperparameters,
                                        every rank's RNG states

The tensors are `"model"`, the unwrapped model's state dict, and `"optimizer"`,
`MegatronOptimizer.sharded_state_dict()`: states keyed by parameter name, sharded as the
parameters are. Under Megatron-FSDP the model's state dict is its DTensor main weights, so each
rank writes only its shards and no rank gathers the model; under the DDP engine the (replicated)
tensors are written once. Both `--ckpt-format`s, `fsdp_dtensor` (Megatron-FSDP's) and
`torch_dist`, are this DCP layout. Loading asks DCP for this rank's shards of the tensors of the
model and optimizer it has now, so a checkpoint loads at another data-parallel size or sharding
strategy (DCP reads the overlapping parts of the saved shards).

A save is atomic: every rank writes into `iter_N.tmp`, which rank 0 renames `iter_N` once all
have finished, before it replaces the tracker. A crash or kill at any point leaves the previous
checkpoint and the tracker as they were; the next save removes the leftover `.tmp` directories
(and puts back a checkpoint it was replacing, if killed between the two renames). Loading reads
only, and checks the checkpoint (its files, the model's arguments, tensor names and shapes, the
optimizer's parameter groups) before it reads a tensor, naming what differs.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import time
from typing import Any

import numpy
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.utils import print_rank_0

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMMON_FILENAME = "common.pt"
STAGING_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced" + STAGING_SUFFIX
CHECKPOINT_VERSION = 1

MODEL_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "padded_vocab_size",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
    "apply_residual_connection_post_layernorm",
    "transformer_impl",
)
"""Arguments a checkpoint's model must share with the model loading it: they fix its shapes
or what its weights mean."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not fit the model; the message says which
    and what to do."""


def checkpoint_dir(root: str, iteration: int) -> str:
    """The directory of the checkpoint of `iteration` under `root`."""
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """The iteration the tracker file of `root` names; None without a tracker file.

    Raises:
        CheckpointError: the tracker does not hold an iteration number.
    """
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as tracker:
        text = tracker.read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(
            f"{path} holds {text!r}, not an iteration number; write the iteration of a "
            "complete checkpoint directory (iter_NNNNNNN) into it, or pass --ckpt-step."
        ) from None


def save_checkpoint(
    iteration: int,
    model: torch.nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
) -> None:
    """Saves the training state after `iteration` under `args.save`; every rank calls it.

    Args:
        iteration: the iterations done.
        model: the wrapped model (its `state_dict()` is the unwrapped module's).
        optimizer: its `sharded_state_dict()` is saved.
        scheduler: the learning-rate and weight-decay schedule.
        args: `save`, `ckpt_format`, `consumed_train_samples`, `consumed_valid_samples`, and
            the arguments `load_checkpoint()` checks.
    """
    root = args.save
    final = checkpoint_dir(root, iteration)
    staging = final + STAGING_SUFFIX
    print_rank_0(f"> saving checkpoint at iteration {iteration} to {root} ({args.ckpt_format})")
    start = time.perf_counter()
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        _remove_leftovers(root)
        os.makedirs(staging)
    dist.barrier()

    optimizer_state = optimizer.sharded_state_dict()
    param_groups = optimizer_state.pop("param_groups")
    dcp.save(
        {"model": model.state_dict(), "optimizer": optimizer_state},
        storage_writer=FileSystemWriter(staging),
    )
    rng_states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rng_states, _rng_state())
    if rank == 0:
        common = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "ckpt_format": args.ckpt_format,
            "iteration": iteration,
            "consumed_train_samples": args.consumed_train_samples,
            "consumed_valid_samples": args.consumed_valid_samples,
            "args": vars(args).copy(),
            "opt_param_scheduler": scheduler.state_dict(),
            "param_groups": param_groups,
            "rng_state": rng_states,
        }
        atomic_torch_save(common, os.path.join(staging, COMMON_FILENAME))
    dist.barrier()  # every rank's shards are on disk

    if rank == 0:
        commit_checkpoint(staging, final)
        atomic_write_text(os.path.join(root, TRACKER_FILENAME), f"{iteration}\n")
    dist.barrier()
    size = _directory_bytes(final) if rank == 0 else 0
    print_rank_0(
        f"> saved checkpoint at iteration {iteration} to {final} in "
        f"{time.perf_counter() - start:.2f} s ({size / 2**30:.3f} GiB on disk)"
    )


def load_checkpoint(
    model: torch.nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
) -> int:
    """Loads the checkpoint `args.load` names into the model, optimizer and schedule, and sets
    `args.consumed_train_samples` and `args.consumed_valid_samples`; every rank calls it.

    Which checkpoint: iteration `args.ckpt_step` if set, else the tracker's. With
    `args.finetune` only the model's weights load and training starts at iteration 0; with
    `args.no_load_optim` the optimizer state and schedule do not load; with `args.no_load_rng`
    the random generators keep their state. When `--load` is the `--save` directory and holds
    no checkpoint yet, nothing loads (the first run of a job that resumes itself).

    Returns:
        The iteration to continue after (0 when nothing loaded or with `finetune`).

    Raises:
        CheckpointError: the checkpoint is missing, incomplete, or of another model; nothing
            is written, and the model is unchanged if the error is about the checkpoint.
    """
    root = args.load
    iteration = args.ckpt_step if args.ckpt_step is not None else _tracked_iteration(args)
    if iteration is None:
        print_rank_0(f"> no checkpoint in {root} yet: training starts from scratch")
        return 0
    path = checkpoint_dir(root, iteration)
    _check_complete(path, iteration, args)
    print_rank_0(f"> loading checkpoint from {path}")
    start = time.perf_counter()
    common = read_common(path)
    if common.get("iteration") != iteration:
        # Training would go on from one iteration with the schedule and data of another.
        raise CheckpointError(
            f"{path} holds the checkpoint of iteration {common.get('iteration')}, not "
            f"{iteration}: the directory was renamed. Rename it back, or rewrite its iteration "
            "with tools/convert_checkpoint.py (--iteration)."
        )
    _check_arguments(common, path, args)
    metadata = read_metadata(path)
    saved = _saved_tensors(metadata)
    model_state = model.state_dict()
    _check_model_tensors(model_state, saved.get("model", {}), path)

    load_optimizer = not (args.finetune or args.no_load_optim)
    state: dict[str, Any] = {"model": model_state}
    groups = None
    if load_optimizer:
        # The parameter groups say whether optimizer state was saved: an optimizer may have
        # no tensor to save (SGD without momentum; fp32 parameters under the DDP engine
        # before a step), so the tensors cannot say it.
        groups = common.get("param_groups")
        if groups is None:
            raise CheckpointError(
                f"{path} holds no optimizer state (it was written from model weights only); "
                "pass --no-load-optim or --finetune to load just the weights."
            )
        try:  # every check before the first tensor is read: a misfit leaves the model as is
            optimizer.check_param_groups(groups)
            state["optimizer"] = optimizer.sharded_state_dict_for_loading(
                saved.get("optimizer", {})
            )
        except ValueError as error:
            raise CheckpointError(f"{path}: {error}") from error
    dcp.load(state, storage_reader=FileSystemReader(path))
    model.load_state_dict(model_state)  # marks Megatron-FSDP's compute weights stale
    if load_optimizer:
        optimizer.load_sharded_state_dict({**state["optimizer"], "param_groups": groups})
        scheduler.load_state_dict(common["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()

    if args.finetune:
        iteration = 0
        args.consumed_train_samples = args.consumed_valid_samples = 0
    else:
        args.consumed_train_samples = common["consumed_train_samples"]
        args.consumed_valid_samples = common["consumed_valid_samples"]
        if not args.no_load_rng:
            _set_rng_state(common.get("rng_state") or [], path)
    print_rank_0(
        f"> loaded checkpoint of iteration {common['iteration']} in "
        f"{time.perf_counter() - start:.2f} s; continuing after iteration {iteration}"
    )
    return iteration


def _tracked_iteration(args: argparse.Namespace) -> int | None:
    """The tracker's iteration; None when `--load` is the `--save` directory with nothing in it
    yet.

    Raises:
        CheckpointError: `--load` does not exist or holds no tracker.
    """
    root = args.load
    iteration = read_tracker(root)
    if iteration is not None:
        return iteration
    fresh = args.save is not None and os.path.abspath(root) == os.path.abspath(args.save)
    committed = sorted(glob.glob(os.path.join(root, "iter_[0-9]*[0-9]")))
    if fresh and not committed:
        return None
    if not os.path.isdir(root):
        raise CheckpointError(
            f"--load {root}: no such directory. Pass the --save directory of an earlier run."
        )
    hint = (
        f" It holds {os.path.basename(committed[-1])}: pass --ckpt-step to load one."
        if committed
        else ""
    )
    raise CheckpointError(f"--load {root} holds no {TRACKER_FILENAME}, so no checkpoint.{hint}")


def _check_complete(path: str, iteration: int, args: argparse.Namespace) -> None:
    source = (
        f"--ckpt-step {iteration}"
        if args.ckpt_step is not None
        else os.path.join(args.load, TRACKER_FILENAME)
    )
    if not os.path.isdir(path):
        replaced = (
            f" A save replacing it was interrupted: rename {path + REPLACED_SUFFIX} to {path} "
            "(the next save into this directory does so too)."
            if os.path.isdir(path + REPLACED_SUFFIX)
            else ""
        )
        raise CheckpointError(
            f"{source} names iteration {iteration}, but {path} does not exist; pass "
            f"--ckpt-step with the iteration of an iter_NNNNNNN directory there.{replaced}"
        )
    missing = [f for f in (".metadata", COMMON_FILENAME) if not os.path.isfile(f"{path}/{f}")]
    if missing:
        raise CheckpointError(
            f"{path} is incomplete (no {', '.join(missing)}): it was not written by a finished "
            "save. Load another iteration with --ckpt-step."
        )


def _check_arguments(common: dict[str, Any], path: str, args: argparse.Namespace) -> None:
    version = common.get("checkpoint_version")
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {version}; this code reads version "
            f"{CHECKPOINT_VERSION}. Export its weights (tools/convert_checkpoint.py to-torch "
            "--model-only, then from-torch) and load them with --finetune."
        )
    saved = common["args"]
    differ = [
        f"--{name.replace('_', '-')} {saved.get(name)} (here {getattr(args, name)})"
        for name in MODEL_ARGS
        if name in saved and saved.get(name) != getattr(args, name, None)
    ]
    if differ:
        raise CheckpointError(
            f"{path} is of another model: it was saved with {'; '.join(differ)}. Pass the "
            "checkpoint's values, or load another checkpoint."
        )


def read_common(path: str) -> dict[str, Any]:
    """The checkpoint's `common.pt`.

    Raises:
        CheckpointError: it is not a readable dict (truncated or overwritten).
    """
    file = os.path.join(path, COMMON_FILENAME)
    try:
        common = torch.load(  # our own pickle: Python objects (RNG states, arguments)
            file, map_location="cpu", weights_only=False
        )
    except Exception as error:  # unpickling fails in many ways; each means a damaged file
        raise CheckpointError(
            f"{file} cannot be read ({type(error).__name__}: {error}); the checkpoint is "
            "damaged. Load another iteration with --ckpt-step."
        ) from error
    if not isinstance(common, dict):
        raise CheckpointError(
            f"{file} holds a {type(common).__name__}, not the dict a save writes; load another "
            "iteration with --ckpt-step."
        )
    return common


def read_metadata(path: str) -> Metadata:
    """The checkpoint's DCP metadata, once every data file it names is there and long enough
    (checked before any tensor is read, so a damaged checkpoint leaves the model as it was).

    Raises:
        CheckpointError: `.metadata` cannot be read, or a data file is missing or short.
    """
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # unpickling fails in many ways; each means a damaged file
        raise CheckpointError(
            f"{path}/.metadata cannot be read ({type(error).__name__}: {error}); the checkpoint "
            "is damaged. Load another iteration with --ckpt-step."
        ) from error
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    damaged = []
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            damaged.append(f"{name} is missing")
        elif os.path.getsize(file) < size:
            damaged.append(f"{name} has {os.path.getsize(file)} of {size} bytes")
    if damaged:
        raise CheckpointError(
            f"{path} is incomplete: {'; '.join(damaged[:3])}. Load another iteration with "
            "--ckpt-step."
        )
    return metadata


def _saved_tensors(metadata: Metadata) -> dict[str, dict[tuple[str, ...], tuple]]:
    """Each saved tensor's path below its top-level entry ("model", "optimizer") -> (global
    shape, dtype), grouped by that entry."""
    saved: dict[str, dict[tuple[str, ...], tuple]] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        path = metadata.planner_data[key]  # the state dict's nesting DCP flattened
        saved.setdefault(path[0], {})[tuple(path[1:])] = (item.size, item.properties.dtype)
    return saved


def _check_model_tensors(
    model_state: dict[str, Any], saved: dict[tuple[str, ...], tuple], path: str
) -> None:
    expected = {
        name: tensor.shape
        for name, tensor in model_state.items()
        if isinstance(tensor, torch.Tensor)
    }
    shapes = {names[0]: size for names, (size, _) in saved.items()}
    missing = sorted(expected.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - expected.keys())
    reshaped = [
        f"{name}: saved {list(shapes[name])}, model {list(shape)}"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    problems = []
    if reshaped:
        problems.append(f"{len(reshaped)} tensor(s) differ in shape ({'; '.join(reshaped[:3])})")
    if missing:
        problems.append(f"missing from it: {missing[:5]}")
    if unexpected:
        problems.append(f"not in this model: {unexpected[:5]}")
    if problems:
        raise CheckpointError(
            f"{path} does not fit this model: {', '.join(problems)}. Build the model with the "
            "checkpoint's arguments, or load another checkpoint."
        )


def _rng_state() -> dict[str, Any]:
    state = {
        "random": random.getstate(),
        "numpy": numpy.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(states: list[dict[str, Any]], path: str) -> None:
    """This rank's saved generator states; rank 0's when the world size changed (Megatron's
    ranks of one model replica share their seeds, and so their states). None saved (a
    checkpoint converted from model weights): the generators keep their state."""
    if not states:
        print_rank_0(f"> {path} holds no RNG states: the random generators keep theirs")
        return
    rank = dist.get_rank()
    if len(states) != dist.get_world_size():
        print_rank_0(
            f"> the checkpoint has the RNG states of {len(states)} ranks, this run "
            f"{dist.get_world_size()}: every rank takes rank 0's"
        )
        rank = 0
    state = states[rank]
    random.setstate(state["random"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _remove_leftovers(root: str) -> None:
    """Removes what interrupted saves left under `root`: their staging directories (never
    committed) and replaced checkpoints, except one whose replacement never took its place
    (interrupted between `commit_checkpoint()`'s two renames), which goes back where it was."""
    for leftover in sorted(glob.glob(os.path.join(root, f"iter_*{STAGING_SUFFIX}"))):
        if leftover.endswith(REPLACED_SUFFIX):
            original = leftover[: -len(REPLACED_SUFFIX)]
            if not os.path.exists(original):
                os.rename(leftover, original)
                _fsync_directory(root)
                continue
        shutil.rmtree(leftover)


def commit_checkpoint(staging: str, final: str) -> None:
    """Renames the finished `staging` directory `final`, replacing an older one (moved aside
    first, so a kill between the renames leaves it to `_remove_leftovers` to put back)."""
    replaced = final + REPLACED_SUFFIX
    if os.path.exists(final):
        os.rename(final, replaced)
    os.rename(staging, final)
    _fsync_directory(os.path.dirname(final))
    if os.path.exists(replaced):
        shutil.rmtree(replaced)


def atomic_torch_save(obj: Any, path: str) -> None:
    """`torch.save(obj)` to `path` through a temporary file, fsynced and renamed: `path` is
    the old file or the whole new one, never part of it."""
    temporary = path + STAGING_SUFFIX
    with open(temporary, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def atomic_write_text(path: str, text: str) -> None:
    """Writes `text` to `path` as `atomic_torch_save` does, and makes the rename durable."""
    temporary = path + STAGING_SUFFIX
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(os.path.dirname(path))


def _fsync_directory(path: str) -> None:
    """Makes renames inside `path` durable (a crash right after must not undo them)."""
    descriptor = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _directory_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(path)
        for name in names
    )
