"""Training checkpoints: `save_checkpoint()` and `load_checkpoint()` (Megatron-LM's names).

A checkpoint (`checkpoint_layout` describes the files) holds the tensors `"model"`, the unwrapped
model's state dict, and `"optimizer"`, `MegatronOptimizer.sharded_state_dict()`: states keyed by
parameter name, sharded as the parameters are. Under Megatron-FSDP the model's state dict is its
DTensor main weights, so each rank writes only its shards and no rank gathers the model; under the
DDP engine the (replicated) tensors are written once. The model's state dict also holds non-tensor
values, modules' `_extra_state` (the FP8 delayed-scaling states, `decoder.fp8_state._extra_state`
and with multi-token prediction `mtp.fp8_state._extra_state`), which DCP writes once as bytes; an
entry the checkpoint lacks (one saved without FP8 delayed scaling) is not read and its module starts
from its initial state, and an entry this model lacks is not read either. Both `--ckpt-format`s,
`fsdp_dtensor` (Megatron-FSDP's) and `torch_dist`, are this layout. Loading asks
torch.distributed.checkpoint for this rank's shards of the tensors of the model and optimizer it has
now, so a checkpoint loads at another data-parallel size or sharding strategy (DCP reads the
overlapping parts of the saved shards). Under pipeline parallelism each rank saves its stage's
tensors under the whole model's names (`checkpoint_stages`), so the checkpoint is the one a run
without stages writes, and loads at any pipeline size.

A save is atomic: every rank writes into `iter_N.tmp`, which rank 0 renames `iter_N` once all
have finished and it has checked that every rank's files are there, before it replaces the
tracker. A crash or kill at any point leaves the previous checkpoint and the tracker as they
were; the next save removes the leftover `.tmp` directories (and puts back a checkpoint it was
replacing, if killed between the two renames), holding the directory's lock (`checkpoint_lock`:
the run's, or its own), so never another job's save in progress. A step that fails on rank 0
fails the save on every rank. Each rank records the checksums of the files it writes
(`checkpoint_checksums`), and rank 0 lists them all in `checksums.json` before the commit.

Loading reads only, and checks the checkpoint (its files and their checksums, the model's
arguments, tensor names and shapes, the schedule, the optimizer's parameter groups) before it
reads a tensor, naming what differs (a schedule in the flags that set it); every rank raises
the same error. Tensors only the model or only the checkpoint holds are refused, logged or passed
over as `--dist-ckpt-strictness` says (`checkpoint_strictness`): `log_all` loads the tensors both
hold and logs the rest. Which runs may save into a directory that holds checkpoints (those that
resume them) is `save_directory`'s rule.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megatron.core.distributed.tensor_parallel_params import (
    restore_after_load,
    stride_free_for_checkpoint,
)
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, ScheduleMismatchError
from megatron.core.pipeline_parallel.stage import Model, model_chunks
from megatron.training.checkpoint_checksums import (
    ChecksumWriter,
    FileChecksum,
    damaged,
    read_manifest,
    save_with_checksum,
    unverified_note,
    verify_files,
    write_manifest,
)
from megatron.training.checkpoint_layout import (
    CHECKPOINT_VERSION,
    COMMON_FILENAME,
    REPLACED_SUFFIX,
    STAGING_SUFFIX,
    TRACKER_FILENAME,
    CheckpointError,
    check_replaceable,
    checkpoint_dir,
    commit_checkpoint,
    committed_iterations,
    directory_bytes,
    holds_checkpoint,
    make_common,
    read_common,
    read_metadata,
    read_tracker,
    remove_leftovers,
    require_complete,
    saved_entries,
    write_tracker,
)
from megatron.training.checkpoint_lock import hold_save_lock
from megatron.training.checkpoint_rng import rng_state, set_rng_state
from megatron.training.checkpoint_stages import (
    load_stage_state,
    merge_param_groups,
    raise_on_every_rank,
    saved_optimizer_tensors_here,
    stage_state,
    whole_model_shapes,
    without_copies,
)
from megatron.training.checkpoint_strictness import check_model_tensors, loading_strictness
from megatron.training.flag_groups.moe import resolved_moe_args
from megatron.training.flag_groups.optimization import describe_schedule_mismatch
from megatron.training.flag_groups.yarn import YARN_DEFAULTS
from megatron.training.rank_0_step import on_rank_0
from megatron.training.train_state import TrainState
from megatron.training.utils import print_rank_0

GPT_OSS_MODEL_ARGS: dict[str, Any] = {
    "window_size": None,
    "window_attn_skip_freq": None,
    "softmax_type": "vanilla",
    "quick_geglu": False,
    "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None,
}
"""The sliding-window, softmax-sink and GLU flags (gpt-oss's) among the `MODEL_ARGS`, with their
defaults: the model a checkpoint saved before these flags existed computes."""

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
    "layernorm_epsilon",
    "layernorm_zero_centered_gamma",
    "qk_layernorm",
    "qk_l2_norm",
    "squared_relu",
    "rotary_interleaved",
    "use_rope_scaling",
    "rotary_seq_len_interpolation_factor",
    *GPT_OSS_MODEL_ARGS,
    "multi_latent_attention",
)
"""Arguments a checkpoint's model must share with the model loading it: they fix its shapes
or what its weights mean."""

MLA_MODEL_ARGS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
)
"""The same for multi-latent attention: its shapes and its rotary embedding (checked where the
checkpoint recorded them, when both models have it: without it these flags describe nothing)."""

YARN_MODEL_ARGS = tuple(YARN_DEFAULTS)
"""The same for YaRN positions (`--position-embedding-type yarn`, checked when both models
have them): the flags that set its frequencies and concentration factor."""

MOE_MODEL_ARGS = (
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_enable_expert_bias",
    "moe_shared_expert_gate",
)
"""The same for the MoE layers: their shapes, which layers they are, and the routing the router
weights were trained for (checked where the checkpoint recorded them). Not the parallel sizes:
expert tensors are saved whole (`[num_experts, ...]`), so a checkpoint loads at any
--expert-model-parallel-size."""

MTP_MODEL_ARGS = ("mtp_num_layers",)
"""The same for the multi-token prediction depths (checked where the checkpoint recorded them;
a checkpoint saved before they existed has none, which the tensor check names)."""

_FLAG_NAMES = {
    "layernorm_epsilon": "--norm-epsilon",
    "layernorm_zero_centered_gamma": "--apply-layernorm-1p",
}
"""The flags of the `MODEL_ARGS` whose names are not their destinations'."""


def save_checkpoint(
    train_state: TrainState | int,
    model: Model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
    *,
    checksums: bool = True,
) -> None:
    """Saves the training state after `train_state.iteration` under `args.save`; every rank
    calls it.

    Args:
        train_state: the run's progress (its iteration names the checkpoint); an int, as
            Megatron-LM's callers pass, is the iterations done with nothing else counted
            (`TrainState(iteration=...)`).
        model: the wrapped model (its `state_dict()` is the unwrapped module's), or the list
            of this rank's model chunks (virtual pipeline stages).
        optimizer: its `sharded_state_dict()` is saved.
        scheduler: the learning-rate and weight-decay schedule.
        args: `save`, `ckpt_format`, and the arguments `load_checkpoint()` checks.
        checksums: record the files' checksums; False only to measure what they cost
            (`tools/benchmark_checkpoint.py`): the checkpoint then loads unverified.
    """
    if isinstance(train_state, int):
        train_state = TrainState(iteration=train_state)
    # Rank 0 holds the lock of --save while it saves: the run's (`pretrain()` holds it), else
    # its own. Leftovers are removed only under it, so never another job's save in progress.
    with contextlib.ExitStack() as lock:
        _save(train_state, model, optimizer, scheduler, args, checksums, lock)


def _save(
    train_state: TrainState,
    model: Model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
    checksums: bool,
    lock: contextlib.ExitStack,
) -> None:
    """`save_checkpoint()`, whose rank 0 enters the lock of `--save` into `lock`."""
    iteration = train_state.iteration
    root = args.save
    final = checkpoint_dir(root, iteration)
    staging = final + STAGING_SUFFIX
    print_rank_0(f"> saving checkpoint at iteration {iteration} to {root} ({args.ckpt_format})")
    start = time.perf_counter()
    rank = dist.get_rank()

    def prepare() -> None:
        lock.enter_context(hold_save_lock(root))  # creates root
        remove_leftovers(root)
        check_replaceable(final)
        check_replaceable(staging)
        os.makedirs(staging)

    _on_rank_0(prepare, f"creating {staging}")
    model_state = stage_state(model)
    optimizer_state = without_copies(optimizer.sharded_state_dict(), model_state.copies)
    param_groups = optimizer_state.pop("param_groups")
    writer = ChecksumWriter(staging) if checksums else FileSystemWriter(staging)
    state = {"model": model_state.saved(), "optimizer": optimizer_state}
    stride_free_for_checkpoint(state)
    dcp.save(state, storage_writer=writer)
    # Per rank: its RNG states, the checksums of the files it wrote, and its optimizer's
    # parameter groups (a pipeline stage's hold its part of the model).
    per_rank: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    written = writer.checksums if checksums else {}
    dist.gather_object((rng_state(), written, param_groups), per_rank, dst=0)
    files: dict[str, FileChecksum] = {}

    def write_common() -> None:
        common = make_common(
            train_state,
            ckpt_format=args.ckpt_format,
            args=vars(args).copy(),
            opt_param_scheduler=scheduler.state_dict(),
            param_groups=merge_param_groups([groups for _, _, groups in per_rank]),
            rng_state=[states for states, _, _ in per_rank],
        )
        for _, rank_files, _ in per_rank:
            files.update(rank_files)
        files[COMMON_FILENAME] = save_with_checksum(common, os.path.join(staging, COMMON_FILENAME))

    _on_rank_0(write_common, f"writing {COMMON_FILENAME}")

    def commit() -> None:
        # Every rank's files must be where rank 0 sees them before the tracker names them.
        try:
            metadata = read_metadata(staging)
        except CheckpointError as error:
            raise CheckpointError(
                f"{error} Every rank wrote its shards, but not all are in {staging} as rank 0 "
                "sees it: --save must be a directory every rank shares (a shared filesystem)."
            ) from error
        if checksums:
            write_manifest(staging, files, metadata)
        commit_checkpoint(staging, final)
        write_tracker(root, iteration)

    _on_rank_0(commit, f"committing {final}")
    size = directory_bytes(final) if rank == 0 else 0
    print_rank_0(
        f"> saved checkpoint at iteration {iteration} to {final} in "
        f"{time.perf_counter() - start:.2f} s ({size / 2**30:.3f} GiB on disk)"
    )


def load_checkpoint(
    model: Model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
    *,
    checksums: bool = True,
) -> TrainState:
    """Loads the checkpoint `args.load` names into the model, optimizer and schedule, and
    returns its training progress (`TrainState`); every rank calls it.

    Which checkpoint: iteration `args.ckpt_step` if set, else the tracker's, of `args.load`; of
    `args.pretrained_checkpoint` (as with `finetune`) while `args.load` holds none. With
    `args.finetune` only the model's weights load and training starts at iteration 0; with
    `args.no_load_optim` the optimizer state and schedule do not load; with `args.no_load_rng`
    the random generators keep their state. When `--load` is the `--save` directory and holds
    no checkpoint yet, nothing loads (the first run of a job that resumes itself), unless
    `args.exit_on_missing_checkpoint`.

    Args:
        model: the wrapped model the weights load into, or the list of this rank's model
            chunks.
        optimizer: loads the optimizer state (unless finetuning or `no_load_optim`).
        scheduler: loads the learning-rate and weight-decay schedule (likewise).
        args: the flags above, and those `_check_arguments` compares.
        checksums: verify the files against the checksums their save recorded; False only to
            measure what that costs (`tools/benchmark_checkpoint.py`).

    Returns:
        The progress to continue from: the checkpoint's iteration, consumed samples, skipped
        and nan iteration counts and FLOPs so far (those a checkpoint saved before they existed
        lacks are 0). A fresh `TrainState` when nothing loaded; when finetuning, one at
        iteration 0 that keeps only the FLOPs so far (as Megatron-LM).

    Raises:
        CheckpointError: the checkpoint is missing, incomplete, damaged, or of another model;
            nothing is written, and the model is unchanged.
    """
    root, flag_name, finetune = _checkpoint_source(args)
    iteration = args.ckpt_step
    if iteration is None:
        iteration = _tracked_iteration(root, flag_name, args.save)
    if iteration is None:
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(
                f"{flag_name} {root} holds no checkpoint yet, and --exit-on-missing-checkpoint "
                "is set: pass the --save directory of an earlier run, or drop the flag to train "
                "from scratch."
            )
        print_rank_0(f"> no checkpoint in {root} yet: training starts from scratch")
        return TrainState()
    path = checkpoint_dir(root, iteration)
    _check_complete(path, iteration, root, args.ckpt_step)
    print_rank_0(f"> loading checkpoint from {path}")
    start = time.perf_counter()
    metadata = read_metadata(path)  # first: a missing or short file is named as such
    if checksums:
        _verify_checksums(path, _another_iteration(root, iteration))
    common = read_common(path)
    if common.get("iteration") != iteration:
        # Training would go on from one iteration with the schedule and data of another.
        raise CheckpointError(
            f"{path} holds the checkpoint of iteration {common.get('iteration')}, not "
            f"{iteration}: the directory was renamed. Rename it back, or rewrite its iteration "
            "with tools/convert_checkpoint.py (--iteration)."
        )
    _check_arguments(common, path, args)
    try:
        saved_state = TrainState.from_state_dict(common)
    except ValueError as error:
        raise CheckpointError(f"{path}: {error}") from error
    saved = _saved_tensors(metadata)
    stage = stage_state(model)
    model_state = stage.values
    strictness = loading_strictness(args.dist_ckpt_strictness)
    whole_shapes = whole_model_shapes(stage, model_chunks(model)[0].config)
    absent, extra = check_model_tensors(whole_shapes, saved.get("model", {}), path, strictness)
    # Tensors of the whole model that other pipeline stages hold.
    elsewhere = whole_shapes.keys() - model_state.keys()
    _leave_out_unsaved_objects(model_state, metadata)

    load_optimizer = not (finetune or args.no_load_optim)
    if load_optimizer and (absent or extra):
        raise CheckpointError(
            f"{path} and this model do not hold the same tensors (--dist-ckpt-strictness "
            f"{strictness.value} tolerates it for the weights), so the optimizer state, kept "
            "per parameter, does not load: pass --no-load-optim (or --finetune) to load the "
            "weights that match."
        )
    # The model's tensors the checkpoint lacks keep their values (DCP is not asked for them).
    state: dict[str, Any] = {
        "model": {name: value for name, value in model_state.items() if name not in absent}
    }
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
        mismatch: CheckpointError | None = None
        try:  # every check before the first tensor is read: a misfit leaves the model as is
            # The groups first: the schedule's check compares their bounds group by group.
            groups = optimizer.stage_param_groups(groups, elsewhere)
            optimizer.check_param_groups(groups)
            scheduler.check_state_dict(common["opt_param_scheduler"], groups)
            state["optimizer"] = optimizer.sharded_state_dict_for_loading(
                saved_optimizer_tensors_here(saved.get("optimizer", {}), elsewhere)
            )
        except ScheduleMismatchError as error:
            mismatch = CheckpointError(
                f"{path} was saved with another learning-rate schedule: "
                f"{describe_schedule_mismatch(error, common.get('args') or {}, args)}"
            )
            mismatch.__cause__ = error
        except ValueError as error:
            mismatch = CheckpointError(f"{path}: {error}")
            mismatch.__cause__ = error
        # Each rank checked its own part of the optimizer (a pipeline stage's).
        raise_on_every_rank(mismatch)
    swaps = stride_free_for_checkpoint(state, values=False)
    dcp.load(state, storage_reader=FileSystemReader(path))
    restore_after_load(swaps)
    unfit = None
    try:
        # DCP fills tensors in place but replaces non-tensor entries (extra states) in
        # `state`; the tensors the checkpoint lacks come from `model_state`, as they were.
        # Marks Megatron-FSDP's compute weights stale.
        load_stage_state(model, stage, {**model_state, **state["model"]})
    except ValueError as error:
        # A module's extra state that does not fit it (an FP8 delayed-scaling state with
        # another number of slots). The tensor check above refuses another model before
        # anything is read, so only an extra state written by other code gets here, after the
        # weights were read.
        unfit = CheckpointError(f"{path} does not fit this model: {error}")
        unfit.__cause__ = error
    # A stage's own extra states can fail on its ranks only.
    raise_on_every_rank(unfit)
    if load_optimizer:
        optimizer.load_sharded_state_dict({**state["optimizer"], "param_groups": groups})
        scheduler.load_state_dict(common["opt_param_scheduler"], groups)
    else:
        optimizer.reload_model_params()

    if finetune:
        train_state = TrainState(
            num_floating_point_operations_so_far=saved_state.num_floating_point_operations_so_far
        )
    else:
        train_state = saved_state
        if not args.no_load_rng:
            set_rng_state(common.get("rng_state") or [], path)
    print_rank_0(
        f"> loaded checkpoint of iteration {common['iteration']} in "
        f"{time.perf_counter() - start:.2f} s; continuing after iteration {train_state.iteration}"
    )
    return train_state


def _checkpoint_source(args: argparse.Namespace) -> tuple[str, str, bool]:
    """The directory to load from, its flag, and whether the run finetunes from it:
    `--pretrained-checkpoint` while `--load` holds no checkpoint (Megatron-LM's rule), else
    `--load`."""
    pretrained = args.pretrained_checkpoint
    if pretrained is not None and not holds_checkpoint(args.load):
        print_rank_0(
            f"> --load {args.load} holds no checkpoint yet: finetuning from "
            f"--pretrained-checkpoint {pretrained}"
        )
        return pretrained, "--pretrained-checkpoint", True
    return args.load, "--load", args.finetune


def _tracked_iteration(root: str, flag_name: str, save: str | None) -> int | None:
    """The tracker's iteration under `root` (the directory of `flag_name`); None when `root`
    is the `save` directory with nothing in it yet.

    Raises:
        CheckpointError: `root` does not exist or holds no tracker.
    """
    iteration = read_tracker(root)
    if iteration is not None:
        return iteration
    fresh = save is not None and os.path.abspath(root) == os.path.abspath(save)
    committed = committed_iterations(root)
    if fresh and not committed:
        return None
    if not os.path.isdir(root):
        raise CheckpointError(
            f"{flag_name} {root}: no such directory. Pass the --save directory of an earlier run."
        )
    hint = f" It holds iterations {committed}: pass --ckpt-step to load one." if committed else ""
    raise CheckpointError(
        f"{flag_name} {root} holds no {TRACKER_FILENAME}, so no checkpoint.{hint}"
    )


def _check_complete(path: str, iteration: int, root: str, ckpt_step: int | None) -> None:
    source = (
        f"--ckpt-step {iteration}"
        if ckpt_step is not None
        else os.path.join(root, TRACKER_FILENAME)
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
    require_complete(path, "Load another iteration with --ckpt-step.")


def _another_iteration(root: str, iteration: int) -> str:
    """The advice to load another checkpoint of `root` than the one of `iteration`."""
    others = [other for other in committed_iterations(root) if other != iteration]
    held = f"{root} holds iterations {others}" if others else f"{root} holds no other"
    return f"Load another iteration with --ckpt-step ({held})."


def _verify_checksums(path: str, fix: str) -> None:
    """Checks the files of the checkpoint `path` against the checksums its save recorded:
    each file once, by one rank (a rank's own shards by that rank, so that at the same world
    size they are in its page cache for the load), and every rank raises the same error.

    Raises:
        CheckpointError: the checksums file is damaged, or a file does not match (`fix` ends
            the message).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    manifest: list[Any] = [None]
    if rank == 0:
        try:
            manifest[0] = read_manifest(path)
        except CheckpointError as error:
            manifest[0] = f"{error} {fix}"
    dist.broadcast_object_list(manifest, src=0)
    checksums = manifest[0]
    if isinstance(checksums, str):
        raise CheckpointError(checksums)
    if checksums is None:
        print_rank_0(unverified_note(path))
        return
    mine = [name for name in checksums if _verifying_rank(name, world_size) == rank]
    problems: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(problems, verify_files(path, checksums, mine))
    found = sorted(problem for rank_problems in problems for problem in rank_problems)
    if found:
        raise damaged(path, found, fix)


def _verifying_rank(name: str, world_size: int) -> int:
    """The rank that verifies the file `name`: DCP names rank r's shards `__r_N.distcp`."""
    writer = re.match(r"__(\d+)_", name)
    return int(writer.group(1)) % world_size if writer else 0


def _check_arguments(common: dict[str, Any], path: str, args: argparse.Namespace) -> None:
    version = common.get("checkpoint_version")
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {version}; this code reads version "
            f"{CHECKPOINT_VERSION}. Export its weights (tools/convert_checkpoint.py to-torch "
            "--model-only, then from-torch) and load them with --finetune."
        )
    saved = common["args"]
    # What the model reads, not how it was spelled (--moe-ffn-hidden-size unset or its value).
    was, now = ({**values, **resolved_moe_args(values)} for values in (saved, vars(args)))
    mla = was.get("multi_latent_attention") and now.get("multi_latent_attention")
    yarn = was.get("position_embedding_type") == now.get("position_embedding_type") == "yarn"
    differ = [
        f"{_FLAG_NAMES.get(name, '--' + name.replace('_', '-'))} {was.get(name)} "
        f"(here {now.get(name)})"
        for name in (
            *MODEL_ARGS,
            *MOE_MODEL_ARGS,
            *MTP_MODEL_ARGS,
            *(MLA_MODEL_ARGS if mla else ()),
            *(YARN_MODEL_ARGS if yarn else ()),
        )
        if name in saved and was.get(name) != now.get(name)
    ]
    if differ:
        raise CheckpointError(
            f"{path} is of another model: it was saved with {'; '.join(differ)}. Pass the "
            f"checkpoint's values, or load another checkpoint.{_vocab_hint(saved, args)}"
        )


def _vocab_hint(saved: dict[str, Any], args: argparse.Namespace) -> str:
    """How to pad the vocabulary as the checkpoint did, when only the padding differs: it is a
    multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size, so a checkpoint
    saved at another TP size can pad to another size."""
    padded = saved.get("padded_vocab_size")
    tp = getattr(args, "tensor_model_parallel_size", 1)
    if padded in (None, getattr(args, "padded_vocab_size", None)) or padded % tp:
        return ""
    return (
        f" The vocabulary is padded to a multiple of --make-vocab-size-divisible-by x "
        f"--tensor-model-parallel-size; --make-vocab-size-divisible-by {padded // tp} pads it "
        f"to the checkpoint's {padded} at tensor-parallel size {tp}."
    )


def _saved_tensors(metadata: Metadata) -> dict[str, dict[tuple[str, ...], tuple]]:
    """Each saved tensor's path below its top-level entry ("model", "optimizer") -> (global
    shape, dtype), grouped by that entry."""
    saved: dict[str, dict[tuple[str, ...], tuple]] = {}
    for path, item in saved_entries(metadata).items():
        if isinstance(item, TensorStorageMetadata):
            saved.setdefault(path[0], {})[path[1:]] = (item.size, item.properties.dtype)
    return saved


def _leave_out_unsaved_objects(model_state: dict[str, Any], metadata: Metadata) -> None:
    """Removes from `model_state` its non-tensor entries (modules' `_extra_state`) that the
    checkpoint does not hold, so that DCP is not asked for them: the checkpoint of a run
    without FP8 delayed scaling loads into one with it, whose state module takes the missing
    entry as its initial state (`DelayedScalingState._load_from_state_dict`)."""
    saved = {path[1:] for path in saved_entries(metadata) if path[0] == "model"}
    for name in [
        name
        for name, value in model_state.items()
        if not isinstance(value, torch.Tensor) and (name,) not in saved
    ]:
        del model_state[name]


def _on_rank_0(step: Callable[[], None], what: str) -> None:
    """A step of a save on rank 0 alone (`on_rank_0`).

    Raises:
        CheckpointError: `step` raised on rank 0.
    """
    on_rank_0(
        step,
        lambda error: (
            f"Saving failed on rank 0 while {what} ({type(error).__name__}: {error}); the "
            "previous checkpoint and the tracker are unchanged."
        ),
    )
