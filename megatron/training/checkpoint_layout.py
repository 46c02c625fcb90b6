"""The on-disk layout of training checkpoints, and the file operations that keep it intact.

A `--save` directory holds::

    latest_checkpointed_iteration.txt   the newest complete checkpoint's iteration (Megatron-LM's
                                        tracker file), replaced last and atomically
    iter_0000100/                       one checkpoint (`checkpoint_dir`)
        .metadata, __0_0.distcp, ...    torch.distributed.checkpoint (DCP): the tensors
        common.pt                       the rest (`make_common`): the progress (`TrainState`:
                                        iteration, consumed samples, skipped and nan iterations,
                                        FLOPs so far), arguments, schedule, optimizer
                                        hyperparameters, every rank's RNG states
        checksums.json                  the size and CRC-32 of each file above
                                        (`checkpoint_checksums`; absent from checkpoints saved
                                        before checksums were recorded)

A checkpoint is written into `iter_N.tmp` and renamed `iter_N` (`commit_checkpoint`) before the
tracker is replaced (`write_tracker`); `remove_leftovers` clears what an interrupted save
left. `megatron.training.checkpointing` saves and loads training state in this layout;
`tools/convert_checkpoint.py` reads and writes it in one process.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from megatron.core.utils import fsync_directory, write_atomically
from megatron.training.train_state import REQUIRED_KEYS, TrainState

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMMON_FILENAME = "common.pt"
STAGING_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced" + STAGING_SUFFIX
CHECKPOINT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not fit the model; the message says which
    and what to do."""


def make_common(
    train_state: TrainState | None = None,
    *,
    ckpt_format: str = "torch_dist",
    args: dict[str, Any] | None = None,
    opt_param_scheduler: dict[str, Any] | None = None,
    param_groups: list[dict[str, Any]] | None = None,
    rng_state: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A checkpoint's `common.pt`: the run's progress (`train_state`'s entries; None: a fresh
    state, iteration 0) and the rest. The defaults make a weights-only checkpoint's: no
    parameter groups (what marks it: an optimizer may have no tensor to save), no arguments
    (loading then checks only the tensors' names and shapes), no schedule, no RNG states."""
    return {
        "checkpoint_version": CHECKPOINT_VERSION,
        "ckpt_format": ckpt_format,
        **(train_state or TrainState()).state_dict(),
        "args": args or {},
        "opt_param_scheduler": opt_param_scheduler,
        "param_groups": param_groups,
        "rng_state": rng_state or [],
    }


COMMON_KEYS = tuple(make_common())
"""The entries of `common.pt` (a checkpoint saved before some of them existed lacks those of
`OPTIONAL_COMMON_KEYS`)."""
OPTIONAL_COMMON_KEYS = tuple(key for key in TrainState().state_dict() if key not in REQUIRED_KEYS)
"""The progress counts older checkpoints do not hold (`TrainState` starts them at 0)."""


def require_complete(path: str, fix: str) -> None:
    """Raises unless the checkpoint directory `path` holds what a finished save writes last.

    Raises:
        CheckpointError: `.metadata` or `common.pt` is missing; the message ends with `fix`.
    """
    missing = [f for f in (".metadata", COMMON_FILENAME) if not os.path.isfile(f"{path}/{f}")]
    if missing:
        raise CheckpointError(
            f"{path} is incomplete (no {', '.join(missing)}): it was not written by a finished "
            f"save. {fix}"
        )


def checkpoint_dir(root: str, iteration: int) -> str:
    """The directory of the checkpoint of `iteration` under `root`."""
    return os.path.join(root, f"iter_{iteration:07d}")


def committed_iterations(root: str) -> list[int]:
    """The iterations of the complete-by-name checkpoint directories under `root` (none when
    `root` does not exist), ascending; leftovers of interrupted saves are not among them."""
    if not os.path.isdir(root):
        return []
    names = (name for name in os.listdir(root) if name.startswith("iter_"))
    return sorted(int(name[5:]) for name in names if name[5:].isdigit())


def holds_checkpoint(root: str) -> bool:
    """Whether `root` holds a tracker file or a committed checkpoint directory."""
    return os.path.isfile(os.path.join(root, TRACKER_FILENAME)) or bool(committed_iterations(root))


SavedEntry = TensorStorageMetadata | BytesStorageMetadata
"""What DCP's metadata records of one saved entry: a tensor's shape and dtype, or bytes."""


def same_directory(first: str, second: str) -> bool:
    """Whether the two paths reach one directory, however spelled: the same file where both
    exist (a bind mount reaches a directory under another path, which no symbolic link
    tells), else the same path once symbolic links are resolved."""
    if os.path.exists(first) and os.path.exists(second):
        return os.path.samefile(first, second)
    return os.path.realpath(first) == os.path.realpath(second)


def saved_entries(metadata: Metadata) -> dict[tuple[str, ...], SavedEntry]:
    """Each saved entry's path in the nested state dict DCP flattened (e.g. `("model",
    "decoder.final_layernorm.weight")`) -> its storage metadata (tensor or bytes)."""
    nestings = metadata.planner_data or {}
    return {
        tuple(nestings.get(key, (key,))): item for key, item in metadata.state_dict_metadata.items()
    }


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


def remove_leftovers(root: str) -> None:
    """Removes what interrupted saves left under `root`: their staging directories (never
    committed) and replaced checkpoints, except one whose replacement never took its place
    (interrupted between `commit_checkpoint()`'s two renames), which goes back where it was.
    Files of those names were not written by a save: they stay."""
    for leftover in sorted(glob.glob(os.path.join(root, f"iter_*{STAGING_SUFFIX}"))):
        if not os.path.isdir(leftover) or os.path.islink(leftover):
            continue
        if leftover.endswith(REPLACED_SUFFIX):
            original = leftover[: -len(REPLACED_SUFFIX)]
            if not os.path.exists(original):
                os.rename(leftover, original)
                fsync_directory(root)
                continue
        shutil.rmtree(leftover)


def check_replaceable(path: str) -> None:
    """Raises `NotADirectoryError` if something other than a directory is at `path`, where a
    checkpoint directory goes (replacing a file would delete what no save wrote)."""
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
        raise NotADirectoryError(
            f"{path} is not a directory, where a checkpoint directory goes: move it away or "
            "write the checkpoint elsewhere."
        )


def commit_checkpoint(staging: str, final: str) -> None:
    """Renames the finished `staging` directory `final`, replacing an older one (moved aside
    first, so a kill between the renames leaves it to `remove_leftovers` to put back)."""
    final = os.path.normpath(final)  # "dir/" would be renamed into itself
    check_replaceable(final)
    replaced = final + REPLACED_SUFFIX
    if os.path.exists(final):
        os.rename(final, replaced)
    os.rename(staging, final)
    fsync_directory(os.path.dirname(final))
    if os.path.exists(replaced):
        shutil.rmtree(replaced)


def atomic_torch_save(obj: Any, path: str) -> None:
    """`torch.save(obj)` to `path` atomically and durably (`write_atomically`)."""
    write_atomically(path, lambda stream: torch.save(obj, stream), durable=True)


def write_tracker(root: str, iteration: int) -> None:
    """Points the tracker file of `root` at `iteration` (`read_tracker` reads it), atomically
    and durably (`write_atomically`): the last step of a save."""
    text = f"{iteration}\n"
    write_atomically(
        os.path.join(root, TRACKER_FILENAME),
        lambda stream: stream.write(text.encode()),
        durable=True,
    )


def directory_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(path)
        for name in names
    )
