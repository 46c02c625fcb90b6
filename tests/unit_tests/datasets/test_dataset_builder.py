"""`build_gpt_datasets()`: `--data-path` and `--split` parsing, per-split documents, blends
with Megatron-LM's sample margin, per-split blends, and the error for each bad input."""

from __future__ import annotations

import math

import numpy
import pytest

from megatron.core.datasets import (
    BlendedDataset,
    GPTDataset,
    GPTDatasetConfig,
    build_gpt_datasets,
    get_split_indices,
    parse_and_normalize_split,
    parse_data_path,
)
from megatron.core.datasets.splits import split_matrix
from tests.unit_tests.datasets.corpus import random_documents, write_corpus

SEQ = 8


def _config(tmp_path, **kw) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=1, sequence_length=SEQ, path_to_cache=str(tmp_path / "cache"), **kw
    )


@pytest.fixture
def corpora(tmp_path) -> list[str]:
    return [
        write_corpus(str(tmp_path / name), random_documents(100, seed=seed))
        for seed, name in enumerate(("a", "b"))
    ]


def test_parse_data_path():
    assert parse_data_path(["/data/corpus"]) == (["/data/corpus"], None)
    # Prefixes alone: a blend weighted by the datasets' sizes (Megatron-LM's form).
    assert parse_data_path(["a", "b", "c"]) == (["a", "b", "c"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["2", "a", "0", "b"]) == (["a", "b"], [2.0, 0.0])
    with pytest.raises(ValueError, match=r"entry 3 \('b'\) should be a weight"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(ValueError, match="weight '0.5' has no prefix after it"):
        parse_data_path(["0.3", "a", "0.5"])
    with pytest.raises(ValueError, match="is empty"):
        parse_data_path([])
    with pytest.raises(ValueError, match=r"entry 1 \('a'\) should be a weight"):
        parse_data_path(["a", "0.5"])
    with pytest.raises(ValueError, match=r"entry 4 \('0.5'\) should be a prefix"):
        parse_data_path(["0.3", "a", "0.7", "0.5"])
    with pytest.raises(ValueError, match="weight -0.5 of dataset 'b'"):
        parse_data_path(["1", "a", "-0.5", "b"])
    with pytest.raises(ValueError, match="all 0"):
        parse_data_path(["0", "a", "0", "b"])


def test_parse_and_normalize_split():
    assert parse_and_normalize_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_and_normalize_split("99, 1") == pytest.approx([0.99, 0.01, 0.0])
    assert parse_and_normalize_split("1/1/2") == pytest.approx([0.25, 0.25, 0.5])
    for separated in ("98 2 0", "98:2:0", "98;2;0", " 98 , 2 "):  # as upstream reads them
        assert parse_and_normalize_split(separated) == pytest.approx([0.98, 0.02, 0.0])
    for bad, message in [
        ("a,b", "'a' is not a number"),
        ("1,2,3,4", "4 weights"),
        ("-1,2", "'-1' must be a finite number >= 0"),
        ("0,0,0", "every split weight 0"),
        ("", "holds no weight"),
        ("9,x", "'x' is not a number"),
        ("1,nan", "'nan' must be a finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_and_normalize_split(bad)
    with pytest.raises(ValueError, match="'x' is not a number"):
        GPTDatasetConfig(random_seed=1, sequence_length=SEQ, split="x")


def test_split_boundaries():
    # Megatron-core's cumulative rule: boundary k is round(c_k * n) of the accumulated weights.
    # 969,30,1 of 1000: 969, 30 and 1 exactly.
    assert get_split_indices(parse_and_normalize_split("969,30,1"), 1000) == [0, 969, 999, 1000]
    # 1,1,1 of 10: 3.33 -> 3, 6.67 -> 7 (the legacy rule, each share rounded, gave 4 and 7).
    assert get_split_indices(parse_and_normalize_split("1,1,1"), 10) == [0, 3, 7, 10]
    # 969,30,1 of 49: 47.48 -> 47, 48.95 -> 49 (the legacy rule gave [0, 48, 49, 49]).
    assert get_split_indices(parse_and_normalize_split("969,30,1"), 49) == [0, 47, 49, 49]
    # 2,2,1 of 9: 3.6 -> 4, 7.2 -> 7.
    assert get_split_indices(parse_and_normalize_split("2,2,1"), 9) == [0, 4, 7, 9]
    assert get_split_indices(parse_and_normalize_split("1,0,0"), 7) == [0, 7, 7, 7]
    # A split of weight 0 has no book-ends at all (no dataset), not an empty range.
    assert split_matrix(parse_and_normalize_split("1,0,1")) == [(0, 0.5), None, (0.5, 1.0)]


def test_single_prefix_splits_documents(corpora, tmp_path):
    config = _config(tmp_path, split="80,15,5")
    train, valid, test = build_gpt_datasets(config, [200, 30, 10], [corpora[0]])
    assert all(isinstance(d, GPTDataset) for d in (train, valid, test))
    ranges = [d.indices.tolist() for d in (train, valid, test)]
    # Disjoint, in order, covering all 100 documents, in the normalised proportions.
    assert ranges == [list(range(0, 80)), list(range(80, 95)), list(range(95, 100))]
    for dataset, wanted in zip((train, valid, test), (200, 30, 10)):
        assert dataset.num_samples == wanted and len(dataset) >= wanted
        assert set(numpy.unique(dataset.document_index)) <= set(dataset.indices.tolist())


def test_absent_splits_are_none(corpora, tmp_path):
    # No samples wanted, or split weight 0.
    _, valid, test = build_gpt_datasets(
        _config(tmp_path, split="90,10,0"), [50, 0, 10], [corpora[0]]
    )
    assert valid is None and test is None
    # 10 documents at 969,30,1: the boundaries round to 10 and 10, so no valid/test document
    # (upstream never returns then: its epoch loop cannot reach a sample without tokens).
    tiny = write_corpus(str(tmp_path / "tiny"), random_documents(10, seed=5, max_length=60))
    train, valid, test = build_gpt_datasets(_config(tmp_path), [20, 5, 5], [tiny])
    assert isinstance(train, GPTDataset) and valid is None and test is None


def test_blend_asks_each_dataset_for_its_share_plus_half_a_percent(corpora, tmp_path):
    sizes = [401, 41, 9]
    datasets = build_gpt_datasets(
        _config(tmp_path, split="90,8,2"), sizes, ["1", corpora[0], "3", corpora[1]]
    )
    for blend, size in zip(datasets, sizes):
        # Upstream's sizing: ceil(size * w) samples used per dataset (the blend's length is
        # their sum), each built with ceil(ceil(size * w) * 1.005).
        targets = [math.ceil(size * 0.25), math.ceil(size * 0.75)]
        assert isinstance(blend, BlendedDataset) and len(blend) == sum(targets) > size
        assert [d.num_samples for d in blend.datasets] == [
            math.ceil(target * 1.005) for target in targets
        ]
        assert [d.dataset_path for d in blend.datasets] == corpora
        counts = numpy.bincount(blend.dataset_index, minlength=2)
        assert abs(counts[0] - 0.25 * len(blend)) <= 1 and counts.sum() == len(blend)
    # Deterministic: the same call gives the same samples (loaded from the cache).
    again = build_gpt_datasets(
        _config(tmp_path, split="90,8,2"), sizes, ["1", corpora[0], "3", corpora[1]]
    )
    assert not again[0].built_anew_on_cache_miss
    for idx in (0, 17, 400):
        assert again[0][idx]["tokens"].tolist() == datasets[0][idx]["tokens"].tolist()


def test_zero_weight_prefix_is_left_out(corpora, tmp_path):
    train, _, _ = build_gpt_datasets(
        _config(tmp_path), [30, 0, 0], ["0", corpora[0], "1", corpora[1]]
    )
    # The one weighted prefix left is a blend of one dataset, as `--data-path 1 PREFIX`.
    assert isinstance(train, BlendedDataset) and len(train.datasets) == 1
    assert train.datasets[0].dataset_path == corpora[1]


def test_one_weighted_prefix_is_a_blend(corpora, tmp_path):
    """Upstream's `--data-path 1.0 PREFIX`: a blend of one dataset, built with its margin, so
    another length and order than the prefix alone."""
    blend = build_gpt_datasets(_config(tmp_path, split="90,10,0"), [50, 5, 0], ["1", corpora[0]])
    plain = build_gpt_datasets(_config(tmp_path, split="90,10,0"), [50, 5, 0], [corpora[0]])
    for weighted, alone, size in zip(blend[:2], plain[:2], (50, 5)):
        assert isinstance(weighted, BlendedDataset) and len(weighted) == size
        assert weighted.datasets[0].num_samples == math.ceil(size * 1.005)
        assert isinstance(alone, GPTDataset) and alone.num_samples == size
        assert weighted[0]["dataset_id"] == 0 and "dataset_id" not in alone[0]


def test_blend_per_split(corpora, tmp_path):
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=SEQ,
        path_to_cache=str(tmp_path / "cache"),
        blend_per_split=[([corpora[0]], None), (corpora, [0.5, 0.5]), None],
    )
    train, valid, test = build_gpt_datasets(config, [30, 20, 10])
    assert isinstance(train, GPTDataset) and train.indices.tolist() == list(range(100))
    assert isinstance(valid, BlendedDataset) and len(valid) == 20
    assert all(d.indices.tolist() == list(range(100)) for d in valid.datasets)
    assert all(d.index_split == "valid" for d in valid.datasets)
    assert test is None


@pytest.mark.parametrize("source", ["config", "data_path"])
def test_unweighted_blend_mixes_by_dataset_length(corpora, tmp_path, source):
    """A blend without weights, from the config or from --data-path's prefixes alone."""
    if source == "config":
        config = _config(tmp_path, blend=(corpora, None), split="1,0,0")
        train, _, _ = build_gpt_datasets(config, [10**6, 0, 0])
    else:
        config = _config(tmp_path, split="1,0,0")
        train, _, _ = build_gpt_datasets(config, [10**6, 0, 0], list(corpora))
    lengths = [len(d) for d in train.datasets]
    assert all(d.num_samples is None for d in train.datasets)
    assert len(train) == sum(lengths)
    assert numpy.bincount(train.dataset_index).tolist() == lengths


def test_mmap_off_reads_the_same_samples(corpora, tmp_path):
    mapped, _, _ = build_gpt_datasets(_config(tmp_path), [30, 0, 0], [corpora[0]])
    read, _, _ = build_gpt_datasets(
        _config(tmp_path, mmap_bin_files=False), [30, 0, 0], [corpora[0]]
    )
    assert all(mapped[i]["tokens"].tolist() == read[i]["tokens"].tolist() for i in range(30))


def test_builder_errors(corpora, tmp_path):
    config = _config(tmp_path)
    missing = str(tmp_path / "nowhere" / "corpus")
    with pytest.raises(ValueError, match=r"nowhere/corpus.*corpus\.bin and .*corpus\.idx missing"):
        build_gpt_datasets(config, [10, 1, 1], ["0.5", corpora[0], "0.5", missing])
    (tmp_path / "half.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"half\.idx missing.*preprocess_data"):
        build_gpt_datasets(config, [10, 1, 1], [str(tmp_path / "half")])
    with pytest.raises(ValueError, match="given twice"):
        build_gpt_datasets(_config(tmp_path, blend=([corpora[0]], None)), [1, 1, 1], corpora[:1])
    with pytest.raises(ValueError, match="No data"):
        build_gpt_datasets(config, [1, 1, 1])
    with pytest.raises(ValueError, match="three sample counts"):
        build_gpt_datasets(config, [1, -1, 1], corpora[:1])
    with pytest.raises(ValueError, match="has no prefix after it"):
        build_gpt_datasets(config, [1, 1, 1], ["1", corpora[0], "2"])
    # 20 documents at 80,10,10: the test split gets the last two, both empty.
    short = write_corpus(str(tmp_path / "short"), [numpy.arange(1, 40)] * 18 + [[], []])
    with pytest.raises(ValueError, match="test split of .*short has 2 documents and no token"):
        build_gpt_datasets(_config(tmp_path, split="80,10,10"), [10, 1, 1], [short])
    empty = write_corpus(str(tmp_path / "empty"), [])
    for data_path in ([empty], ["1", corpora[0], "1", empty]):
        with pytest.raises(ValueError, match=r"empty' holds no document .*empty\.idx lists none"):
            build_gpt_datasets(config, [10, 1, 0], data_path)
    # In a blend, a prefix with no document in a split that needs one is an error.
    tiny = write_corpus(str(tmp_path / "tiny"), random_documents(10, seed=5, max_length=60))
    with pytest.raises(ValueError, match="tiny' has no document in the valid split"):
        build_gpt_datasets(config, [10, 2, 0], ["1", corpora[0], "1", tiny])
