"""Megatron-LM's tokenized corpus on disk: an `IndexedDataset` reader and its writer.

A dataset is a pair of files sharing one path prefix, byte-compatible with Megatron-LM's MMap
format, so corpora preprocessed by either project load in both:

- `<prefix>.bin`: every sequence's token ids back to back, in one dtype, no header.
- `<prefix>.idx`: the magic `b"MMIDIDX\\x00\\x00"`, the version (`<Q` = 1), the dtype code
  (`<B`, `DTYPE_CODES`), the sequence count `<Q`, the document-index count `<Q`, then the
  sequence lengths (int32), the sequence pointers (int64 byte offsets into the .bin) and the
  document indices (int64 sequence-index boundaries: 0, then the end of each document); a
  multimodal index ends with one int8 mode per sequence (Megatron-LM's `multimodal=True`).

A document is one or more sequences (several when preprocessing splits sentences). The reader
memory-maps both files, so opening a corpus of any size costs almost nothing and reading a
sequence touches only its pages.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import struct
from collections.abc import Sequence
from typing import Any

import numpy
import torch

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""The magic bytes opening every .idx file."""

INDEX_VERSION = 1

DTYPE_CODES: dict[str, int] = {
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "float64": 6,
    "float32": 7,
    "uint16": 8,
}
"""Megatron-LM's `DType` codes: the .idx byte that names the .bin dtype."""

_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8

_PREPROCESS_HINT = "create it with tools/preprocess_data.py"

_CHECK_BLOCK = 1 << 22
"""Sequences checked at a time: bounds the temporary arrays of an index's check to ~100 MiB."""


def get_idx_path(path_prefix: str) -> str:
    """The index file of the dataset at `path_prefix`: `<prefix>.idx`."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """The data file of the dataset at `path_prefix`: `<prefix>.bin`."""
    return path_prefix + ".bin"


def optimal_dtype(vocab_size: int | None) -> type[numpy.number]:
    """The smallest token dtype for a vocabulary, as Megatron-LM's `DType.optimal_dtype`.

    Args:
        vocab_size: the number of token ids; None when unknown.

    Returns:
        numpy.uint16 below 65500 ids, numpy.int32 otherwise (or when unknown).
    """
    if vocab_size is not None and vocab_size < 65500:
        return numpy.uint16
    return numpy.int32


def dtype_code(dtype: Any) -> int:
    """Megatron-LM's code of a token dtype.

    Raises:
        ValueError: the dtype has no code (e.g. uint32, float16).
    """
    name = numpy.dtype(dtype).name
    if name not in DTYPE_CODES:
        raise ValueError(
            f"dtype {name} cannot be stored in an indexed dataset; use one of "
            f"{sorted(DTYPE_CODES)} (optimal_dtype(vocab_size) picks the smallest)."
        )
    return DTYPE_CODES[name]


def _dtype_from_code(code: int, idx_path: str) -> numpy.dtype:
    for name, value in DTYPE_CODES.items():
        if value == code:
            return numpy.dtype(name)
    raise ValueError(
        f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES.values())}); the file "
        f"is corrupt or not an indexed dataset index; {_PREPROCESS_HINT}."
    )


class _Index:
    """The parsed .idx file: dtype and the three index arrays (read-only, memory-mapped), and
    the sequence modes of a multimodal index (None otherwise).

    Args:
        idx_path: the .idx file.
        multimodal: read the sequence modes that end a multimodal index.
        check_sequences: check every sequence's length and pointer, and the document indices'
            order (`_check_sequences`); False where this process's parent checked the file.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file is not a valid index (the message names it and the fix).
    """

    def __init__(self, idx_path: str, multimodal: bool = False, check_sequences: bool = True):
        if not os.path.isfile(idx_path):
            raise FileNotFoundError(f"{idx_path} does not exist; {_PREPROCESS_HINT}.")
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES or header[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise ValueError(
                f"{idx_path} does not start with {INDEX_HEADER!r}, so it is not an indexed "
                f"dataset index (MMap format); {_PREPROCESS_HINT}."
            )
        version, code, sequence_count, document_count = struct.unpack(
            "<QBQQ", header[len(INDEX_HEADER) :]
        )
        if version != INDEX_VERSION:
            raise ValueError(
                f"{idx_path} has index version {version}; only version {INDEX_VERSION} is "
                f"supported; {_PREPROCESS_HINT}."
            )
        self.dtype = _dtype_from_code(code, idx_path)
        expected = _HEADER_BYTES + sequence_count * (4 + 8) + document_count * 8
        # A multimodal index adds one int8 mode per sequence; text readers ignore them, as
        # Megatron-LM's do.
        has_modes = size == expected + sequence_count and sequence_count > 0
        if size != expected and not has_modes:
            raise ValueError(
                f"{idx_path} holds {size} bytes, but its header ({sequence_count} sequences, "
                f"{document_count} document indices) needs {expected} ({expected + sequence_count}"
                f" with sequence modes): the file is truncated or corrupt; {_PREPROCESS_HINT}."
            )
        if multimodal and not has_modes:
            raise ValueError(
                f"{idx_path} has no sequence modes, so it is not a multimodal index; open it "
                "with multimodal=False."
            )
        buffer = numpy.memmap(idx_path, dtype=numpy.uint8, mode="r")
        offset = _HEADER_BYTES
        self.sequence_lengths = numpy.frombuffer(
            buffer, dtype=numpy.int32, count=sequence_count, offset=offset
        )
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = numpy.frombuffer(
            buffer, dtype=numpy.int64, count=sequence_count, offset=offset
        )
        offset += self.sequence_pointers.nbytes
        self.document_indices = numpy.frombuffer(
            buffer, dtype=numpy.int64, count=document_count, offset=offset
        )
        offset += self.document_indices.nbytes
        self.sequence_modes = (
            numpy.frombuffer(buffer, dtype=numpy.int8, count=sequence_count, offset=offset)
            if multimodal
            else None
        )
        if (
            document_count == 0
            or self.document_indices[0] != 0
            or self.document_indices[-1] != sequence_count
        ):
            raise ValueError(
                f"{idx_path}: the document indices must run from 0 to the sequence count "
                f"({sequence_count}); the file is corrupt; {_PREPROCESS_HINT}."
            )
        if check_sequences:
            self._check_sequences(idx_path)

    def _check_sequences(self, idx_path: str) -> None:
        """Checks that the sequences tile the .bin from its start, each beginning where the one
        before ends (as Megatron-LM's writer lays them out), and that the document indices do
        not decrease: a damaged length or pointer would otherwise read another sequence's
        tokens, or past the end of the .bin, far from here. Vectorised, in blocks of
        `_CHECK_BLOCK` sequences, so that memory stays bounded on indexes of billions.

        Raises:
            ValueError: naming the file, the first bad sequence (or document) and the fix.
        """
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        itemsize = self.dtype.itemsize

        def corrupt(what: str) -> ValueError:
            return ValueError(f"{idx_path}: {what}; the file is corrupt; {_PREPROCESS_HINT}.")

        if len(pointers) and pointers[0] != 0:
            raise corrupt(f"sequence 0 starts at byte {int(pointers[0])} of the .bin, not 0")
        for start in range(0, len(lengths), _CHECK_BLOCK):
            block = lengths[start : start + _CHECK_BLOCK]
            negative = numpy.flatnonzero(block < 0)
            if negative.size:
                i = start + int(negative[0])
                raise corrupt(f"sequence {i} has a negative length ({int(lengths[i])})")
            # Each pointer against the previous sequence's end (the last one's end is the
            # .bin's size, which IndexedDataset checks).
            stop = min(start + _CHECK_BLOCK, len(lengths) - 1)
            if stop <= start:
                break
            ends = pointers[start:stop] + lengths[start:stop].astype(numpy.int64) * itemsize
            bad = numpy.flatnonzero(pointers[start + 1 : stop + 1] != ends)
            if bad.size:
                i = start + int(bad[0])
                raise corrupt(
                    f"sequence {i} ({int(lengths[i])} tokens of {itemsize} bytes from byte "
                    f"{int(pointers[i])}) ends at byte {int(ends[bad[0]])}, but sequence "
                    f"{i + 1} starts at byte {int(pointers[i + 1])}"
                )
        documents = self.document_indices
        for start in range(0, len(documents) - 1, _CHECK_BLOCK):
            block = documents[start : start + _CHECK_BLOCK + 1]
            steps = numpy.flatnonzero(block[1:] < block[:-1])
            if steps.size:
                i = start + int(steps[0])
                raise corrupt(
                    f"document {i + 1} starts at sequence {int(documents[i + 1])}, before "
                    f"document {i} (sequence {int(documents[i])})"
                )

    def num_bytes(self) -> int:
        """Size the .bin must have: the end of the last sequence."""
        if len(self.sequence_lengths) == 0:
            return 0
        last_length = int(self.sequence_lengths[-1]) * self.dtype.itemsize
        return int(self.sequence_pointers[-1]) + last_length


class IndexedDataset(torch.utils.data.Dataset):
    """The sequences of a .bin/.idx pair, read in place (Megatron-LM's `IndexedDataset`).

    Item `i` is sequence `i` (a read-only numpy array of the file's dtype); a slice `[a:b]` (step
    1) is the list of those sequences, read at once. With `multimodal`, an item is `(sequence,
    mode)` and a slice `(sequences, modes)`, as Megatron-LM's. Pickling keeps only the prefix
    and options, so data-loader workers reopen the files instead of copying them.

    Args:
        path_prefix: the files are `<path_prefix>.bin` and `<path_prefix>.idx`.
        multimodal: read the sequence modes that end a multimodal index (a text reader, the
            default, ignores them).
        mmap: memory-map the .bin (the default); False reads each sequence with a file read,
            for file systems where mapping is slow or unavailable.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: the .idx is not a valid index (or has no modes with `multimodal`), or the
            .bin is shorter or longer than the index says (the message names the file).
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True):
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self._open()

    def _open(self, check_sequences: bool = True) -> None:
        bin_path = get_bin_path(self.path_prefix)
        self.index = _Index(get_idx_path(self.path_prefix), self.multimodal, check_sequences)
        if not os.path.isfile(bin_path):
            raise FileNotFoundError(f"{bin_path} does not exist; {_PREPROCESS_HINT}.")
        actual, expected = os.path.getsize(bin_path), self.index.num_bytes()
        if actual != expected:
            raise ValueError(
                f"{bin_path} holds {actual} bytes, but {get_idx_path(self.path_prefix)} "
                f"describes {expected}: the pair is truncated or from different runs, or the "
                f"last sequence's length is damaged; {_PREPROCESS_HINT}."
            )
        self._tokens: numpy.ndarray | None = None
        if self.mmap and actual > 0:
            # numpy cannot map an empty file; an empty dataset never reads tokens anyway.
            self._tokens = numpy.memmap(bin_path, dtype=self.index.dtype, mode="r")

    def __getstate__(self) -> dict[str, Any]:
        return {"path_prefix": self.path_prefix, "multimodal": self.multimodal, "mmap": self.mmap}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path_prefix = state["path_prefix"]
        self.multimodal = state["multimodal"]
        self.mmap = state["mmap"]
        # The process that pickled it checked every sequence already: a data-loader worker
        # need not read the whole index again.
        self._open(check_sequences=False)

    @property
    def dtype(self) -> numpy.dtype:
        """The token dtype of the .bin file."""
        return self.index.dtype

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """int32 [number of sequences]: tokens per sequence."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> numpy.ndarray:
        """int64 [number of sequences]: byte offset of each sequence in the .bin file."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> numpy.ndarray:
        """int64 [number of documents + 1]: document d is sequences [di[d], di[d + 1])."""
        return self.index.document_indices

    @property
    def sequence_modes(self) -> numpy.ndarray:
        """int8 [number of sequences]: each sequence's mode (a multimodal index only).

        Raises:
            ValueError: the dataset was not opened with `multimodal=True`.
        """
        if self.index.sequence_modes is None:
            raise ValueError(
                f"{self.path_prefix} was opened without multimodal=True; it has no modes."
            )
        return self.index.sequence_modes

    @functools.cached_property
    def index_digest(self) -> str:
        """The SHA-256 of the .idx file's bytes: everything the GPT indices depend on (sequence
        lengths, documents, dtype), so it keys their cache. About 1 s per 10^7 sequences, once
        per dataset object (the .bin, far larger, is not read)."""
        digest = hashlib.sha256()
        with open(get_idx_path(self.path_prefix), "rb") as stream:
            while block := stream.read(1 << 24):
                digest.update(block)
        return digest.hexdigest()

    def __len__(self) -> int:
        return len(self.index.sequence_lengths)

    def __getitem__(
        self, idx: int | numpy.integer | slice
    ) -> numpy.ndarray | tuple[Any, Any] | list[numpy.ndarray]:
        """Sequence `idx`, or the list of sequences of a slice (with `multimodal`, with their
        modes: `(sequence, mode)`, `(sequences, modes)`).

        Raises:
            IndexError: an index out of range.
            ValueError: a slice whose step is not 1.
            TypeError: an index that is neither an integer nor a slice.
        """
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(
                    f"slices of an IndexedDataset must be contiguous (step 1), not {idx}."
                )
            stop = max(start, stop)
            lengths = self.index.sequence_lengths[start:stop]
            sequences = []
            if stop > start:
                pointer = int(self.index.sequence_pointers[start])
                tokens = self._read(pointer, int(lengths.sum(dtype=numpy.int64)))
                sequences = numpy.split(tokens, numpy.cumsum(lengths[:-1], dtype=numpy.int64))
            if self.multimodal:
                return sequences, self.index.sequence_modes[start:stop]
            return sequences
        if not isinstance(idx, (int, numpy.integer)):
            raise TypeError(f"IndexedDataset index {idx!r}: an integer or a slice.")
        return self.get(int(idx))

    def get(
        self, idx: int, offset: int = 0, length: int | None = None
    ) -> numpy.ndarray | tuple[numpy.ndarray, numpy.int8]:
        """Tokens `offset` to `offset + length` of sequence `idx` (to its end when None); with
        `multimodal`, `(tokens, mode)`.

        Raises:
            IndexError: `idx` is out of range, or the span leaves the sequence.
        """
        if not -len(self) <= idx < len(self):
            raise IndexError(
                f"sequence {idx} is out of range [0, {len(self)}) of {self.path_prefix}"
            )
        sequence_length = int(self.index.sequence_lengths[idx])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) leave sequence {idx} of "
                f"{self.path_prefix}, which has {sequence_length}."
            )
        pointer = int(self.index.sequence_pointers[idx]) + offset * self.index.dtype.itemsize
        tokens = self._read(pointer, length)
        if self.multimodal:
            return tokens, self.index.sequence_modes[idx]
        return tokens

    def _read(self, pointer: int, count: int) -> numpy.ndarray:
        """`count` tokens from byte `pointer` of the .bin."""
        start = pointer // self.index.dtype.itemsize
        if self._tokens is not None:
            return numpy.asarray(self._tokens[start : start + count])
        with open(get_bin_path(self.path_prefix), "rb") as stream:
            stream.seek(pointer)
            return numpy.fromfile(stream, dtype=self.index.dtype, count=count)

    def max_token_id(self, chunk_tokens: int = 1 << 26) -> int | None:
        """The largest token id in the .bin (None when it holds none), read in chunks of
        `chunk_tokens`: about 0.1 s per GB from the page cache memory-mapped (0.2 s with file
        reads), else as fast as the disk reads."""
        if self._tokens is not None:
            tokens = self._tokens
            return max(
                int(tokens[start : start + chunk_tokens].max())
                for start in range(0, len(tokens), chunk_tokens)
            )
        largest = None
        buffer = numpy.empty(chunk_tokens, dtype=self.index.dtype)
        with open(get_bin_path(self.path_prefix), "rb") as stream:
            while count := stream.readinto(buffer) // buffer.itemsize:
                value = int(buffer[:count].max())
                largest = value if largest is None else max(largest, value)
        return largest

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both files of the dataset at `path_prefix` exist."""
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(
            get_bin_path(path_prefix)
        )


class IndexedDatasetBuilder:
    """Writes an `IndexedDataset`: sequences are appended to the .bin as they come, the index
    is written at `finalize`.

    Until `finalize`, the data goes to a temporary file beside `bin_path`; `finalize` writes
    the .idx under a temporary name too, then renames the .bin and the .idx into place (any
    old .idx is removed first). A run killed before that leaves no .idx that could pair with
    a partial .bin.

    Args:
        bin_path: the .bin file to create (usually `get_bin_path(prefix)`).
        dtype: the token dtype; `optimal_dtype(vocab_size)` gives the smallest one.
        multimodal: record a mode (int8) per sequence, written at the end of the .idx.

    Raises:
        ValueError: the dtype has no Megatron-LM code.
    """

    def __init__(self, bin_path: str, dtype: Any = numpy.int32, multimodal: bool = False):
        dtype_code(dtype)
        self.bin_path = bin_path
        self.dtype = numpy.dtype(dtype)
        self.multimodal = multimodal
        self._temp_bin_path = f"{bin_path}.tmp-{os.getpid()}"
        self._data_file = open(self._temp_bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.sequence_modes: list[int] | None = [] if multimodal else None

    def _as_array(self, tokens: Sequence[int] | numpy.ndarray | torch.Tensor) -> numpy.ndarray:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        array = numpy.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}.")
        if array.size and self.dtype.kind in "iu":
            info = numpy.iinfo(self.dtype)
            low, high = array.min(), array.max()
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids in [{low}, {high}] do not fit {self.dtype.name}; build with a "
                    "wider dtype (optimal_dtype(vocab_size) gives one for the vocabulary)."
                )
        return array.astype(self.dtype, copy=False)

    def add_item(self, tokens: Sequence[int] | numpy.ndarray | torch.Tensor, mode: int = 0) -> None:
        """Append one sequence (of the current document; see `end_document`), of `mode` in a
        multimodal dataset."""
        array = self._as_array(tokens)
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)
        if self.sequence_modes is not None:
            self.sequence_modes.append(int(mode))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last one."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(
        self,
        tokens: Sequence[int] | numpy.ndarray | torch.Tensor,
        lengths: Sequence[int],
        modes: Sequence[int] | None = None,
    ) -> None:
        """Append one whole document: `tokens` cut into sequences of `lengths` (of `modes` in a
        multimodal dataset; None: mode 0).

        Raises:
            ValueError: the lengths do not add up to the number of tokens, or the modes do not
                match the lengths.
        """
        array = self._as_array(tokens)
        if any(length < 0 for length in lengths) or sum(lengths) != array.size:
            raise ValueError(
                f"lengths {list(lengths)} must be non-negative and sum to the {array.size} tokens."
            )
        if modes is not None and len(modes) != len(lengths):
            raise ValueError(f"{len(modes)} modes for {len(lengths)} sequences; give one each.")
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(int(length) for length in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.sequence_modes is not None:
            self.sequence_modes.extend(int(m) for m in (modes or [0] * len(lengths)))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of the dataset at `path_prefix` (as Megatron-LM's merge).

        Raises:
            FileNotFoundError, ValueError: that dataset is missing or invalid (or has no modes
                for a multimodal builder), or its dtype is not this builder's.
        """
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if other.dtype != self.dtype:
            raise ValueError(
                f"{path_prefix} holds {other.dtype.name} tokens, this builder {self.dtype.name}; "
                "merge datasets of one dtype."
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((offset + other.document_indices[1:]).tolist())
        if self.sequence_modes is not None:
            self.sequence_modes.extend(other.sequence_modes.tolist())
        with open(get_bin_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._data_file)

    def abort(self) -> None:
        """Drop everything written so far (after an error): the temporary .bin is removed and
        any existing dataset at `bin_path` is left as it was."""
        self._data_file.close()
        if os.path.exists(self._temp_bin_path):
            os.remove(self._temp_bin_path)

    def finalize(self, idx_path: str) -> None:
        """Write the index to `idx_path` and move both files into place.

        Raises:
            ValueError: sequences were added after the last document ended (call
                `end_document` first); nothing is written.
        """
        if self.document_indices[-1] != len(self.sequence_lengths):
            pending = len(self.sequence_lengths) - self.document_indices[-1]
            raise ValueError(
                f"{pending} sequences were added after the last end_document(); call "
                "end_document() before finalize()."
            )
        self._data_file.close()
        lengths = numpy.array(self.sequence_lengths, dtype=numpy.int32)
        pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
        numpy.cumsum(lengths[:-1], dtype=numpy.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        documents = numpy.array(self.document_indices, dtype=numpy.int64)
        temp_idx_path = f"{idx_path}.tmp-{os.getpid()}"
        with open(temp_idx_path, "wb") as stream:
            stream.write(INDEX_HEADER)
            stream.write(struct.pack("<Q", INDEX_VERSION))
            stream.write(struct.pack("<B", dtype_code(self.dtype)))
            stream.write(struct.pack("<Q", len(lengths)))
            stream.write(struct.pack("<Q", len(documents)))
            stream.write(lengths.tobytes(order="C"))
            stream.write(pointers.tobytes(order="C"))
            stream.write(documents.tobytes(order="C"))
            if self.sequence_modes is not None:
                stream.write(numpy.array(self.sequence_modes, dtype=numpy.int8).tobytes())
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(self._temp_bin_path, self.bin_path)
        os.replace(temp_idx_path, idx_path)
