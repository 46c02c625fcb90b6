"""Small helpers shared across the library: writing files so that a crash never leaves a partial
one where a reader looks, and the tensor-in, tensor-out collectives under either torch's name."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import BinaryIO

import torch.distributed as dist

# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def write_atomically(
    path: str, write: Callable[[BinaryIO], object], *, durable: bool = False
) -> None:
    """Writes `path` through `write(stream)` into a temporary file beside it, renamed to `path`
    when complete (and removed if `write` fails): readers see the old file or the whole new one.

    Args:
        path: the file to (re)place.
        write: writes the content into a binary stream.
        durable: also fsync the file and its directory, so that a crash right after cannot undo
            the write (for files that commit a state, such as a checkpoint's).
    """
    temporary = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(temporary, "wb") as stream:
            write(stream)
            if durable:
                stream.flush()
                os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    if durable:
        fsync_directory(os.path.dirname(path))


def fsync_directory(path: str) -> None:
    """Makes the renames inside directory `path` durable (a crash right after keeps them)."""
    descriptor = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
