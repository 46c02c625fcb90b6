"""Context-parallel attention against plain causal attention over the whole sequence: ring
(`p2p`), all-gather and all-to-all (`a2a`) attention on 2 and 4 gloo ranks, forward and the
gradients of queries, keys and values (fp32), with grouped-query attention and values narrower
than the queries (multi-latent attention's), on the CPU flash kernel and on explicit scores.
Head counts that do not split over the ranks are refused naming the flags. The load-balanced
split itself is checked without ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.context_parallel import (
    BlockAttention,
    BlockKernel,
    Ring,
    all_gather_attention,
    all_to_all_attention,
    ring_attention,
    split_sequence,
)
from megatron.core.context_parallel.sequence_split import (
    chunk_ids,
    gather_sequence,
    get_batch_on_this_cp_rank,
    local_position_ids,
    rank_chunk_order,
    to_rank_chunk_order,
    to_sequence_order,
)
from tests.unit_tests.distributed_harness import run_distributed

SEQ, BATCH, HEAD_DIM = 16, 2, 8


def full_causal_attention(query, key, value, scale=None):
    """The reference: causal softmax attention over [s, b, n, d], key/value heads repeated for
    their query heads (Megatron's grouping)."""
    repeats = query.shape[2] // key.shape[2]
    key, value = (t.repeat_interleave(repeats, dim=2) for t in (key, value))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.permute(2, 0, 1, 3)


def _inputs(heads, groups, value_dim):
    generator = torch.Generator().manual_seed(7)
    shapes = [(SEQ, BATCH, heads, HEAD_DIM), (SEQ, BATCH, groups, HEAD_DIM)]
    shapes.append((SEQ, BATCH, groups, value_dim))
    tensors = [torch.randn(shape, generator=generator) for shape in shapes]
    weights = torch.randn(SEQ, BATCH, heads, value_dim, generator=generator)
    return tensors, weights


def _ring(query, key, value, kernel, group):
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = ring_attention(q, k, v, BlockAttention(kernel, None), Ring(group))
    return out.permute(2, 0, 1, 3)


def _all_gather(query, key, value, kernel, group):
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = all_gather_attention(q, k, v, BlockAttention(kernel, None), group)
    return out.permute(2, 0, 1, 3)


def _all_to_all(query, key, value, kernel, group):
    def attend(q, k, v, heads):
        assert heads.stop - heads.start == q.shape[2]
        return full_causal_attention(q, k, v).flatten(-2)

    out = all_to_all_attention(query, key, value, attend, group)
    return out.unflatten(-1, (query.shape[2], -1))


ALGORITHMS = {"p2p": _ring, "allgather": _all_gather, "a2a": _all_to_all}


def _compare(algorithm, heads, groups, value_dim, kernel):
    group = dist.group.WORLD
    rank, size = group.rank(), group.size()
    (query, key, value), weights = _inputs(heads, groups, value_dim)
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    expected = full_causal_attention(*leaves)
    (expected * weights).sum().backward()

    def mine(t):
        return split_sequence(t, 0, rank, size)

    local = [mine(t).clone().requires_grad_() for t in (query, key, value)]
    out = ALGORITHMS[algorithm](*local, BlockKernel[kernel], group)
    (out * mine(weights)).sum().backward()
    torch.testing.assert_close(out, mine(expected.detach()), atol=1e-5, rtol=1e-5)
    for name, actual, whole in zip("qkv", local, leaves):
        torch.testing.assert_close(
            actual.grad, mine(whole.grad), atol=1e-5, rtol=1e-5, msg=f"grad {name}"
        )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "algorithm, heads, groups, value_dim, kernel",
    [
        ("p2p", 4, 4, HEAD_DIM, "CPU_FLASH"),
        ("p2p", 4, 2, HEAD_DIM, "CPU_FLASH"),
        ("p2p", 4, 1, 4, "CPU_FLASH"),
        ("p2p", 4, 2, HEAD_DIM, "MATH"),
        ("allgather", 4, 2, HEAD_DIM, "CPU_FLASH"),
        ("allgather", 4, 4, 4, "MATH"),
        ("a2a", 4, 4, HEAD_DIM, "CPU_FLASH"),
        ("a2a", 4, 2, 4, "CPU_FLASH"),
        ("a2a", 8, 1, HEAD_DIM, "CPU_FLASH"),
    ],
    ids=[
        "p2p-mha",
        "p2p-gqa",
        "p2p-mqa-narrow-values",
        "p2p-gqa-explicit-scores",
        "allgather-gqa",
        "allgather-narrow-values-explicit-scores",
        "a2a-mha",
        "a2a-gqa-narrow-values",
        "a2a-mqa",
    ],
)
def test_context_parallel_attention_matches_full_causal_attention(
    world, algorithm, heads, groups, value_dim, kernel
):
    run_distributed(_compare, world, algorithm, heads, groups, value_dim, kernel)


def _uneven_heads_error() -> str:
    query = torch.zeros(SEQ // 4, 1, 6, HEAD_DIM)
    try:
        all_to_all_attention(query, query, query, None, dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return ""


def test_all_to_all_refuses_heads_that_do_not_split():
    message = run_distributed(_uneven_heads_error, 4)[0]
    assert "6 (per tensor-parallel rank) is not divisible by 4" in message
    assert "--cp-comm-type p2p" in message


def test_load_balanced_split_holds_chunks_i_and_mirror():
    assert chunk_ids(0, 2) == (0, 3) and chunk_ids(1, 2) == (1, 2)
    assert rank_chunk_order(4) == [0, 7, 1, 6, 2, 5, 3, 4]
    sequence = torch.arange(16).view(1, 16)
    parts = [split_sequence(sequence, 1, rank, 4) for rank in range(4)]
    assert parts[1].tolist() == [[2, 3, 12, 13]]
    ordered = torch.cat(parts, dim=1).view(-1)
    assert to_sequence_order(ordered, 4).tolist() == list(range(16))
    assert torch.equal(to_rank_chunk_order(to_sequence_order(ordered, 4), 4), ordered)
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size 4"):
        split_sequence(torch.zeros(1, 12), 1, 0, 4)


def _batch_split() -> dict:
    group = dist.group.WORLD
    tokens = torch.arange(24).view(2, 12)
    batch = get_batch_on_this_cp_rank(
        {"tokens": tokens, "labels": tokens + 100, "loss_mask": None}, group
    )
    whole = gather_sequence(batch["tokens"], 1, group)
    positions = local_position_ids(batch["tokens"].shape[1], group)
    try:
        get_batch_on_this_cp_rank({"tokens": tokens, "attention_mask": tokens}, group)
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    return dict(batch, whole=whole, positions=positions, refusal=refusal)


def test_batch_split_and_gather_on_two_ranks():
    results = run_distributed(_batch_split, 2)
    for rank, result in enumerate(results):
        chunks = chunk_ids(rank, 2)
        columns = [c * 3 + i for c in chunks for i in range(3)]
        assert result["tokens"].tolist() == torch.arange(24).view(2, 12)[:, columns].tolist()
        assert torch.equal(result["labels"], result["tokens"] + 100)
        assert result["loss_mask"] is None
        assert torch.equal(result["whole"], torch.arange(24).view(2, 12))
        assert result["positions"].tolist() == [columns]
        assert "--reset-attention-mask" in result["refusal"]
