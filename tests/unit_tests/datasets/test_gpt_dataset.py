"""`GPTDataset`: Megatron-LM's document, sample and shuffle indices; samples are contiguous
windows of the shuffled token stream; epochs; the index cache; EOD masks and positions."""

from __future__ import annotations

import os

import numpy
import pytest
import torch

from megatron.core.datasets import (
    PAD_TOKEN_ID,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    pad_token_of,
)
from megatron.core.datasets.gpt_dataset import build_sample_index, get_ltor_masks_and_position_ids
from megatron.core.datasets.tokenizers import ByteLevelTokenizer
from tests.unit_tests.datasets.corpus import (
    EOD,
    random_documents,
    reference_gpt_indices,
    reference_sample_index,
    write_corpus,
)
from tests.unit_tests.distributed_harness import run_distributed

SEQ = 16


@pytest.fixture
def corpus(tmp_path) -> str:
    return write_corpus(str(tmp_path / "data" / "corpus"), random_documents(60, seed=3))


def _dataset(prefix, num_samples, seed=1234, cache=None, documents=None, split="train", **kw):
    indexed = IndexedDataset(prefix)
    documents = numpy.arange(len(indexed)) if documents is None else documents
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=SEQ, path_to_cache=cache, eod_token=EOD, **kw
    )
    return GPTDataset(indexed, prefix, documents, num_samples, split, config)


def _text(sample: dict) -> list[int]:
    return sample["tokens"].tolist() + sample["labels"][-1:].tolist()


@pytest.mark.parametrize(
    "drop_last, extra", [(True, 1), (False, 1), (True, 0), (False, 0)], ids=str
)
@pytest.mark.parametrize("seq_length", [1, 3, 16, 50])
def test_sample_index_matches_megatrons_loop(seq_length, drop_last, extra):
    """Also for a partial last sample kept, and samples without the extra token (whose ends
    fall on document ends and after empty documents: 0-sized ones are drawn often)."""
    rng = numpy.random.default_rng(seq_length)
    # Empty documents and documents longer than a sample, over several epochs.
    sizes = rng.integers(0, 40, size=30).astype(numpy.int32)
    documents = numpy.arange(5, 25, dtype=numpy.int32)
    tokens_per_epoch = int(sizes[documents].sum())
    for num_epochs in (1, 3):
        document_index = numpy.tile(documents, num_epochs)
        rng.shuffle(document_index)
        arguments = (sizes, document_index, seq_length, num_epochs, tokens_per_epoch)
        expected = reference_sample_index(*arguments, drop_last, extra)
        actual = build_sample_index(
            *arguments, drop_last_partial_sample=drop_last, add_extra_token=bool(extra)
        )
        assert actual.dtype == numpy.int32
        numpy.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize(
    "epochs, separate_final_epoch",
    # Samples wanted, in epochs: a final epoch used under 80% is shuffled on its own.
    [(None, False), (0.4, False), (2.1, True), (2.95, False), (6.5, True)],
)
def test_indices_match_megatrons(corpus, tmp_path, epochs, separate_final_epoch):
    documents = numpy.arange(10, 55, dtype=numpy.int32)
    sizes = IndexedDataset(corpus).sequence_lengths
    samples_per_epoch = (int(sizes[documents].sum()) - 1) // SEQ
    num_samples = None if epochs is None else int(epochs * samples_per_epoch)
    dataset = _dataset(corpus, num_samples, seed=7, cache=str(tmp_path / "c"), documents=documents)
    *reference, separate = reference_gpt_indices(sizes, documents, SEQ, num_samples or 0, seed=7)
    assert separate == separate_final_epoch
    for actual, expected in zip(
        (dataset.document_index, dataset.sample_index, dataset.shuffle_index), reference
    ):
        assert actual.dtype == expected.dtype
        numpy.testing.assert_array_equal(actual, expected)


def test_samples_are_windows_of_the_shuffled_stream(corpus, tmp_path):
    num_samples = 300
    dataset = _dataset(corpus, num_samples, cache=str(tmp_path / "c"))
    indexed = IndexedDataset(corpus)
    tokens_per_epoch = int(indexed.sequence_lengths.sum())
    epochs = -(-(num_samples * SEQ + 1) // tokens_per_epoch)
    assert epochs > 2
    # Every document is used once per epoch.
    counts = numpy.bincount(dataset.document_index, minlength=len(indexed))
    assert (counts == epochs).all()
    assert len(dataset) == (epochs * tokens_per_epoch - 1) // SEQ >= num_samples
    stream = numpy.concatenate([indexed[int(d)] for d in dataset.document_index])
    assert sorted(dataset.shuffle_index.tolist()) == list(range(len(dataset)))
    for idx in range(len(dataset)):
        start = int(dataset.shuffle_index[idx]) * SEQ
        sample = dataset[idx]
        assert _text(sample) == stream[start : start + SEQ + 1].tolist()
        assert sample["tokens"].dtype == sample["labels"].dtype == torch.int64
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_same_seed_same_samples_other_seed_other_order(corpus, tmp_path):
    first = _dataset(corpus, 100, seed=5, cache=str(tmp_path / "a"))
    again = _dataset(corpus, 100, seed=5, cache=str(tmp_path / "b"))
    other = _dataset(corpus, 100, seed=6, cache=str(tmp_path / "c"))
    assert again.built_anew_on_cache_miss and first.built_anew_on_cache_miss
    assert all(_text(first[i]) == _text(again[i]) for i in range(len(first)))
    differing = sum(_text(first[i]) != _text(other[i]) for i in range(len(first)))
    assert differing > 0.9 * len(first)


def test_cache_is_reused_and_keyed_by_what_the_indices_depend_on(corpus):
    first = _dataset(corpus, 100)
    cache_dir = os.path.join(os.path.dirname(corpus), "cache", "GPTDataset_indices")
    files = sorted(os.listdir(cache_dir))
    assert len(files) == 4 and all("-GPTDataset-train-" in name for name in files)
    mtimes = {name: os.stat(os.path.join(cache_dir, name)).st_mtime_ns for name in files}
    assert first.built_anew_on_cache_miss

    again = _dataset(corpus, 100)
    assert not again.built_anew_on_cache_miss
    assert {n: os.stat(os.path.join(cache_dir, n)).st_mtime_ns for n in files} == mtimes
    assert all(_text(first[i]) == _text(again[i]) for i in range(len(first)))

    # Another sample count, seed, split or way of cutting samples gets its own files.
    assert _dataset(corpus, 101).built_anew_on_cache_miss
    assert _dataset(corpus, 100, seed=1).built_anew_on_cache_miss
    assert _dataset(corpus, 100, split="valid").built_anew_on_cache_miss
    assert _dataset(corpus, 100, add_extra_token_to_sequence=False).built_anew_on_cache_miss
    partial = dict(split="valid", drop_last_partial_validation_sequence=False)
    assert _dataset(corpus, 100, **partial).built_anew_on_cache_miss
    assert len(os.listdir(cache_dir)) == 24
    # A cache missing a file (a run killed between writes) is rebuilt, not half-loaded.
    os.remove(os.path.join(cache_dir, files[-1]))
    assert _dataset(corpus, 100).built_anew_on_cache_miss
    assert not any(name.endswith(".tmp") for name in os.listdir(cache_dir))


def test_a_damaged_cache_file_is_named_with_the_fix(corpus, tmp_path):
    """Before: numpy's "EOF: reading array header" naming no file."""
    cache = str(tmp_path / "c")
    _dataset(corpus, 100, cache=cache)
    (damaged,) = [name for name in os.listdir(cache) if name.endswith("sample_index.npy")]
    with open(os.path.join(cache, damaged), "r+b") as file:
        file.truncate(100)
    with pytest.raises(ValueError, match=f"cache file .*{damaged} is damaged .*delete it"):
        _dataset(corpus, 100, cache=cache)


def _build_on_ranks(prefix: str, cache: str) -> tuple[bool, list[int]]:
    dataset = _dataset(prefix, 50, cache=cache)
    return dataset.built_anew_on_cache_miss, _text(dataset[7])


def test_rank_zero_builds_and_the_others_load(corpus, tmp_path):
    results = run_distributed(_build_on_ranks, 2, corpus, str(tmp_path / "c"))
    assert [built for built, _ in results] == [True, False]
    assert results[0][1] == results[1][1]


def test_reordered_corpus_of_the_same_size_is_not_served_a_stale_cache(tmp_path):
    """The cache is keyed by the .idx content: a corpus re-tokenised into the same prefix with
    its documents reordered (same document count, same token count) gets new indices, and the
    samples follow the new files (a stale cache gave an IndexError or wrong samples)."""
    documents = random_documents(40, seed=9)
    prefix = write_corpus(str(tmp_path / "data" / "corpus"), documents)
    first = _dataset(prefix, 60)
    assert first.built_anew_on_cache_miss
    reordered = documents[::-1]
    write_corpus(prefix, reordered)
    again = _dataset(prefix, 60)
    assert again.built_anew_on_cache_miss
    assert again.tokens_per_epoch == first.tokens_per_epoch
    stream = numpy.concatenate([reordered[int(d)] for d in again.document_index])
    for idx in range(len(again)):
        start = int(again.shuffle_index[idx]) * SEQ
        assert _text(again[idx]) == stream[start : start + SEQ + 1].tolist()
    # The old files are still valid for the old corpus: writing it back loads them.
    write_corpus(prefix, documents)
    assert not _dataset(prefix, 60).built_anew_on_cache_miss


def test_fewer_tokens_than_one_sample_repeat_epochs(tmp_path):
    # 8 tokens, samples of 16 + 1: upstream repeats the documents for enough epochs.
    prefix = write_corpus(str(tmp_path / "tiny"), [[1, 2, EOD], [3, 4, 5, 6, EOD]])
    dataset = _dataset(prefix, 10)
    assert len(dataset) >= 10
    assert numpy.bincount(dataset.document_index).tolist() == [21, 21]
    # One epoch of too few tokens: no sample at all.
    assert len(_dataset(prefix, None)) == 0
    empty = write_corpus(str(tmp_path / "empty"), [[], []])
    with pytest.raises(ValueError, match=r"train split of .*empty has 2 documents and no token"):
        _dataset(empty, 10)


# Hand-worked example: EOD = 0 at positions 1 and 4, so the documents (for attention and
# positions) are positions {0, 1}, {2, 3, 4} and {5}.
TOKENS = torch.tensor([5, EOD, 7, 8, EOD, 3])


def test_masks_without_eod_options_are_plain():
    mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        TOKENS, EOD, False, False, False, False
    )
    assert mask is None
    assert torch.equal(loss_mask, torch.ones(6))
    assert torch.equal(position_ids, torch.arange(6))
    # Upstream's default: the dense causal mask (True = masked out).
    mask, _, _ = get_ltor_masks_and_position_ids(TOKENS, EOD, False, False, False, True)
    assert torch.equal(mask[0], ~torch.ones(6, 6, dtype=torch.bool).tril())


def test_eod_mask_loss_and_reset_position_ids():
    _, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        TOKENS, EOD, True, False, True, False
    )
    assert loss_mask.tolist() == [1, 0, 1, 1, 0, 1] and loss_mask.dtype == torch.float32
    assert position_ids.tolist() == [0, 1, 0, 1, 2, 0]
    _, _, position_ids = get_ltor_masks_and_position_ids(TOKENS, EOD, False, False, True, False)
    assert position_ids.tolist() == list(range(6))


def test_reset_attention_mask_is_causal_within_documents():
    mask, _, position_ids = get_ltor_masks_and_position_ids(TOKENS, EOD, False, True, False, True)
    visible = [  # row = query, column = key; 1 = may attend
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert mask.shape == (1, 6, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[0], torch.tensor(visible) == 0)
    assert position_ids.tolist() == list(range(6))
    # With no EOD in the sample it is GPTModel's own causal mask.
    plain, _, _ = get_ltor_masks_and_position_ids(
        torch.tensor([4, 5, 6]), EOD, False, True, False, True
    )
    assert torch.equal(plain[0], ~torch.ones(3, 3, dtype=torch.bool).tril())


def test_dataset_samples_carry_the_masks(corpus, tmp_path):
    plain = _dataset(corpus, 40, cache=str(tmp_path / "c"))
    assert list(plain[0]) == ["tokens", "labels", "attention_mask", "loss_mask", "position_ids"]
    assert torch.equal(plain[3]["attention_mask"][0], ~torch.ones(SEQ, SEQ).bool().tril())
    assert torch.equal(plain[3]["loss_mask"], torch.ones(SEQ))
    no_mask = _dataset(corpus, 40, cache=str(tmp_path / "c"), create_attention_mask=False)
    assert list(no_mask[0]) == ["tokens", "labels", "loss_mask", "position_ids"]
    masked = _dataset(
        corpus,
        40,
        cache=str(tmp_path / "c"),
        eod_mask_loss=True,
        reset_position_ids=True,
        reset_attention_mask=True,
    )
    # The options change the masks only, not the indices: the cache is shared.
    assert not masked.built_anew_on_cache_miss
    for idx in range(len(masked)):
        sample = masked[idx]
        assert torch.equal(sample["tokens"], plain[idx]["tokens"])
        is_eod = sample["tokens"] == EOD
        assert torch.equal(sample["loss_mask"], (~is_eod).float())
        expected = get_ltor_masks_and_position_ids(sample["tokens"], EOD, True, True, True, True)
        assert torch.equal(sample["attention_mask"], expected[0])
        assert torch.equal(sample["position_ids"], expected[2])


def test_pad_id_is_masked_and_zeroed(tmp_path):
    """Upstream's pad rule: no loss where the label is the pad id, and the pad id becomes 0 in
    tokens and labels; `ds[None]` is a padding sample without loss."""
    prefix = write_corpus(
        str(tmp_path / "padded"), [numpy.array([5, 3, 3, 7, 3, EOD])] * 10, dtype=numpy.uint16
    )
    dataset = _dataset(prefix, 10, pad_token=3)
    plain = _dataset(prefix, 10)
    for idx in range(len(dataset)):
        text = torch.tensor(_text(plain[idx]))
        sample = dataset[idx]
        assert torch.equal(sample["loss_mask"], (text[1:] != 3).float())
        assert torch.equal(sample["tokens"], torch.where(text[:-1] == 3, 0, text[:-1]))
        assert torch.equal(sample["labels"], torch.where(text[1:] == 3, 0, text[1:]))
    padding = dataset[None]
    assert torch.equal(padding["tokens"], dataset[0]["tokens"])
    assert not padding["loss_mask"].any()


class _Tokenizer:
    def __init__(self, pad, eod=0, eos=None):
        self._pad, self.eod, self._eos = pad, eod, eos

    @property
    def pad(self):
        if self._pad is None:
            raise NotImplementedError("no pad")
        return self._pad

    @property
    def eos(self):
        if self._eos is None:
            raise NotImplementedError("no eos")
        return self._eos


def test_pad_token_of_follows_upstreams_rule():
    assert pad_token_of(_Tokenizer(pad=5)) == 5
    assert pad_token_of(_Tokenizer(pad=None)) == PAD_TOKEN_ID == -1
    # A pad id that is also EOD's or EOS's would mask real EODs: upstream ignores it.
    assert pad_token_of(_Tokenizer(pad=0, eod=0)) == -1
    assert pad_token_of(_Tokenizer(pad=2, eos=2)) == -1
    assert pad_token_of(_Tokenizer(pad=2, eos=2), allow_ambiguous=True) == 2
    assert pad_token_of(ByteLevelTokenizer()) == 256


def test_config_errors():
    with pytest.raises(ValueError, match="no-create-attention-mask-in-dataloader"):
        GPTDatasetConfig(
            random_seed=1,
            sequence_length=8,
            eod_token=0,
            reset_attention_mask=True,
            create_attention_mask=False,
        )
    with pytest.raises(ValueError, match="eod_mask_loss needs eod_token"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, eod_mask_loss=True)
    with pytest.raises(ValueError, match="sequence_length=0"):
        GPTDatasetConfig(random_seed=1, sequence_length=0)
    with pytest.raises(ValueError, match="excludes blend and split"):
        GPTDatasetConfig(
            random_seed=1, sequence_length=8, split="1,1,1", blend_per_split=[None] * 3
        )
