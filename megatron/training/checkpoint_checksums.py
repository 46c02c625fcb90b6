"""Checksums of a checkpoint's files: recorded as a save writes them, verified before a load.

torch.distributed.checkpoint (DCP) keeps no checksums, so a flipped byte in a shard would load
silently. A save records the size of every file of the checkpoint directory and the CRC-32
(`zlib.crc32`, the fastest checksum in Python's standard library) of each `BLOCK_BYTES` block
of it: for the DCP shards and `.metadata` over the bytes as `ChecksumWriter` passes them to the
file (nothing is read back), for `common.pt` over the bytes `save_with_checksum` writes.
`write_manifest` lists them in `checksums.json` before the checkpoint is committed, so every
committed checkpoint of this code has one; a checkpoint saved before checksums existed has none
and loads unverified. Blocks, not whole files, so that `verify_files` reads the blocks of one
file on several threads (`zlib` releases the GIL).

CRC-32 detects accidental damage (every burst of up to 32 flipped bits, and all but one in
2**32 of other errors); it is no defence against deliberate tampering.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zlib
from collections.abc import Callable, Generator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from megatron.core.utils import write_atomically
from megatron.training.checkpoint_layout import COMMON_FILENAME, CheckpointError

CHECKSUMS_FILENAME = "checksums.json"
METADATA_FILENAME = ".metadata"
BLOCK_BYTES = 64 * 2**20
"""Every file's CRC-32 is taken per block of this many bytes (the last block shorter)."""
_ALGORITHM = "crc32"
_READ_CHUNK_BYTES = 16 * 2**20
_VERIFY_THREADS = min(8, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class FileChecksum:
    """A file's size in bytes and the CRC-32 of each `BLOCK_BYTES` block of it."""

    size: int
    blocks: tuple[int, ...]


class _BlockCrc:
    """The running checksum of bytes given in pieces of any size."""

    def __init__(self) -> None:
        self._size = 0
        self._blocks: list[int] = []
        self._crc = 0
        self._filled = 0

    def update(self, data: memoryview) -> None:
        while data:
            part = data[: BLOCK_BYTES - self._filled]
            self._crc = zlib.crc32(part, self._crc)
            self._filled += len(part)
            self._size += len(part)
            if self._filled == BLOCK_BYTES:
                self._blocks.append(self._crc)
                self._crc, self._filled = 0, 0
            data = data[len(part) :]

    def result(self) -> FileChecksum:
        last = [self._crc] if self._filled else []
        return FileChecksum(self._size, tuple(self._blocks + last))


def checksum_bytes(data: bytes | memoryview) -> FileChecksum:
    """The checksum of `data` as a file's content."""
    crc = _BlockCrc()
    crc.update(memoryview(data).cast("B"))
    return crc.result()


def checksum_file(path: str) -> FileChecksum:
    """The checksum of the file `path` as it is on disk.

    Raises:
        OSError: the file cannot be read.
    """
    size = os.path.getsize(path)
    return FileChecksum(size, tuple(_block_crc(path, i) for i in range(-(-size // BLOCK_BYTES))))


def _block_crc(path: str, index: int) -> int:
    """The CRC-32 of block `index` of the file `path`, read in chunks."""
    crc, left = 0, BLOCK_BYTES
    buffer = bytearray(min(_READ_CHUNK_BYTES, BLOCK_BYTES))
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        file.seek(index * BLOCK_BYTES)
        while left and (count := file.readinto(view[:left])):
            crc = zlib.crc32(view[:count], crc)
            left -= count
    return crc


class _ChecksumStream:
    """A binary file opened for writing that keeps the checksum of the bytes written through
    it (what DCP's writer calls on a stream: write, tell, flush, fileno, close)."""

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self.crc = _BlockCrc()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        self.crc.update(memoryview(data).cast("B")[:written])
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        # The file itself is closed by the `create_stream` context that opened it.
        self._raw.flush()


class _ChecksumFileSystem(FileSystem):
    """DCP's local file system, recording the checksum of every file written through it by
    its name (DCP writes one flat directory)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, FileChecksum] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            counted = _ChecksumStream(stream)
            yield counted
        # Reached only when the writer finished without an error. Each writer thread has
        # files of its own, and a dict assignment is atomic.
        self.written[os.path.basename(path)] = counted.crc.result()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        # `.metadata` is written under a temporary name and renamed.
        checksum = self.written.pop(os.path.basename(path), None)
        if checksum is not None:
            self.written[os.path.basename(new_path)] = checksum


class ChecksumWriter(FileSystemWriter):
    """A DCP `FileSystemWriter` that records the checksum of every file it writes (this
    rank's shards, and `.metadata` on the coordinator): `checksums` after the save."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = _ChecksumFileSystem()

    @property
    def checksums(self) -> dict[str, FileChecksum]:
        """File name -> checksum, of the files written so far."""
        return dict(self.fs.written)


def save_with_checksum(obj: Any, path: str) -> FileChecksum:
    """`torch.save(obj)` to `path` atomically and durably; the checksum of the bytes written."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getbuffer()
    write_atomically(path, lambda stream: stream.write(data), durable=True)
    return checksum_bytes(data)


def checkpoint_files(metadata: Metadata) -> set[str]:
    """The files a finished save leaves in a checkpoint directory (besides the checksums)."""
    shards = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return shards | {METADATA_FILENAME, COMMON_FILENAME}


def write_manifest(
    directory: str, checksums: Mapping[str, FileChecksum], metadata: Metadata
) -> None:
    """Writes `checksums.json` into the checkpoint `directory`, atomically and durably.

    Raises:
        CheckpointError: a file of the checkpoint has no recorded checksum.
    """
    unrecorded = sorted(checkpoint_files(metadata) - checksums.keys())
    if unrecorded:
        raise CheckpointError(
            f"No checksum was recorded for {unrecorded} of {directory}: the DCP writer did "
            "not write them through ChecksumWriter's file system (another torch version?)."
        )
    files = {
        name: {"bytes": checksum.size, _ALGORITHM: [f"{crc:08x}" for crc in checksum.blocks]}
        for name, checksum in sorted(checksums.items())
    }
    manifest = {"algorithm": _ALGORITHM, "block_bytes": BLOCK_BYTES, "files": files}
    text = json.dumps(manifest, indent=1) + "\n"
    write_atomically(
        os.path.join(directory, CHECKSUMS_FILENAME),
        lambda stream: stream.write(text.encode()),
        durable=True,
    )


def read_manifest(directory: str) -> dict[str, FileChecksum] | None:
    """The checksums `checksums.json` of the checkpoint `directory` lists; None without one
    (a checkpoint saved before checksums were recorded).

    Raises:
        CheckpointError: the file is damaged.
    """
    path = os.path.join(directory, CHECKSUMS_FILENAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as file:
            manifest = json.load(file)
        form = (manifest["algorithm"], manifest["block_bytes"])
        if form != (_ALGORITHM, BLOCK_BYTES):
            raise ValueError(f"(algorithm, block bytes) {form}, not {(_ALGORITHM, BLOCK_BYTES)}")
        checksums = {
            name: FileChecksum(
                int(entry["bytes"]), tuple(int(crc, 16) for crc in entry[_ALGORITHM])
            )
            for name, entry in manifest["files"].items()
        }
        if any(len(c.blocks) != -(-c.size // BLOCK_BYTES) for c in checksums.values()):
            raise ValueError("a file's block checksums do not match its size")
        return checksums
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(
            f"{path} cannot be read ({type(error).__name__}: {error}); the checkpoint is damaged."
        ) from error


def verify_files(
    directory: str, checksums: Mapping[str, FileChecksum], names: Iterable[str]
) -> list[str]:
    """Checks the files `names` of the checkpoint `directory` against their `checksums`, the
    blocks on several threads.

    Returns:
        What is wrong with each file that does not match, e.g. "__0_0.distcp bytes [0,
        67108864) have CRC-32 1a2b3c4d, but its save recorded 5e6f7a8b"; empty when all match.
    """
    problems = []
    blocks = []
    for name in sorted(names):
        expected = checksums[name]
        try:
            size = os.path.getsize(os.path.join(directory, name))
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as error:
            problems.append(f"{name} cannot be read ({error})")
            continue
        if size != expected.size:  # no need to read it
            problems.append(f"{name} has {size} bytes, but its save wrote {expected.size}")
        else:
            blocks += [(name, index) for index in range(len(expected.blocks))]

    def check(block: tuple[str, int]) -> str | None:
        name, index = block
        expected = checksums[name]
        try:
            crc = _block_crc(os.path.join(directory, name), index)
        except OSError as error:
            return f"{name} cannot be read ({error})"
        if crc == expected.blocks[index]:
            return None
        start = index * BLOCK_BYTES
        end = min(start + BLOCK_BYTES, expected.size)
        return (
            f"{name} bytes [{start}, {end}) have CRC-32 {crc:08x}, but its save recorded "
            f"{expected.blocks[index]:08x}"
        )

    with ThreadPoolExecutor(_VERIFY_THREADS) as pool:
        found = [problem for problem in pool.map(check, blocks) if problem is not None]
    return problems + found


def damaged(directory: str, problems: list[str], fix: str) -> CheckpointError:
    """The error for files of the checkpoint `directory` that do not match their checksums."""
    listed = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if problems[3:] else "")
    return CheckpointError(f"{directory} is damaged: {listed}. {fix}")


def verify_checkpoint(directory: str, fix: str, note: Callable[[str], None]) -> None:
    """Checks every file of the checkpoint `directory` against its checksum, in this process
    (`megatron.training.checkpointing` spreads the files over the ranks instead).

    Args:
        directory: the checkpoint (`iter_NNNNNNN`) directory.
        fix: the sentence that ends the error (what to load instead).
        note: prints the note that a checkpoint without checksums is not verified.

    Raises:
        CheckpointError: the checksums file is damaged, or a file does not match it.
    """
    checksums = read_manifest(directory)
    if checksums is None:
        note(unverified_note(directory))
        return
    problems = verify_files(directory, checksums, checksums)
    if problems:
        raise damaged(directory, problems, fix)


def unverified_note(directory: str) -> str:
    """The note that the checkpoint `directory`, saved without checksums, is not verified."""
    return (
        f"> {directory} has no {CHECKSUMS_FILENAME} (saved before checkpoints recorded "
        "checksums): its files are not verified"
    )
