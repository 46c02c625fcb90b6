"""`build_gpt_datasets()`: the train, validation and test datasets of a `--data-path` blend.

As Megatron-core's `BlendedMegatronDatasetBuilder` for GPT (0.19.2): each dataset prefix is
split over its documents by the `--split` book-ends (`splits`: each boundary `round(c_k * n)`),
one `GPTDataset` is built per prefix per split, and several prefixes, or one prefix with a
weight, are mixed by a `BlendedDataset`. A weighted blend of `N` samples takes `ceil(N * w)`
from a dataset of weight `w` (its length is the sum of those) and builds that dataset with
`ceil(ceil(N * w) * 1.005)` samples (upstream's margin, `mid_level_dataset_surplus`, so the
greedy blend never runs a dataset dry); a blend without weights mixes one epoch of each dataset
by their lengths. Per-split blends (`GPTDatasetConfig.blend_per_split`) use each prefix whole
for their split; a per-split blend of one prefix, weighted or not, is that prefix's dataset.

Where upstream differs, it is on inputs it cannot build: a split of positive weight without
documents (upstream loops forever) is None here for a lone prefix, an error in a blend; a split
asked for 0 samples is None (upstream builds one epoch of it that nothing reads).

When `config.vocab_size` is set, each corpus's largest token id is checked against it (once per
corpus: the result is cached beside the indices), on every rank, so data tokenized with another
tokenizer is refused with the same error everywhere instead of an `IndexError` on one rank.

With `torch.distributed` initialised, every rank must call the builder (the datasets' index
caches are built on rank 0 while the other ranks wait).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import numpy
from torch.utils.data import Dataset

from megatron.core.datasets import index_cache
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import Blend, GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.splits import (
    DEFAULT_SPLIT,
    SPLIT_NAMES,
    SplitMatrix,
    document_range,
    normalize,
)

_DATA_PATH_FORMS = (
    "give prefixes (--data-path corpus_a corpus_b: weighted by their sizes), or weight-prefix "
    "pairs (--data-path 0.3 corpus_a 0.7 corpus_b)"
)


def parse_data_path(data_path: Sequence[str]) -> Blend:
    """Megatron-LM's `--data-path` list as a blend.

    Args:
        data_path: `[prefix1, prefix2, ...]` (a blend weighted by the datasets' sizes, as
            Megatron-LM's), or `[weight1, prefix1, weight2, prefix2, ...]`.

    Returns:
        The prefixes and their weights (None without weights), weights not normalised.

    Raises:
        ValueError: the list is empty, mixes the two forms, or a weight is negative; the
            message names the entry.
    """
    entries = [entry.strip() for entry in data_path]
    if not entries:
        raise ValueError(f"--data-path is empty; {_DATA_PATH_FORMS}.")
    numeric = [_is_number(entry) for entry in entries]
    if not any(numeric):
        return entries, None
    for position, entry in enumerate(entries):
        if numeric[position] != (position % 2 == 0):
            role = "a weight" if position % 2 == 0 else "a prefix"
            raise ValueError(
                f"--data-path {' '.join(entries)!r}: entry {position + 1} ({entry!r}) should be "
                f"{role}; {_DATA_PATH_FORMS}."
            )
    if len(entries) % 2:
        raise ValueError(
            f"--data-path {' '.join(entries)!r}: weight {entries[-1]!r} has no prefix after it; "
            f"{_DATA_PATH_FORMS}."
        )
    weights = [float(entry) for entry in entries[0::2]]
    _check_weights(weights, entries[1::2])
    return entries[1::2], weights


def _is_number(entry: str) -> bool:
    try:
        float(entry)
    except ValueError:
        return False
    return True


def _check_weights(weights: Sequence[float], prefixes: Sequence[str]) -> None:
    for weight, prefix in zip(weights, prefixes):
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(
                f"The weight {weight} of dataset {prefix!r} must be a finite number >= 0."
            )
    if sum(weights) <= 0:
        raise ValueError(f"The blend weights {list(weights)} are all 0; give one a weight > 0.")


def check_blend(blend: Blend) -> Blend:
    """The blend's prefixes (checked to exist) and weights (checked; None when not given),
    without the prefixes of weight 0.

    Raises:
        ValueError: no prefix, weights that do not fit the prefixes, or a prefix whose files
            do not exist (the message names them).
    """
    prefixes, weights = list(blend[0]), blend[1]
    if not prefixes:
        raise ValueError("The blend names no dataset prefix; give --data-path.")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(
                f"The blend has {len(prefixes)} prefixes but {len(weights)} weights; give one "
                "weight per prefix."
            )
        try:
            weights = [float(weight) for weight in weights]
        except (TypeError, ValueError):
            raise ValueError(f"The blend weights {weights} must be numbers.") from None
        _check_weights(weights, prefixes)
        kept = [(prefix, weight) for prefix, weight in zip(prefixes, weights) if weight > 0]
        prefixes, weights = [prefix for prefix, _ in kept], [weight for _, weight in kept]
    for prefix in prefixes:
        if not IndexedDataset.exists(prefix):
            missing = [
                path
                for path in (get_bin_path(prefix), get_idx_path(prefix))
                if not os.path.isfile(path)
            ]
            raise ValueError(
                f"Dataset prefix {prefix!r} names no indexed dataset: {' and '.join(missing)} "
                "missing (a prefix is the path without .bin/.idx); create it with "
                "tools/preprocess_data.py or fix --data-path."
            )
    return prefixes, weights


def _check_token_ids(indexed: IndexedDataset, prefix: str, config: GPTDatasetConfig) -> None:
    """Refuses a corpus holding a token id at or beyond `config.vocab_size`, on every rank.

    The largest id is found once per corpus (a chunked scan of the .bin, rank 0 while the
    others wait) and cached beside the indices, keyed by the .idx content and the .bin's size
    and modification time; every rank then reads the same number and raises the same error.
    Skipped when the .bin's dtype cannot hold an id that large.
    """
    vocab_size = config.vocab_size
    if vocab_size is None:
        return
    dtype = indexed.dtype
    if dtype.kind in "iu" and numpy.iinfo(dtype).max < vocab_size:
        return
    status = os.stat(get_bin_path(prefix))
    description = json.dumps(
        {
            "class": "MaxTokenId",
            "dataset_path": prefix,
            "idx_sha256": indexed.index_digest,
            "bin_bytes": status.st_size,
            "bin_mtime_ns": status.st_mtime_ns,
        },
        indent=4,
    )
    cache_dir = config.path_to_cache or index_cache.default_cache_dir(prefix, "GPTDataset")
    base_name = f"{index_cache.description_hash(description)}-MaxTokenId"

    def scan() -> dict[str, numpy.ndarray]:
        largest = indexed.max_token_id()
        return {"max_token_id": numpy.array([-1 if largest is None else largest], numpy.int64)}

    arrays, _ = index_cache.load_or_build(
        cache_dir, base_name, description, ("max_token_id",), scan
    )
    largest = int(arrays["max_token_id"][0])
    if largest >= vocab_size:
        raise ValueError(
            f"Dataset {prefix!r} holds token id {largest}, but the tokenizer's vocabulary has "
            f"{vocab_size} ids (0 to {vocab_size - 1}): the data was tokenized with another "
            "tokenizer. Train with the one it was preprocessed with (--tokenizer-type, and its "
            "files or --vocab-size for NullTokenizer), or preprocess the data again with this one."
        )


def _build_prefix_splits(
    prefix: str,
    matrix: SplitMatrix,
    sizes: Sequence[int | None],
    config: GPTDatasetConfig,
    in_blend: bool,
) -> list[GPTDataset | None]:
    """One `GPTDataset` per split of one prefix (None where the split has no book-ends or no
    samples are asked for, or, for a lone prefix, no documents)."""
    indexed = IndexedDataset(prefix, mmap=config.mmap_bin_files)
    if len(indexed) == 0:
        raise ValueError(
            f"Dataset {prefix!r} holds no document ({get_idx_path(prefix)} lists none); "
            "tokenize data into it (tools/preprocess_data.py) or leave it out."
        )
    _check_token_ids(indexed, prefix, config)
    datasets: list[GPTDataset | None] = []
    for number, name in enumerate(SPLIT_NAMES):
        if matrix[number] is None or sizes[number] == 0:
            datasets.append(None)
            continue
        begin, end = document_range(matrix[number], len(indexed))
        if begin == end:
            # Upstream loops forever on a split without documents.
            if in_blend:
                raise ValueError(
                    f"Dataset {prefix!r} has no document in the {name} split (its "
                    f"{len(indexed)} documents split by {config.split or DEFAULT_SPLIT}); give "
                    "that split more weight, or use a larger dataset."
                )
            datasets.append(None)
            continue
        documents = numpy.arange(begin, end, dtype=numpy.int32)
        datasets.append(GPTDataset(indexed, prefix, documents, sizes[number], name, config))
    return datasets


def _build_blend_splits(
    blend: Blend, matrix: SplitMatrix, sizes: Sequence[int], config: GPTDatasetConfig
) -> list[Dataset | None]:
    prefixes, weights = blend
    if len(prefixes) == 1 and weights is None:
        return list(_build_prefix_splits(prefixes[0], matrix, sizes, config, False))
    if weights is not None:
        weights = normalize(weights)
        # Upstream's sizing: the samples used per dataset, and the samples built (with margin).
        targets = [[int(math.ceil(size * weight)) for size in sizes] for weight in weights]
        surplus = 1 + config.mid_level_dataset_surplus
        per_prefix_sizes = [
            [int(math.ceil(target * surplus)) for target in prefix_targets]
            for prefix_targets in targets
        ]
    else:
        # Unweighted blends (config.blend only) mix the datasets by their one-epoch lengths.
        per_prefix_sizes = [[None if size else 0 for size in sizes] for _ in prefixes]
    per_prefix = [
        _build_prefix_splits(prefix, matrix, prefix_sizes, config, True)
        for prefix, prefix_sizes in zip(prefixes, per_prefix_sizes)
    ]
    blended: list[Dataset | None] = []
    for number, name in enumerate(SPLIT_NAMES):
        parts = [datasets[number] for datasets in per_prefix]
        if sizes[number] == 0 or matrix[number] is None:
            blended.append(None)
        elif weights is None:
            lengths = [len(part) for part in parts]
            for prefix, length in zip(prefixes, lengths):
                if length == 0:
                    raise ValueError(
                        f"Dataset {prefix!r} has fewer tokens in the {name} split than one sample "
                        f"({config.sequence_length} + 1), so a blend by sizes gives it weight 0; "
                        "give it weights (--data-path W1 P1 W2 P2 ...) or more data."
                    )
            size = min(sizes[number], sum(lengths))
            blended.append(BlendedDataset(parts, lengths, size, config))
        else:
            size = sum(prefix_targets[number] for prefix_targets in targets)
            blended.append(BlendedDataset(parts, weights, size, config))
    return blended


def build_gpt_datasets(
    config: GPTDatasetConfig,
    train_val_test_num_samples: Sequence[int],
    data_path: Sequence[str] | None = None,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """The train, validation and test datasets (a `GPTDataset`, a `BlendedDataset`, or None).

    A split is None when it is asked for 0 samples, has split weight 0, or (for a lone prefix)
    gets no document.

    Args:
        config: the configuration; its `blend` or `blend_per_split` is the data unless
            `data_path` is given.
        train_val_test_num_samples: samples wanted per split.
        data_path: Megatron-LM's `--data-path` list (`parse_data_path`), split by
            `config.split`.

    Raises:
        ValueError: no data, or the data twice (`data_path` and a config blend); a bad
            `--data-path` (odd length, a weight that is not a number or is negative); a
            missing prefix (the message names the files), or one without documents; a blended
            prefix with no document in a split that needs it; a split whose documents hold no
            token; a token id beyond `config.vocab_size`; a negative sample count.
    """
    sizes = list(train_val_test_num_samples)
    if len(sizes) != len(SPLIT_NAMES) or any(int(size) != size or size < 0 for size in sizes):
        raise ValueError(f"train_val_test_num_samples={sizes} must be three sample counts >= 0.")
    if data_path is not None and (config.blend is not None or config.blend_per_split is not None):
        raise ValueError(
            "The data is given twice: data_path and the config's blend / blend_per_split."
        )
    blend = parse_data_path(data_path) if data_path is not None else config.blend
    if blend is not None:
        return tuple(_build_blend_splits(check_blend(blend), config.split_matrix, sizes, config))
    if config.blend_per_split is None:
        raise ValueError(
            "No data: give data_path (--data-path) or the config's blend / blend_per_split."
        )
    datasets: list[Dataset | None] = []
    for number, blend in enumerate(config.blend_per_split):
        if blend is None or sizes[number] == 0:
            datasets.append(None)
            continue
        # The split's prefixes serve this split alone, with all their documents.
        only_this: SplitMatrix = [None] * len(SPLIT_NAMES)
        only_this[number] = (0.0, 1.0)
        only_these_samples = [0] * len(SPLIT_NAMES)
        only_these_samples[number] = sizes[number]
        prefixes, _ = check_blend(blend)
        if len(prefixes) == 1:  # weighted or not, as upstream: the dataset itself
            splits = _build_prefix_splits(
                prefixes[0], only_this, only_these_samples, config, in_blend=False
            )
        else:
            splits = _build_blend_splits(blend, only_this, only_these_samples, config)
        datasets.append(splits[number])
    return tuple(datasets)
