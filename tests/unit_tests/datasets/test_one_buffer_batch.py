"""`collate_in_one_buffer`: a batch from loader workers crosses between processes as one tensor
and arrives as the dict `default_collate` makes."""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # noqa: F401 (registers the tensors' shared-memory pickling)
from torch.multiprocessing import reductions
from torch.utils.data import default_collate

from megatron.core.datasets import MockGPTDataset, build_pretraining_data_loader
from megatron.core.datasets.one_buffer_batch import OneBufferBatch, collate_in_one_buffer
from tests.unit_tests.training.checkpoint_checks import assert_same


def _samples() -> list[dict[str, torch.Tensor]]:
    """Dtypes of every size, a 0-d value per sample and an empty tensor."""
    return [
        {
            "tokens": torch.arange(7) + index,
            "loss_mask": torch.rand(7),
            "flags": torch.tensor([True, False, True]),
            "weight": torch.tensor(0.5 * index, dtype=torch.float64),
            "half": torch.randn(3, dtype=torch.bfloat16),
            "empty": torch.zeros(0, 2),
        }
        for index in range(3)
    ]


def _assert_same(batch, expected) -> None:
    assert list(batch) == list(expected)  # the keys in order too
    assert_same(batch, expected)


def test_a_batch_is_default_collates_over_one_buffer():
    samples = _samples()
    batch = collate_in_one_buffer(samples)
    assert isinstance(batch, OneBufferBatch)
    _assert_same(batch, default_collate(samples))
    assert len({value.untyped_storage().data_ptr() for value in batch.values()}) == 1


def test_it_crosses_between_processes_as_one_shared_tensor(monkeypatch):
    """Pickled as workers pickle batches: one storage is shared, and the batch comes back."""
    shared = []

    def reduce_storage(storage):
        shared.append(storage)
        return original(storage)

    original = reductions.reduce_storage
    monkeypatch.setattr(reductions, "reduce_storage", reduce_storage)
    monkeypatch.setitem(ForkingPickler._extra_reducers, torch.UntypedStorage, reduce_storage)
    samples = _samples()
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(collate_in_one_buffer(samples))
    assert len(shared) == 1
    received = pickle.loads(buffer.getvalue())
    assert isinstance(received, OneBufferBatch)
    _assert_same(received, default_collate(samples))


def test_other_batches_are_default_collates():
    samples = [(torch.ones(2), 3), (torch.zeros(2), 4)]
    batch = collate_in_one_buffer(samples)
    assert type(batch) is list
    assert_same(batch, default_collate(samples))
    mixed = [{"tokens": torch.arange(3), "name": "a"}] * 2
    batch = collate_in_one_buffer(mixed)
    assert type(batch) is dict
    assert_same(batch, default_collate(mixed))


def test_loader_workers_give_the_batches_of_the_loader_without_workers():
    dataset = MockGPTDataset(24, 16, 64, 0)
    workers = build_pretraining_data_loader(dataset, 0, 4, 0, 1, num_workers=2)
    alone = build_pretraining_data_loader(dataset, 0, 4, 0, 1)
    assert workers.collate_fn is collate_in_one_buffer
    for batch, expected in zip(workers, alone, strict=True):
        _assert_same(batch, expected)


@pytest.mark.gpu
def test_pinning_copies_the_buffer_once():
    batch = collate_in_one_buffer(_samples())
    pinned = batch.pin_memory()
    assert all(value.is_pinned() for value in pinned.values())
    assert len({value.untyped_storage().data_ptr() for value in pinned.values()}) == 1
    _assert_same(pinned, batch)
