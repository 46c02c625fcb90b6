"""Checkpoints read and written in one process, without a process group: what the conversion
tools share (`tools/convert_checkpoint.py`, `tools/convert_hf.py`).

`find_checkpoint` resolves `--load` and `--ckpt-step` to a complete checkpoint directory,
`read_checkpoint` reads its tensors whole (all of them, or those a caller selects), and
`write_checkpoint` writes one in the layout `checkpoint_layout` describes, atomically: into
`iter_N.tmp`, renamed `iter_N` before the tracker file names it. Nothing is overwritten without
`force` (`check_writable` says what would be). Like a training save, `write_checkpoint` records
the checksums of every file it writes, and `find_checkpoint` verifies them.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlanner

from megatron.training.checkpoint_checksums import (
    ChecksumWriter,
    save_with_checksum,
    verify_checkpoint,
    write_manifest,
)
from megatron.training.checkpoint_layout import (
    COMMON_FILENAME,
    REPLACED_SUFFIX,
    STAGING_SUFFIX,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_dir,
    commit_checkpoint,
    committed_iterations,
    read_metadata,
    read_tracker,
    require_complete,
    saved_entries,
    write_tracker,
)
from megatron.training.checkpoint_lock import hold_save_lock

_NO_PROCESS_GROUP = "torch.distributed is disabled"
"""The start of DCP's warning that it runs in one process: this module's intent, not news."""


def find_checkpoint(root: str, ckpt_step: int | None) -> str:
    """The directory of the complete checkpoint of `ckpt_step` (None: the tracker's) under
    `root`, its files checked against the checksums of its save (a checkpoint saved without
    them gets a note).

    Raises:
        CheckpointError: `root` or the checkpoint is missing, or the checkpoint is incomplete
            or damaged.
    """
    if not os.path.exists(root):
        raise CheckpointError(
            f"--load {root}: no such directory. Pass the --save directory of a training run."
        )
    if not os.path.isdir(root):
        raise CheckpointError(
            f"--load {root} is a file, not a checkpoint directory; pass the --save directory "
            "of a training run (to convert a torch.save file, use from-torch)."
        )
    committed = committed_iterations(root)
    if ckpt_step is None:
        ckpt_step = read_tracker(root)
    if ckpt_step is None:
        if _is_checkpoint(root):
            raise CheckpointError(
                f"--load {root} is one checkpoint's directory: pass the directory it is in, "
                f"--load {os.path.dirname(os.path.abspath(root))}, with --ckpt-step."
            )
        held = f"; it holds iterations {committed}: pass --ckpt-step" if committed else ""
        raise CheckpointError(
            f"--load {root} is not a checkpoint directory: it has no {TRACKER_FILENAME}{held}. "
            "Pass the --save directory of a training run."
        )
    path = checkpoint_dir(root, ckpt_step)
    if not os.path.isdir(path):
        held = f"it holds iterations {committed}" if committed else "it holds no checkpoint"
        raise CheckpointError(
            f"{path} does not exist ({held}); pass --ckpt-step with one of those iterations."
        )
    require_complete(path, "Convert another iteration with --ckpt-step.")
    read_metadata(path)  # first: a missing or short file is named as such
    verify_checkpoint(path, "Convert another iteration with --ckpt-step.", print)
    return path


def read_checkpoint(
    path: str, select: Callable[[tuple[str, ...]], bool] | None = None
) -> dict[str, Any]:
    """The tensors of the checkpoint directory `path`, whole and on the CPU, nested as they
    were saved: `{"model": {...}, "optimizer": {...}}`.

    Args:
        path: A complete checkpoint directory (`find_checkpoint`).
        select: Reads only the entries whose nesting (e.g. `("model", "output_layer.weight")`)
            it accepts; None reads every entry. Only what is read is held in memory.

    Raises:
        CheckpointError: no model tensor is selected, or the tensors cannot be read (a missing
            or damaged file).
    """
    metadata = read_metadata(path)  # also checks that every data file is there, long enough
    state: dict[str, Any] = {}
    for nesting, item in saved_entries(metadata).items():
        if select is not None and not select(nesting):
            continue
        # A whole tensor of the global shape: DCP fills it from every rank's shards. Anything
        # else was saved as bytes; DCP puts the object itself in place of the None.
        value = None
        if isinstance(item, TensorStorageMetadata):
            value = torch.empty(item.size, dtype=item.properties.dtype)
        node = state
        for name in nesting[:-1]:
            node = node.setdefault(name, {})
        node[nesting[-1]] = value
    if "model" not in state:
        raise CheckpointError(f"{path} holds no model tensors: it is not a training checkpoint.")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP)
            dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        cause = error
        if isinstance(error, CheckpointException) and error.failures:
            cause = next(iter(error.failures.values()))[0]  # the one process's error
        first_line = (str(cause).splitlines() or [""])[0]
        raise CheckpointError(
            f"The tensors of {path} cannot be read ({type(cause).__name__}: {first_line}); its "
            "files are damaged. Convert another iteration with --ckpt-step."
        ) from error
    return state


def check_save_root(root: str) -> None:
    """Raises `CheckpointError` if `--save` `root` is a file."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--save {root} is a file, not a directory; pass a directory.")


def check_writable(
    root: str, iteration: int, force: bool, iteration_option: str | None = "--iteration"
) -> str:
    """Checks that the checkpoint of `iteration` can be written under `root`; returns its
    directory. The messages suggest the tool's `iteration_option` (None: it has none).

    Raises:
        CheckpointError: `root` is a file (`check_save_root`), the checkpoint exists (without
            `force`), the leftover of an interrupted replacement of it is there, or the tracker
            names a newer iteration (without `force`).
    """
    check_save_root(root)
    final = checkpoint_dir(root, iteration)
    another = f"another {iteration_option}, " if iteration_option else ""
    if os.path.exists(final) and not force:
        raise CheckpointError(
            f"{final} exists already; pass --force to replace it, {another}or another --save "
            "directory."
        )
    _check_no_replaced_leftover(final)
    previous = read_tracker(root) if os.path.isdir(root) else None
    if previous is not None and previous > iteration and not force:
        raise CheckpointError(
            f"{root}'s {TRACKER_FILENAME} names iteration {previous}, newer than {iteration}: "
            "pointing it at this one would make --load take the older checkpoint. Pass --force "
            f"to do so, {f'a higher {iteration_option}, ' if iteration_option else ''}or another "
            "--save directory."
        )
    return final


def write_checkpoint(
    root: str,
    state: dict[str, Any],
    common: dict[str, Any],
    force: bool,
    *,
    planner: SavePlanner | None = None,
    one_file_per_tensor: bool = False,
    iteration_option: str | None = "--iteration",
) -> str:
    """Writes `state` (`{"model": {...}}`, and `"optimizer"` if any) and `common` as the
    checkpoint of `common["iteration"]` under `root`, and points the tracker file at it.

    Args:
        root: The `--save` directory (created).
        state: The tensors, nested as a training save nests them.
        common: The checkpoint's `common.pt` (`make_common`).
        force: Replace an existing checkpoint of that iteration, and point the tracker back
            at it if it names a newer one.
        planner: DCP's save planner (None: its default); one that produces each tensor when
            DCP writes it lets `state` hold meta tensors (their shape and dtype) instead.
        one_file_per_tensor: One data file per tensor instead of one for all: DCP keeps the
            tensors of a file alive until the file is written, so this bounds the memory by
            the largest tensor.
        iteration_option: The tool's option for another iteration, which messages suggest.

    Returns:
        The checkpoint's directory.

    Raises:
        CheckpointError: as `check_writable`, or a training run holds the directory's lock
            (`checkpoint_lock`); nothing was written.
    """
    check_save_root(root)  # before the lock creates it
    # Under the directory's lock: never beside a training run (or another conversion) there.
    with hold_save_lock(root):
        return _write_checkpoint(
            root, state, common, force, planner, one_file_per_tensor, iteration_option
        )


def _write_checkpoint(
    root: str,
    state: dict[str, Any],
    common: dict[str, Any],
    force: bool,
    planner: SavePlanner | None,
    one_file_per_tensor: bool,
    iteration_option: str | None,
) -> str:
    """`write_checkpoint()`, under the lock of `root`."""
    iteration = common["iteration"]
    final = check_writable(root, iteration, force, iteration_option)
    previous = read_tracker(root) if os.path.isdir(root) else None
    staging = final + STAGING_SUFFIX
    os.makedirs(root, exist_ok=True)
    if os.path.exists(staging):
        # This tool's own leftover (an interrupted conversion): never committed. Other
        # iterations' leftovers are left to the next training save.
        shutil.rmtree(staging)
    os.makedirs(staging)
    # As load_checkpoint() tells them apart: by the parameter groups, as an optimizer may have
    # no tensor to save (SGD without momentum).
    weights_only = common["param_groups"] is None
    print(f"> writing {final}{' (model weights only)' if weights_only else ''}")
    writer = ChecksumWriter(staging, single_file_per_rank=not one_file_per_tensor)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP)
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        checksums = writer.checksums
        checksums[COMMON_FILENAME] = save_with_checksum(
            common, os.path.join(staging, COMMON_FILENAME)
        )
        write_manifest(staging, checksums, read_metadata(staging))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    commit_checkpoint(staging, final)  # replaces an existing `final` (--force) as a save does
    write_tracker(root, iteration)
    if previous is not None and previous != iteration:
        print(f"> {TRACKER_FILENAME} named iteration {previous}, now {iteration}")
    if weights_only:
        print(
            "> the checkpoint has no optimizer state: load it with --finetune (or --no-load-optim)"
        )
    return final


def _check_no_replaced_leftover(final: str) -> None:
    """Refuses to write `final` next to the leftover of an interrupted replacement of it (a
    save or `--force` conversion stopped inside `commit_checkpoint()`), which may be its only
    copy."""
    leftover = final + REPLACED_SUFFIX
    if not os.path.exists(leftover):
        return
    fix = (
        f"remove it ({final} replaced it)"
        if os.path.exists(final)
        else f"rename it {final} (its replacement never took its place)"
    )
    raise CheckpointError(
        f"{leftover} is left from an interrupted replacement of {final}: {fix}, then convert again."
    )


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMMON_FILENAME))
