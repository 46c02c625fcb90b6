"""`BlendedDataset`: Megatron-LM's greedy blending, its sample routing, its cache and errors."""

from __future__ import annotations

import numpy
import pytest
import torch

from megatron.core.datasets import (
    BlendedDataset,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    build_blending_indices,
)
from tests.unit_tests.datasets.corpus import random_documents, write_corpus

SEQ = 8


def test_greedy_blend_on_a_hand_worked_example():
    # Megatron-LM's rule: sample i goes to the largest weight * max(i, 1) - count, the first
    # dataset on ties. Worked by hand for weights 1/2, 1/4, 1/4:
    #   i=0 errors (.5, .25, .25) -> 0     i=4 (0, 0, 0) -> 0
    #   i=1 (-.5, .25, .25) -> 1           i=5 (-.5, .25, .25) -> 1
    #   i=2 (0, -.5, .5) -> 2              i=6 (0, -.5, .5) -> 2
    #   i=3 (.5, -.25, -.25) -> 0          i=7 (.5, -.25, -.25) -> 0
    dataset_index, dataset_sample_index = build_blending_indices([0.5, 0.25, 0.25], 8)
    assert dataset_index.tolist() == [0, 1, 2, 0, 0, 1, 2, 0]
    assert dataset_sample_index.tolist() == [0, 0, 0, 1, 2, 1, 1, 3]
    assert dataset_index.dtype == numpy.int16 and dataset_sample_index.dtype == numpy.int64


@pytest.mark.parametrize("seed", range(5))
def test_every_prefix_of_the_blend_follows_the_weights(seed):
    rng = numpy.random.default_rng(seed)
    weights = rng.random(int(rng.integers(2, 6))) + 0.01
    weights = weights / weights.sum()
    size = 1000
    dataset_index, dataset_sample_index = build_blending_indices(weights.tolist(), size)
    chosen = numpy.zeros((size, len(weights)))
    chosen[numpy.arange(size), dataset_index] = 1
    counts = chosen.cumsum(axis=0)  # counts[m - 1]: samples per dataset among the first m
    # The rule targets weight * (m - 1) after m samples (the max(i, 1) lag); it stays within
    # one sample of that at every prefix length.
    lagged_target = numpy.arange(1, size)[:, None] * weights[None, :]
    assert numpy.abs(counts[1:] - lagged_target).max() <= 1
    # Each dataset's samples are taken in order, each once.
    for dataset in range(len(weights)):
        taken = dataset_sample_index[dataset_index == dataset]
        assert taken.tolist() == list(range(len(taken)))


@pytest.fixture
def two_datasets(tmp_path) -> list[GPTDataset]:
    config = GPTDatasetConfig(random_seed=1, sequence_length=SEQ, path_to_cache=str(tmp_path))
    datasets = []
    for number, num_samples in enumerate((40, 70)):
        prefix = write_corpus(str(tmp_path / f"c{number}"), random_documents(20, seed=number))
        indexed = IndexedDataset(prefix)
        documents = numpy.arange(len(indexed))
        datasets.append(GPTDataset(indexed, prefix, documents, num_samples, "train", config))
    return datasets


def test_samples_come_from_the_chosen_dataset(two_datasets, tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=SEQ, path_to_cache=str(tmp_path))
    blend = BlendedDataset(two_datasets, [1, 2], 90, config)
    assert len(blend) == 90 and blend.weights == pytest.approx([1 / 3, 2 / 3])
    assert numpy.bincount(blend.dataset_index).tolist() == [30, 60]
    for idx in range(len(blend)):
        expected = two_datasets[blend.dataset_index[idx]][blend.dataset_sample_index[idx]]
        sample = blend[idx]
        # Upstream's format: the dataset's number first, then the dataset's sample.
        assert list(sample) == ["dataset_id", *expected]
        assert sample["dataset_id"] == blend.dataset_index[idx]
        assert sample["dataset_id"].dtype == numpy.int16
        assert all(torch.equal(sample[key], expected[key]) for key in expected)
    with pytest.raises(IndexError):
        blend[90]


def test_blend_indices_are_cached_and_deterministic(two_datasets, tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=SEQ, path_to_cache=str(tmp_path))
    first = BlendedDataset(two_datasets, [0.4, 0.6], 80, config)
    again = BlendedDataset(two_datasets, [0.4, 0.6], 80, config)
    assert first.built_anew_on_cache_miss and not again.built_anew_on_cache_miss
    numpy.testing.assert_array_equal(first.dataset_index, again.dataset_index)
    numpy.testing.assert_array_equal(first.dataset_sample_index, again.dataset_sample_index)
    expected = build_blending_indices([0.4, 0.6], 80)
    numpy.testing.assert_array_equal(again.dataset_index, expected[0])
    assert BlendedDataset(two_datasets, [0.5, 0.5], 80, config).built_anew_on_cache_miss


def test_blend_errors(two_datasets, tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=SEQ, path_to_cache=str(tmp_path))
    with pytest.raises(ValueError, match="one weight each"):
        BlendedDataset(two_datasets, [1.0], 10, config)
    with pytest.raises(ValueError, match="positive finite"):
        BlendedDataset(two_datasets, [1.0, 0.0], 10, config)
    with pytest.raises(ValueError, match="positive finite"):
        BlendedDataset(two_datasets, [1.0, -1.0], 10, config)
    # The first dataset has 40-odd samples; a blend of 200 at 1:1 takes 100 from it.
    with pytest.raises(ValueError, match="takes 100 samples from dataset 0"):
        BlendedDataset(two_datasets, [1, 1], 200, config)
