"""The .bin/.idx pair: Megatron-LM's byte layout, round trips, merging, safe writes, and the
errors for missing or damaged files."""

from __future__ import annotations

import hashlib
import os
import pickle
import struct

import numpy
import pytest
import torch

from megatron.core.datasets import (
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    indexed_dataset,
    optimal_dtype,
)
from tests.unit_tests.datasets.corpus import write_corpus

# Megatron-LM's DType codes, written out independently of the implementation's table.
CODES = {
    numpy.uint8: 1,
    numpy.int8: 2,
    numpy.int16: 3,
    numpy.int32: 4,
    numpy.int64: 5,
    numpy.float64: 6,
    numpy.float32: 7,
    numpy.uint16: 8,
}


def _build_two_sentence_corpus(prefix: str, dtype) -> list[list[list[int]]]:
    """Three documents of 2, 1 and 3 sequences (one of them empty), written three ways."""
    documents = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8], [], [9, 10, 11, 12]]]
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for sequence in documents[0]:
        builder.add_item(numpy.array(sequence))
    builder.end_document()
    builder.add_item(torch.tensor(documents[1][0]))
    builder.end_document()
    builder.add_document(sum(documents[2], []), [len(s) for s in documents[2]])
    builder.finalize(get_idx_path(prefix))
    return documents


@pytest.mark.parametrize("dtype", [numpy.uint16, numpy.int32, numpy.int64, numpy.uint8])
def test_byte_layout_is_megatrons(tmp_path, dtype):
    prefix = str(tmp_path / "corpus")
    documents = _build_two_sentence_corpus(prefix, dtype)
    sequences = [sequence for document in documents for sequence in document]
    lengths = [len(sequence) for sequence in sequences]
    itemsize = numpy.dtype(dtype).itemsize

    with open(get_idx_path(prefix), "rb") as stream:
        raw = stream.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, sequence_count, document_count = struct.unpack("<QBQQ", raw[9:34])
    assert (version, code, sequence_count, document_count) == (1, CODES[dtype], 6, 4)
    offset = 34
    assert struct.unpack(f"<{sequence_count}i", raw[offset : offset + 24]) == tuple(lengths)
    offset += 4 * sequence_count
    pointers = struct.unpack(f"<{sequence_count}q", raw[offset : offset + 48])
    assert pointers == tuple(itemsize * sum(lengths[:i]) for i in range(len(lengths)))
    offset += 8 * sequence_count
    assert struct.unpack("<4q", raw[offset:]) == (0, 2, 3, 6)

    with open(get_bin_path(prefix), "rb") as stream:
        assert stream.read() == numpy.array(sum(sequences, []), dtype=dtype).tobytes()


@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip(tmp_path, mmap):
    prefix = str(tmp_path / "corpus")
    documents = _build_two_sentence_corpus(prefix, numpy.int32)
    sequences = [sequence for document in documents for sequence in document]
    dataset = IndexedDataset(prefix, mmap=mmap)
    assert len(dataset) == len(sequences) and dataset.dtype == numpy.int32
    for index, sequence in enumerate(sequences):
        assert dataset[index].tolist() == sequence
    assert dataset.get(5, offset=1, length=2).tolist() == [10, 11]
    assert dataset.get(5, offset=3).tolist() == [12]
    assert dataset.document_indices.tolist() == [0, 2, 3, 6]
    assert dataset.sequence_lengths.tolist() == [3, 2, 1, 2, 0, 4]
    assert dataset.sequence_pointers.tolist() == [0, 12, 20, 24, 32, 32]
    with pytest.raises(IndexError):
        dataset.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        dataset[6]
    # Pickling (data-loader workers) reopens the files instead of copying the data.
    assert len(pickle.dumps(dataset)) < 500
    assert pickle.loads(pickle.dumps(dataset))[5].tolist() == sequences[5]


@pytest.mark.parametrize("mmap", [True, False])
def test_slices_read_lists_of_sequences(tmp_path, mmap):
    """Megatron-LM's `dataset[a:b]`: the sequences a to b, read at once (step 1 only)."""
    prefix = str(tmp_path / "corpus")
    documents = _build_two_sentence_corpus(prefix, numpy.uint16)
    sequences = [sequence for document in documents for sequence in document]
    dataset = IndexedDataset(prefix, mmap=mmap)
    assert [s.tolist() for s in dataset[1:5]] == sequences[1:5]
    assert [s.tolist() for s in dataset[:]] == sequences
    assert [s.tolist() for s in dataset[-2:]] == sequences[-2:]
    assert dataset[3:3] == [] and dataset[4:2] == []
    assert dataset[numpy.int64(2)].tolist() == sequences[2]
    with pytest.raises(ValueError, match="contiguous"):
        dataset[::2]
    with pytest.raises(TypeError, match="an integer or a slice"):
        dataset["1"]


def test_multimodal_index_round_trip(tmp_path):
    """A multimodal index ends with one int8 mode per sequence (Megatron-LM's layout): read
    with its modes when asked, as text otherwise; merged with its modes."""
    prefix = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16, multimodal=True)
    builder.add_item([1, 2, 3], mode=2)
    builder.add_item([4], mode=1)
    builder.end_document()
    builder.add_document([5, 6, 7], [1, 2], modes=[0, 3])
    builder.add_document([8], [1])
    builder.finalize(get_idx_path(prefix))
    with open(get_idx_path(prefix), "rb") as stream:
        assert stream.read()[-5:] == bytes([2, 1, 0, 3, 0])
    dataset = IndexedDataset(prefix, multimodal=True)
    assert dataset.sequence_modes.tolist() == [2, 1, 0, 3, 0]
    tokens, mode = dataset[3]
    assert tokens.tolist() == [6, 7] and mode == 3
    tokens, mode = dataset.get(0, offset=1, length=2)
    assert tokens.tolist() == [2, 3] and mode == 2
    sequences, modes = dataset[1:4]
    assert [s.tolist() for s in sequences] == [[4], [5], [6, 7]] and modes.tolist() == [1, 0, 3]
    text = IndexedDataset(prefix)
    assert text[3].tolist() == [6, 7] and len(text) == 5
    assert pickle.loads(pickle.dumps(dataset))[3][1] == 3

    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(get_bin_path(merged), dtype=numpy.uint16, multimodal=True)
    builder.add_index(prefix)
    builder.add_index(prefix)
    builder.finalize(get_idx_path(merged))
    assert IndexedDataset(merged, multimodal=True).sequence_modes.tolist() == [2, 1, 0, 3, 0] * 2
    plain = write_corpus(str(tmp_path / "plain"), [[1, 2]])
    with pytest.raises(ValueError, match="not a multimodal index"):
        IndexedDataset(plain, multimodal=True)
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), multimodal=True)
    with pytest.raises(ValueError, match="2 modes for 1 sequences"):
        builder.add_document([1], [1], modes=[0, 1])
    builder.abort()


def test_index_digest_is_the_idx_content(tmp_path):
    first = write_corpus(str(tmp_path / "a"), [[1, 2, 3], [4]])
    same = write_corpus(str(tmp_path / "b"), [[5, 6, 7], [8]])
    reordered = write_corpus(str(tmp_path / "c"), [[4], [1, 2, 3]])
    digests = [IndexedDataset(prefix).index_digest for prefix in (first, same, reordered)]
    # Same lengths and documents: the same indices, whatever the tokens; reordered: not.
    assert digests[0] == digests[1] != digests[2]
    with open(get_idx_path(first), "rb") as stream:
        assert digests[0] == hashlib.sha256(stream.read()).hexdigest()


@pytest.mark.parametrize("mmap", [True, False])
def test_max_token_id(tmp_path, mmap):
    prefix = write_corpus(str(tmp_path / "a"), [[1, 900, 3], [], [4]], dtype=numpy.uint16)
    dataset = IndexedDataset(prefix, mmap=mmap)
    assert dataset.max_token_id() == dataset.max_token_id(chunk_tokens=2) == 900
    empty = write_corpus(str(tmp_path / "e"), [[]], dtype=numpy.uint16)
    assert IndexedDataset(empty, mmap=mmap).max_token_id() is None


def test_add_index_merges_datasets(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    write_corpus(first, [[1, 2, 3], [4]], dtype=numpy.int32)
    _build_two_sentence_corpus(second, numpy.int32)
    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(get_bin_path(merged), dtype=numpy.int32)
    builder.add_item([99])
    builder.end_document()
    builder.add_index(first)
    builder.add_index(second)
    builder.finalize(get_idx_path(merged))

    dataset = IndexedDataset(merged)
    expected = [[99], [1, 2, 3], [4], [1, 2, 3], [4, 5], [6], [7, 8], [], [9, 10, 11, 12]]
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    # Document boundaries of each part, shifted by the sequences before it.
    assert dataset.document_indices.tolist() == [0, 1, 2, 3, 5, 6, 9]

    other_dtype = IndexedDatasetBuilder(str(tmp_path / "c.bin"), dtype=numpy.uint16)
    with pytest.raises(ValueError, match="int32 tokens"):
        other_dtype.add_index(first)


def test_optimal_dtype():
    assert optimal_dtype(50257) == numpy.uint16
    assert optimal_dtype(65499) == numpy.uint16
    assert optimal_dtype(65500) == numpy.int32
    assert optimal_dtype(None) == numpy.int32


def test_builder_rejects_what_it_cannot_store(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "c.bin"), dtype=numpy.uint16)
    with pytest.raises(ValueError, match="do not fit uint16"):
        builder.add_item([1, 70000])
    with pytest.raises(ValueError, match="sum to the 3 tokens"):
        builder.add_document([1, 2, 3], [1, 1])
    builder.add_item([1, 2])
    with pytest.raises(ValueError, match="end_document"):
        builder.finalize(str(tmp_path / "c.idx"))
    with pytest.raises(ValueError, match="uint32"):
        IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=numpy.uint32)


def test_files_appear_only_at_finalize(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, [[5, 5, 5]])
    old = IndexedDataset(prefix)[0].tolist()
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    builder.add_item([1, 2])
    builder.end_document()
    # Mid-write, the old pair is untouched and still reads (a killed run leaves it valid).
    assert IndexedDataset(prefix)[0].tolist() == old
    builder.finalize(get_idx_path(prefix))
    assert IndexedDataset(prefix)[0].tolist() == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.idx"]
    # An aborted build leaves the old pair and no temporary file.
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    builder.add_item([3, 4, 5])
    builder.abort()
    assert IndexedDataset(prefix)[0].tolist() == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.idx"]


def _corrupt(path: str, at: int, data: bytes) -> None:
    with open(path, "r+b") as stream:
        stream.seek(at)
        stream.write(data)


def test_missing_and_damaged_files_name_the_file_and_fix(tmp_path):
    prefix = str(tmp_path / "corpus")
    with pytest.raises(FileNotFoundError, match=r"corpus\.idx does not exist.*preprocess_data"):
        IndexedDataset(prefix)
    assert not IndexedDataset.exists(prefix)
    write_corpus(prefix, [[1, 2, 3], [4, 5]])
    assert IndexedDataset.exists(prefix)
    idx, bin_ = get_idx_path(prefix), get_bin_path(prefix)
    good_idx, good_bin = open(idx, "rb").read(), open(bin_, "rb").read()

    def restore():
        open(idx, "wb").write(good_idx)
        open(bin_, "wb").write(good_bin)

    _corrupt(idx, 0, b"XXIDIDX")
    with pytest.raises(ValueError, match=r"corpus\.idx does not start with.*preprocess_data"):
        IndexedDataset(prefix)
    restore()
    _corrupt(idx, 9, struct.pack("<Q", 2))
    with pytest.raises(ValueError, match="version 2"):
        IndexedDataset(prefix)
    restore()
    _corrupt(idx, 17, struct.pack("<B", 42))
    with pytest.raises(ValueError, match="unknown dtype code 42"):
        IndexedDataset(prefix)
    restore()
    open(idx, "wb").write(good_idx[:-3])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        IndexedDataset(prefix)
    restore()
    open(bin_, "wb").write(good_bin[:-2])
    with pytest.raises(ValueError, match=r"corpus\.bin holds 8 bytes.*describes 10"):
        IndexedDataset(prefix)
    os.remove(bin_)
    with pytest.raises(FileNotFoundError, match=r"corpus\.bin does not exist"):
        IndexedDataset(prefix)


# Byte offsets in the .idx of a corpus of 4 sequences (one per document): the header is 34
# bytes, then 4 int32 lengths, 4 int64 pointers and 5 int64 document indices.
_LENGTHS, _POINTERS, _DOCUMENTS = 34, 34 + 4 * 4, 34 + 4 * 4 + 4 * 8

DAMAGED_SEQUENCES = {
    # id: (offset, value, its struct format, the message's fragments)
    "length-grown": (
        _LENGTHS + 4 * 1,
        10**6,
        "<i",
        "sequence 1 (1000000 tokens of 2 bytes from byte 6) ends at byte 2000006, but "
        "sequence 2 starts at byte 10",
    ),
    "length-negative": (_LENGTHS + 4 * 2, -3, "<i", "sequence 2 has a negative length (-3)"),
    "first-pointer": (_POINTERS, 4, "<q", "sequence 0 starts at byte 4 of the .bin, not 0"),
    "pointer": (
        _POINTERS + 8 * 3,
        14,
        "<q",
        "sequence 2 (1 tokens of 2 bytes from byte 10) ends at byte 12, but sequence 3 starts "
        "at byte 14",
    ),
    "document-order": (
        _DOCUMENTS + 8 * 2,
        0,
        "<q",
        "document 2 starts at sequence 0, before document 1 (sequence 1)",
    ),
}


@pytest.mark.parametrize("block", [1 << 22, 1])
@pytest.mark.parametrize("case", DAMAGED_SEQUENCES)
def test_damaged_sequence_lengths_and_pointers_name_the_sequence(
    case, block, tmp_path, monkeypatch
):
    """Damage that keeps the file sizes (a length, a pointer, a document index) is found when
    the dataset opens, naming the file, the first bad sequence and the fix; checked in blocks
    (of one sequence here too, so that every block boundary is crossed)."""
    monkeypatch.setattr(indexed_dataset, "_CHECK_BLOCK", block)
    prefix = write_corpus(str(tmp_path / "corpus"), [[1, 2, 3], [4, 5], [6], [7, 8]])
    assert IndexedDataset(prefix).sequence_pointers.tolist() == [0, 6, 10, 12]
    offset, value, fmt, fragment = DAMAGED_SEQUENCES[case]
    _corrupt(get_idx_path(prefix), offset, struct.pack(fmt, value))
    with pytest.raises(ValueError) as error:
        IndexedDataset(prefix)
    message = str(error.value)
    assert message.startswith(f"{get_idx_path(prefix)}: {fragment}; the file is corrupt"), message
    assert "tools/preprocess_data.py" in message


def test_damaged_last_length_names_the_pair(tmp_path):
    """The last sequence's end is the .bin's size, which the dataset checks."""
    prefix = write_corpus(str(tmp_path / "corpus"), [[1, 2, 3], [4, 5]])
    _corrupt(get_idx_path(prefix), _LENGTHS + 4, struct.pack("<i", 7))
    with pytest.raises(ValueError, match=r"corpus\.bin holds 10 bytes.*describes 20.*damaged"):
        IndexedDataset(prefix)
