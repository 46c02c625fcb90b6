"""Small tokenized corpora on disk for the dataset tests, and plain reference implementations
(straight ports of Megatron-LM's loops) that the fast code is checked against."""

from __future__ import annotations

import math
import os

import numpy

from megatron.core.datasets import IndexedDatasetBuilder, get_bin_path, get_idx_path

EOD = 0
"""The EOD token id of the test corpora (every document ends with it)."""


def random_documents(
    count: int, seed: int, max_length: int = 40, vocab_size: int = 500
) -> list[numpy.ndarray]:
    """`count` documents of 1 to `max_length` tokens, ids in [1, vocab_size), each ending in
    EOD."""
    rng = numpy.random.default_rng(seed)
    documents = []
    for _ in range(count):
        body = rng.integers(1, vocab_size, size=int(rng.integers(0, max_length)))
        documents.append(numpy.concatenate([body, [EOD]]).astype(numpy.int64))
    return documents


def write_corpus(prefix: str, documents: list, dtype=numpy.uint16) -> str:
    """Writes each document as one sequence (as preprocessing without sentence splitting)."""
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for document in documents:
        builder.add_item(document)
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def reference_sample_index(
    sizes: numpy.ndarray,
    document_index: numpy.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> numpy.ndarray:
    """Line-by-line port of Megatron-LM's C++ `build_sample_idx`."""
    extra = add_extra_token_to_sequence
    if drop_last_partial_sequence:
        num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    else:
        num_samples = math.ceil(float(num_epochs * tokens_per_epoch - extra) / seq_length)
    # int32, as Megatron-LM's helper picks for indices that fit.
    sample_idx = numpy.zeros((num_samples + 1, 2), dtype=numpy.int32)
    sample_idx_index, document_idx_index, doc_offset = 1, 0, 0
    while sample_idx_index <= num_samples:
        remaining_seq_length = seq_length + extra
        while remaining_seq_length != 0:
            document_length = int(sizes[document_index[document_idx_index]]) - doc_offset
            remaining_seq_length -= document_length
            if remaining_seq_length <= 0:
                doc_offset += remaining_seq_length + document_length - extra
                remaining_seq_length = 0
            else:
                if document_idx_index == len(document_index) - 1:
                    assert sample_idx_index == num_samples
                    doc_offset = int(sizes[document_index[document_idx_index]]) - extra
                    break
                document_idx_index += 1
                doc_offset = 0
        sample_idx[sample_idx_index] = (document_idx_index, doc_offset)
        sample_idx_index += 1
    return sample_idx


def reference_gpt_indices(
    sizes: numpy.ndarray, documents: numpy.ndarray, seq_length: int, num_samples: int, seed: int
) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray, bool]:
    """Megatron-LM's `_build_document_sample_shuffle_indices`, written as it is there (epoch
    loop, `numpy.mgrid` document index, the C++ sample index port above): the document, sample
    and shuffle indices, and whether the final epoch was shuffled separately."""
    tokens_per_epoch = int(numpy.sum(sizes[documents]))
    num_epochs, num_tokens = 1, tokens_per_epoch
    while num_tokens < num_samples * seq_length + 1:
        num_epochs += 1
        num_tokens += tokens_per_epoch
    separate_final_epoch = False
    if num_epochs > 1:
        num_samples_sans_final_epoch = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        num_samples_from_final_epoch = num_samples - num_samples_sans_final_epoch
        num_samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = num_samples_from_final_epoch < int(0.80 * num_samples_per_epoch)
    random_state = numpy.random.RandomState(seed)

    def document_index_of(epochs: int) -> numpy.ndarray:
        index = numpy.mgrid[0:epochs, 0 : len(documents)][1]
        index[:] = documents
        index = index.reshape(-1).astype(numpy.int32)
        random_state.shuffle(index)
        return index

    if separate_final_epoch:
        first = document_index_of(num_epochs - 1)
        document_index = numpy.concatenate((first, document_index_of(1)))
    else:
        document_index = document_index_of(num_epochs)
    sample_index = reference_sample_index(
        sizes, document_index, seq_length, num_epochs, tokens_per_epoch
    )
    total = sample_index.shape[0] - 1
    split_at = num_samples_sans_final_epoch if separate_final_epoch else total
    first = numpy.arange(0, split_at, dtype=numpy.uint32)
    random_state.shuffle(first)
    if split_at == total:
        return document_index, sample_index, first, separate_final_epoch
    last = numpy.arange(split_at, total, dtype=numpy.uint32)
    random_state.shuffle(last)
    return document_index, sample_index, numpy.concatenate((first, last)), separate_final_epoch
