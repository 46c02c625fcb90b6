"""Vocab-parallel cross-entropy against `F.cross_entropy` on the whole logits (fp32 math):
per-token loss and gradient at TP 2 and 4 on gloo ranks, with `-100` labels and label
smoothing, from fp32 and bf16 logits; and its refusal of mismatched shapes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.unit_tests.distributed_harness import run_distributed

SEQ, BATCH, VOCAB = 6, 3, 32


def _check_cross_entropy(dtype: torch.dtype, label_smoothing: float) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(SEQ, BATCH, VOCAB, generator=generator)).to(dtype)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
    target[1, 0] = target[4, 2] = -100
    grad_loss = torch.randn(SEQ, BATCH, generator=generator)

    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(
        full.float().view(-1, VOCAB),
        target.view(-1),
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(SEQ, BATCH)
    (expected * grad_loss).sum().backward()

    local = logits.chunk(world, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing, tp_group=dist.group.WORLD)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)
    assert torch.all(loss[target == -100] == 0)
    (loss * grad_loss).sum().backward()
    assert local.grad.dtype == dtype
    torch.testing.assert_close(local.grad, full.grad.chunk(world, -1)[rank])
    assert torch.all(local.grad[target == -100] == 0)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_matches_the_whole_vocabulary(world, dtype, label_smoothing):
    run_distributed(_check_cross_entropy, world, dtype, label_smoothing)


def test_without_a_group_it_is_cross_entropy_and_refuses_bad_input():
    logits = torch.randn(5, VOCAB, requires_grad=True)
    target = torch.tensor([1, -100, 31, 0, 7])
    expected = F.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, target), expected)
    with pytest.raises(ValueError, match="same leading shape"):
        vocab_parallel_cross_entropy(logits, target[:4])
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
