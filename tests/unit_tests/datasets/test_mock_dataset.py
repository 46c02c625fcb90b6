"""`MockGPTDataset` is deterministic, well-formed and learnable; the pretraining sampler gives
data-parallel ranks disjoint slices of each global batch and resumes from `consumed_samples`."""

from __future__ import annotations

import pytest
import torch

from megatron.core.datasets import (
    MegatronPretrainingSampler,
    MockGPTDataset,
    build_pretraining_data_loader,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from tests.unit_tests.model_builders import build_tiny_gpt

SEQ_LENGTH, VOCAB_SIZE = 16, 64


def test_samples_depend_only_on_seed_and_index():
    first, second = MockGPTDataset(50, SEQ_LENGTH, VOCAB_SIZE, 7), MockGPTDataset(9, 16, 64, 7)
    for idx in (0, 3, 8):
        for key, value in first[idx].items():
            assert torch.equal(value, second[idx][key])
    other_seed = MockGPTDataset(50, SEQ_LENGTH, VOCAB_SIZE, 8)
    assert not all(torch.equal(first[i]["tokens"], other_seed[i]["tokens"]) for i in range(5))
    assert len({tuple(first[i]["tokens"].tolist()) for i in range(50)}) > 40


def test_sample_format():
    sample = MockGPTDataset(10, SEQ_LENGTH, VOCAB_SIZE, 0)[4]
    assert sample.keys() == {"tokens", "labels", "loss_mask", "position_ids"}
    for key, dtype in [
        ("tokens", torch.int64),
        ("labels", torch.int64),
        ("loss_mask", torch.float32),
        ("position_ids", torch.int64),
    ]:
        assert sample[key].shape == (SEQ_LENGTH,) and sample[key].dtype == dtype, key
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert 0 <= sample["tokens"].min() and sample["labels"].max() < VOCAB_SIZE
    assert torch.equal(sample["loss_mask"], torch.ones(SEQ_LENGTH))
    assert torch.equal(sample["position_ids"], torch.arange(SEQ_LENGTH))
    stride = (sample["labels"] - sample["tokens"]) % VOCAB_SIZE
    assert (stride == stride[0]).all() and 1 <= stride[0] <= 3


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="seq_length=0"):
        MockGPTDataset(10, 0, VOCAB_SIZE)
    with pytest.raises(IndexError):
        MockGPTDataset(10, SEQ_LENGTH, VOCAB_SIZE)[10]
    with pytest.raises(ValueError, match="data_parallel_rank=2"):
        MegatronPretrainingSampler(100, 0, 4, 2, 2)
    with pytest.raises(ValueError, match="consumed_samples=100"):
        MegatronPretrainingSampler(100, 100, 4, 0, 2)


def _indices(consumed: int, dp_size: int, total: int = 50, micro_batch_size: int = 3):
    return [
        list(MegatronPretrainingSampler(total, consumed, micro_batch_size, rank, dp_size))
        for rank in range(dp_size)
    ]


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_sampler_gives_ranks_disjoint_slices_of_each_global_batch(dp_size):
    per_rank = _indices(0, dp_size)
    group = 3 * dp_size
    assert all(len(batches) == 50 // group for batches in per_rank)
    for step, batches in enumerate(zip(*per_rank)):
        # One micro-batch step: the ranks together read the next `group` samples, in order.
        assert [i for batch in batches for i in batch] == list(
            range(step * group, (step + 1) * group)
        )


@pytest.mark.parametrize("consumed", [12, 13])
def test_sampler_resumes_from_consumed_samples(consumed):
    resumed = _indices(consumed, 2)
    assert resumed[0][0] == list(range(consumed, consumed + 3))
    assert resumed[1][0] == list(range(consumed + 3, consumed + 6))
    if consumed % 6 == 0:  # resuming at a step boundary continues the uninterrupted run
        skipped = consumed // 6
        assert resumed == [batches[skipped:] for batches in _indices(0, 2)]


def test_loader_stacks_micro_batches():
    dataset = MockGPTDataset(40, SEQ_LENGTH, VOCAB_SIZE, 0)
    loader = build_pretraining_data_loader(dataset, 8, 4, 1, 2)
    batch = next(iter(loader))
    assert batch["tokens"].shape == (4, SEQ_LENGTH)
    assert torch.equal(batch["tokens"][0], dataset[12]["tokens"])  # 8 consumed + rank 1 * 4
    assert len(loader) == (40 - 8) // 8
    assert build_pretraining_data_loader(None, 0, 4, 0, 1) is None


def test_loader_pins_memory_only_when_asked(monkeypatch):
    """The training loop asks when the model trains on CUDA, not whenever CUDA exists."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dataset = MockGPTDataset(8, SEQ_LENGTH, VOCAB_SIZE, 0)
    assert not build_pretraining_data_loader(dataset, 0, 4, 0, 1).pin_memory
    assert build_pretraining_data_loader(dataset, 0, 4, 0, 1, pin_memory=True).pin_memory


def test_tiny_gpt_learns_mock_data():
    """The whole library path in one process: loader, model, optimizer, scheduler."""
    iterations, micro_batch_size = 50, 8
    dataset = MockGPTDataset(iterations * micro_batch_size, SEQ_LENGTH, VOCAB_SIZE, 0)
    model = build_tiny_gpt(vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01), model)
    scheduler = OptimizerParamScheduler(
        optimizer, 1e-3, 1e-2, 1e-3, 5, iterations, "cosine", 0.01, 0.01, iterations, "constant"
    )
    losses = []
    for batch in build_pretraining_data_loader(dataset, 0, micro_batch_size, 0, 1):
        optimizer.zero_grad()
        per_token = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful and grad_norm > 0
        scheduler.step(1)
        losses.append(loss.item())
    assert len(losses) == iterations
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, f"loss {first:.3f} -> {last:.3f}"
