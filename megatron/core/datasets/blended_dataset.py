"""`BlendedDataset`: samples drawn from several datasets in given proportions, as Megatron-LM's.

Sample `i` of the blend is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`.
Both arrays come from Megatron-LM's greedy rule (its C++ `build_blending_indices`): at each
sample, take the dataset whose count lags its weighted share the most, i.e. the largest
`weight * max(i, 1) - count` (the first dataset on ties), and its next unused sample. Every
prefix of the blend thus holds each dataset within about one sample of its share, and each
dataset is read in its own (already shuffled) order. The arrays are cached like `GPTDataset`'s
indices (`index_cache`), so a restart or another rank loads them.
"""

from __future__ import annotations

import array
import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy
import torch

from megatron.core.datasets import index_cache
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.splits import normalize

MAX_DATASETS = 32767
"""The dataset index is int16, as Megatron-LM's."""


def build_blending_indices(
    weights: Sequence[float], size: int
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Megatron-LM's greedy blending (see the module docstring) of `size` samples.

    Args:
        weights: normalised weights, one per dataset.
        size: samples in the blend.

    Returns:
        `dataset_index` int16 [size] and `dataset_sample_index` int64 [size].
    """
    # A plain loop (Megatron-LM's is C++): the choice at each sample depends on all earlier
    # ones. About 0.3 s per 10^6 samples and two datasets, once; the result is cached. Typed
    # arrays (10 bytes a sample) rather than lists of Python ints (about 100).
    weights = [float(weight) for weight in weights]
    counts = [0] * len(weights)
    dataset_index = array.array("h", bytes(2 * size))
    dataset_sample_index = array.array("q", bytes(8 * size))
    others = range(1, len(weights))
    for sample in range(size):
        scale = float(sample) if sample > 1 else 1.0
        best, best_error = 0, weights[0] * scale - counts[0]
        for dataset in others:
            error = weights[dataset] * scale - counts[dataset]
            if error > best_error:
                best, best_error = dataset, error
        dataset_index[sample] = best
        dataset_sample_index[sample] = counts[best]
        counts[best] += 1
    return (
        numpy.frombuffer(dataset_index, dtype=numpy.int16),
        numpy.frombuffer(dataset_sample_index, dtype=numpy.int64),
    )


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples of `datasets`, mixed in proportion to `weights`.

    A sample is the chosen dataset's sample with `dataset_id` (the dataset's number, int16)
    first, as upstream's. With `torch.distributed` initialised, construction is a collective,
    like `GPTDataset`'s.

    Args:
        datasets: the datasets to blend; those with a `unique_description` and a
            `dataset_path` (`GPTDataset`s) let the indices be cached, otherwise they are
            built on each construction.
        weights: positive weights, one per dataset (normalised here).
        size: samples in the blend.
        config: its `path_to_cache` is the cache folder (None: `cache/BlendedDataset_indices`
            beside the first dataset's files).

    Attributes:
        built_anew_on_cache_miss: whether this construction built the indices.

    Raises:
        ValueError: no datasets or too many, a weight count that differs from the dataset
            count, a weight that is not a positive finite number, `size` < 1, or a dataset with
            fewer samples than the blend takes from it.
    """

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        config: GPTDatasetConfig,
    ):
        if not 1 <= len(datasets) <= MAX_DATASETS or len(weights) != len(datasets):
            raise ValueError(
                f"BlendedDataset needs 1 to {MAX_DATASETS} datasets and one weight each; got "
                f"{len(datasets)} datasets and {len(weights)} weights."
            )
        if not all(math.isfinite(weight) and weight > 0 for weight in weights):
            raise ValueError(
                f"blend weights {list(weights)} must be positive finite numbers; leave a "
                "dataset of weight 0 out of the blend."
            )
        if size < 1:
            raise ValueError(f"BlendedDataset size={size} must be >= 1.")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = size
        self.config = config

        identifiers = [getattr(dataset, "unique_identifiers", None) for dataset in datasets]
        self.unique_description = json.dumps(
            OrderedDict(
                [
                    ("class", type(self).__name__),
                    ("datasets", identifiers),
                    ("weights", self.weights),
                    ("size", size),
                ]
            ),
            indent=4,
        )
        first_path = getattr(datasets[0], "dataset_path", None)
        if None in identifiers or (config.path_to_cache is None and first_path is None):
            arrays, self.built_anew_on_cache_miss = self._build_indices(), True
        else:
            cache_dir = config.path_to_cache or index_cache.default_cache_dir(
                first_path, type(self).__name__
            )
            # Upstream's file names: <hash>-BlendedDataset-<split>-dataset_index.npy.
            split = getattr(datasets[0], "index_split", None)
            base_name = "-".join(
                part
                for part in (
                    index_cache.description_hash(self.unique_description),
                    type(self).__name__,
                    split,
                )
                if part
            )
            arrays, self.built_anew_on_cache_miss = index_cache.load_or_build(
                cache_dir,
                base_name,
                self.unique_description,
                ("dataset_index", "dataset_sample_index"),
                self._build_indices,
            )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

        counts = numpy.bincount(self.dataset_index, minlength=len(self.datasets))
        for number, (dataset, count) in enumerate(zip(self.datasets, counts)):
            if count > len(dataset):
                name = getattr(dataset, "dataset_path", None) or "no path"
                raise ValueError(
                    f"The blend takes {count} samples from dataset {number} ({name}), which has "
                    f"{len(dataset)}; build it with at least that many samples."
                )

    def _build_indices(self) -> dict[str, numpy.ndarray]:
        dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if not 0 <= idx < self.size:
            raise IndexError(f"BlendedDataset index {idx} out of range [0, {self.size}).")
        dataset_id = self.dataset_index[idx]
        sample = self.datasets[int(dataset_id)][int(self.dataset_sample_index[idx])]
        return {"dataset_id": dataset_id, **sample}
