"""The on-disk cache of dataset index arrays (`GPTDataset`'s and `BlendedDataset`'s).

Building the shuffled indices of a large corpus takes seconds to minutes, so, as Megatron-LM
does, each set of arrays is saved once as .npy files named
`<md5 of description>-<class>[-<split>]-<array>.npy`, beside a `...-description.txt` holding
the description (everything the arrays depend on). A later run, or another rank, with the same
description loads them memory-mapped.

Writes are atomic (a temporary file, then `os.replace`), and the description is written last,
so a run killed mid-write or ranks writing at once never leave a file that reads as a complete
cache. With `torch.distributed` initialised, rank 0 builds on a cache miss while the others
wait at a barrier, then load; a rank that still misses (no shared file system) builds too.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence

import numpy
import torch

from megatron.core.utils import write_atomically


def description_hash(description: str) -> str:
    """The MD5 hex digest of a description, which names its cache files."""
    return hashlib.md5(description.encode("utf-8")).hexdigest()


def default_cache_dir(dataset_path: str, class_name: str) -> str:
    """Megatron-LM's default cache folder: `cache/<class_name>_indices` beside the data."""
    return os.path.join(
        os.path.dirname(os.path.abspath(dataset_path)), "cache", f"{class_name}_indices"
    )


def load_or_build(
    cache_dir: str,
    base_name: str,
    description: str,
    names: Sequence[str],
    build: Callable[[], dict[str, numpy.ndarray]],
) -> tuple[dict[str, numpy.ndarray], bool]:
    """Load the arrays `names` cached under `base_name`, or build and cache them.

    With `torch.distributed` initialised this is a collective: every rank of the default group
    must call it, with the same description.

    Args:
        cache_dir: the cache folder (created when missing).
        base_name: the file-name stem, `<hash>-<class>[-<split>]`.
        description: what the arrays depend on; a cache whose description file differs (a hash
            collision, an edited file) is rebuilt.
        names: the arrays, keys of `build`'s result.
        build: makes the arrays.

    Returns:
        The arrays (memory-mapped when loaded) and whether this call built them.

    Raises:
        OSError: the cache cannot be written; the message names the folder and the fix.
    """
    paths = {name: os.path.join(cache_dir, f"{base_name}-{name}.npy") for name in names}
    description_path = os.path.join(cache_dir, f"{base_name}-description.txt")

    def cached() -> bool:
        if not all(os.path.isfile(path) for path in [description_path, *paths.values()]):
            return False
        with open(description_path, encoding="utf-8") as stream:
            return stream.read() == description

    def build_and_save() -> dict[str, numpy.ndarray]:
        arrays = build()
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for name, path in paths.items():
                write_atomically(path, lambda stream, a=arrays[name]: numpy.save(stream, a))
            write_atomically(description_path, lambda stream: stream.write(description.encode()))
        except OSError as error:
            raise OSError(
                f"Cannot write the dataset index cache in {cache_dir} ({error}); set "
                "GPTDatasetConfig.path_to_cache (--data-cache-path) to a writable folder."
            ) from error
        return arrays

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        arrays = None
        if torch.distributed.get_rank() == 0 and not cached():
            try:
                arrays = build_and_save()
            finally:
                # Reached on failure too, so the other ranks are not left waiting; they then
                # miss the cache and build (and most likely fail) themselves.
                torch.distributed.barrier()
            return arrays, True
        torch.distributed.barrier()
    if cached():
        return {name: _load(path) for name, path in paths.items()}, False
    return build_and_save(), True


def _load(path: str) -> numpy.ndarray:
    """A cached array, memory-mapped.

    Raises:
        ValueError: the file is damaged (truncated, overwritten); the message names it.
    """
    try:
        return numpy.load(path, mmap_mode="r")
    except (ValueError, OSError) as error:
        raise ValueError(
            f"The dataset index cache file {path} is damaged ({error}); delete it, or its "
            "folder, and it is built again."
        ) from error
