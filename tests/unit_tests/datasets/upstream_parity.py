"""Checks this project's GPT datasets against Megatron-core 0.19.2's golden arrays
(`fixtures/upstream_gpt.npz`, made by `fixtures/make_upstream_fixtures.py`): shared by
`test_upstream_parity.py` and the flag-path test of `pretrain_gpt.py`."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy
import torch

from megatron.core.datasets import BlendedDataset, GPTDataset
from tests.unit_tests.datasets.fixtures import parity_cases

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "upstream_gpt.npz"

SPLITS = ("train", "valid", "test")

CASES = {case["name"]: case for case in parity_cases.CASES}


@functools.lru_cache(maxsize=1)
def golden() -> dict[str, numpy.ndarray]:
    """Every array of the fixture, loaded once."""
    with numpy.load(FIXTURE) as arrays:
        return {name: arrays[name] for name in arrays.files}


def write_corpora(folder: str, names: list[str] | None = None) -> str:
    """Writes the corpora (all, or `names`) into `folder`, checking that each file is
    byte-identical to the one upstream read; returns the folder."""
    arrays = golden()
    for name in names or list(parity_cases.CORPORA):
        prefix = parity_cases.write_corpus(folder, name)
        for extension in ("bin", "idx"):
            digest = parity_cases.file_digest(f"{prefix}.{extension}")
            assert digest == str(arrays[f"corpus/{name}/{extension}_sha256"]), (name, extension)
    return folder


def _assert_same(actual, expected, what: str) -> None:
    actual = numpy.asarray(actual)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    numpy.testing.assert_array_equal(actual, expected, err_msg=what)


def _assert_gpt_indices(dataset: GPTDataset, key: str) -> None:
    arrays = golden()
    for name in ("document_index", "sample_index", "shuffle_index"):
        _assert_same(getattr(dataset, name), arrays[f"{key}/{name}"], f"{key}/{name}")


def _assert_samples(dataset, key: str) -> None:
    arrays = golden()
    indices = arrays[f"{key}/sample_indices"].tolist()
    names = sorted(
        {name.rsplit("/", 1)[1] for name in arrays if name.startswith(f"{key}/samples/")}
    )
    samples = [dataset[index] for index in indices]
    for sample in samples:
        assert sorted(sample) == names, f"{key}: keys {sorted(sample)} != upstream's {names}"
    for name in names:
        values = [
            value.numpy() if torch.is_tensor(value) else value
            for value in (sample[name] for sample in samples)
        ]
        _assert_same(numpy.stack(values), arrays[f"{key}/samples/{name}"], f"{key}/{name}")


def assert_matches_upstream(case_name: str, datasets) -> list[str]:
    """Asserts that the train, valid and test `datasets` built for `case_name` are upstream's
    (kind, length, every index array, the recorded samples with every key); returns, per
    split, "identical", "None (both)", or, for a split asked for no samples, which upstream
    builds (one epoch nothing reads) and this project does not, "None here"."""
    arrays = golden()
    assert str(arrays[f"{case_name}/outcome"]) == "built", case_name
    verdicts = []
    for split, dataset, size in zip(SPLITS, datasets, CASES[case_name]["sizes"]):
        key = f"{case_name}/{split}"
        kind = str(arrays[f"{key}/kind"])
        if size == 0 and kind != "none":
            assert dataset is None, f"{key}: a split asked for no samples is None here"
            verdicts.append("None here (upstream: an unread epoch)")
            continue
        if kind == "none":
            assert dataset is None, f"{key}: upstream has none"
            verdicts.append("None (both)")
            continue
        assert dataset is not None, f"{key}: upstream builds a {kind} dataset"
        assert len(dataset) == int(arrays[f"{key}/length"]), f"{key}: length"
        if kind == "blend":
            assert isinstance(dataset, BlendedDataset), f"{key}: upstream builds a blend"
            for name in ("dataset_index", "dataset_sample_index"):
                _assert_same(getattr(dataset, name), arrays[f"{key}/{name}"], f"{key}/{name}")
            assert len(dataset.datasets) == int(arrays[f"{key}/members"]), f"{key}: members"
            for number, member in enumerate(dataset.datasets):
                member_key = f"{key}/member{number}"
                assert len(member) == int(arrays[f"{member_key}/length"]), member_key
                _assert_gpt_indices(member, member_key)
        else:
            assert isinstance(dataset, GPTDataset), f"{key}: upstream builds a GPTDataset"
            _assert_gpt_indices(dataset, key)
        _assert_samples(dataset, key)
        verdicts.append("identical")
    return verdicts
