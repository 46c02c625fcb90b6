"""Every index array and sample of this project's GPT datasets equals Megatron-core 0.19.2's on
the same files and configurations (`fixtures/parity_cases.py`, golden arrays made by upstream
itself with `fixtures/make_upstream_fixtures.py`): single datasets over several sizes and
splits (the legacy split rule differing), epochs, empty and multi-sequence documents, int32
tokens, a multimodal index, a split of fewer tokens than a sample, the EOD flags, the dense
attention mask, the pad id, weighted and size-weighted blends of two and three datasets, a
single weighted prefix and per-split data. Also `IndexedDataset` slices and multimodal reads."""

from __future__ import annotations

import numpy
import pytest

from megatron.core.datasets import (
    GPTDatasetConfig,
    IndexedDataset,
    build_gpt_datasets,
    get_split_indices,
    parse_and_normalize_split,
    parse_data_path,
)
from megatron.core.datasets.gpt_dataset import PAD_TOKEN_ID
from tests.unit_tests.datasets.fixtures import parity_cases
from tests.unit_tests.datasets.upstream_parity import (
    CASES,
    assert_matches_upstream,
    golden,
    write_corpora,
)

BUILT = [
    name
    for name in CASES
    if str(golden()[f"{name}/outcome"]) == "built" and 0 not in CASES[name]["sizes"][:1]
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return write_corpora(str(tmp_path_factory.mktemp("parity")))


def _build(case: dict, folder: str, cache: str):
    """This project's datasets for a case, from its `--data-path` list (or per-split blends)."""
    per_split = None
    if case["per_split"] is not None:
        per_split = [
            parse_data_path(parity_cases.with_prefixes(data, folder)) if data else None
            for data in case["per_split"]
        ]
    config = GPTDatasetConfig(
        random_seed=case["seed"],
        sequence_length=case["seq"],
        blend_per_split=per_split,
        split=case["split"],
        path_to_cache=cache,
        reset_position_ids=case["reset_position_ids"],
        reset_attention_mask=case["reset_attention_mask"],
        eod_mask_loss=case["eod_mask_loss"],
        create_attention_mask=case["create_attention_mask"],
        add_extra_token_to_sequence=case["add_extra_token"],
        drop_last_partial_validation_sequence=case["drop_last_valid"],
        eod_token=case["eod"],
        # The fixture's tokenizer has no EOS: upstream drops a pad id equal to EOD's.
        pad_token=PAD_TOKEN_ID if case["pad"] in (None, case["eod"]) else case["pad"],
        vocab_size=case["vocab"],
    )
    data_path = parity_cases.with_prefixes(case["data"], folder)
    return build_gpt_datasets(config, case["sizes"], data_path)


@pytest.mark.parametrize("name", BUILT)
def test_datasets_match_upstream(name, folder, tmp_path):
    datasets = _build(CASES[name], folder, str(tmp_path / "cache"))
    assert_matches_upstream(name, datasets)
    # Loaded from the cache, the same again.
    again = _build(CASES[name], folder, str(tmp_path / "cache"))
    assert_matches_upstream(name, again)


def _legacy_split_indices(split: str, num_documents: int) -> list[int]:
    """The rule used before: each share rounded, the surplus taken off the later boundaries."""
    bounds = [0]
    for weight in parse_and_normalize_split(split):
        bounds.append(bounds[-1] + int(round(weight * float(num_documents))))
    surplus = bounds[-1] - num_documents
    return [0, *(bound - surplus for bound in bounds[1:])]


@pytest.mark.parametrize(
    "name", ["single_c517_969", "single_c650_969", "single_c125_98", "single_c57_80"]
)
def test_cases_include_splits_where_the_legacy_rule_differs(name, folder):
    """These cases pass only with the cumulative rule: the legacy one moves a boundary."""
    case = CASES[name]
    (corpus,) = case["data"]
    documents = len(IndexedDataset(f"{folder}/{corpus}"))
    cumulative = get_split_indices(parse_and_normalize_split(case["split"]), documents)
    assert cumulative != _legacy_split_indices(case["split"], documents)
    # Upstream's train split used exactly the cumulative rule's documents.
    used = numpy.unique(golden()[f"{name}/train/document_index"])
    assert used.tolist() == list(range(cumulative[0], cumulative[1]))


def test_upstream_never_returns_on_a_split_without_documents(folder, tmp_path):
    """969,30,1 of 125 documents leaves the test split none: upstream's epoch loop never ends
    (recorded as hanging); here that split is None and the others are built."""
    assert str(golden()["empty_split_upstream_hangs/outcome"]) == "hangs"
    case = CASES["empty_split_upstream_hangs"]
    train, valid, test = _build(case, folder, str(tmp_path))
    assert len(train) >= 100 and len(valid) >= 10 and test is None


def test_a_split_asked_for_no_samples_is_none(folder, tmp_path):
    """Upstream builds one unused epoch of a split asked for 0 samples; here it is None (the
    other splits are identical)."""
    name = "split_asked_for_no_samples"
    assert str(golden()[f"{name}/valid/kind"]) == "gpt"
    verdicts = assert_matches_upstream(name, _build(CASES[name], folder, str(tmp_path)))
    assert verdicts == ["identical", "None here (upstream: an unread epoch)", "identical"]


def test_indexed_dataset_slices_and_multimodal_reads(folder):
    arrays = golden()
    multimodal = IndexedDataset(f"{folder}/multimodal", multimodal=True)
    sequences, modes = multimodal[2:7]
    numpy.testing.assert_array_equal(
        numpy.concatenate(sequences), arrays["indexed/multimodal/slice_tokens"]
    )
    assert [len(s) for s in sequences] == arrays["indexed/multimodal/slice_lengths"].tolist()
    numpy.testing.assert_array_equal(modes, arrays["indexed/multimodal/slice_modes"])
    tokens, mode = multimodal[5]
    numpy.testing.assert_array_equal(tokens, arrays["indexed/multimodal/item5_tokens"])
    assert mode == arrays["indexed/multimodal/item5_mode"]
    tokens, mode = multimodal.get(5, offset=1, length=2)
    numpy.testing.assert_array_equal(tokens, arrays["indexed/multimodal/get5_tokens"])
    assert mode == arrays["indexed/multimodal/get5_mode"]
    # Read as text, the same file gives the sequences alone.
    assert IndexedDataset(f"{folder}/multimodal")[5].tolist() == tokens_of(multimodal, 5)

    plain = IndexedDataset(f"{folder}/sentences")
    sequences = plain[4:11]
    numpy.testing.assert_array_equal(
        numpy.concatenate(sequences), arrays["indexed/sentences/slice_tokens"]
    )
    assert [len(s) for s in sequences] == arrays["indexed/sentences/slice_lengths"].tolist()
    numpy.testing.assert_array_equal(
        plain.document_indices, arrays["indexed/sentences/document_indices"]
    )
    with pytest.raises(ValueError, match="contiguous"):
        plain[0:6:2]
    assert plain[5:5] == [] and len(plain[-3:]) == 3
    with pytest.raises(ValueError, match="multimodal=True"):
        plain.sequence_modes  # noqa: B018


def tokens_of(dataset: IndexedDataset, idx: int) -> list[int]:
    return dataset[idx][0].tolist()


def test_samples_do_not_depend_on_what_was_read_before(folder, tmp_path):
    """Upstream, without the EOD flags, caches the first sample's loss mask and zeroes its pad
    positions in the cache itself, so later samples read by the same process lose the loss at
    those positions too (recorded as `loss_mask_read_in_order`). Here each sample follows the
    pad rule alone, whatever was read before: the samples as upstream gives them read first."""
    arrays = golden()
    key = "pad_id/train"
    fresh, in_order = arrays[f"{key}/samples/loss_mask"], arrays[f"{key}/loss_mask_read_in_order"]
    assert (fresh != in_order).any()
    train = _build(CASES["pad_id"], folder, str(tmp_path))[0]
    indices = arrays[f"{key}/sample_indices"].tolist()
    for _ in range(2):
        read = numpy.stack([train[index]["loss_mask"].numpy() for index in indices])
        numpy.testing.assert_array_equal(read, fresh)
