"""Context-parallel attention on CUDA (marked gpu).

One GPU: the CUDA block kernels (`FLASH` in bf16, `EFFICIENT` in fp32 and bf16) give the output
and gradients of SDPA over each kind of block the ring computes (the causal diagonal block, all
queries over half the keys, half the queries over all the keys), with grouped-query attention and
values narrower than the queries; two blocks merged by their log-sum-exp give attention over
both. Two GPUs (NCCL, skipped with fewer): ring, all-gather and all-to-all attention against
causal attention over the whole sequence, forward and backward, in fp32 and bf16.
"""

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
    select_block_kernel,
    split_sequence,
)
from megatron.core.context_parallel.partial_attention import merge_partial
from tests.unit_tests.distributed_harness import current_device, run_distributed

pytestmark = pytest.mark.gpu

FP32_TOLERANCE = dict(atol=2e-5, rtol=2e-5)


def assert_as_accurate_as_sdpa(got, want, base, dtype, name):
    """`got` against fp32 SDPA's `want`: within fp32 tolerances in fp32; in bf16 at most twice
    as far from it as SDPA computing in bf16 (`base`) is, FlashAttention's own test criterion,
    plus bf16's rounding of the result."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOLERANCE, msg=name)
        return
    error = (got.float() - want).abs().max()
    bound = 2 * (base.float() - want).abs().max() + want.abs().max() * 2**-8
    assert error <= bound, f"{name}: error {error} > {bound}"


def _sdpa_with_grads(query, key, value, causal, grad_out, dtype):
    """SDPA's output and input gradients computed in `dtype` ([b, n, s, d]; key/value heads
    repeated for their query heads)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (query, key, value)]
    repeats = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(repeats, dim=1) for t in leaves[1:])
    out = F.scaled_dot_product_attention(leaves[0], k, v, is_causal=causal)
    out.backward(grad_out.to(dtype))
    return [out.detach(), *(t.grad for t in leaves)]


BLOCKS = {
    # (query rows, key columns, causal) of a rank's 2 x 64 positions.
    "diagonal": (slice(None), slice(None), True),
    "first_keys": (slice(None), slice(None, 64), False),
    "last_queries": (slice(64, None), slice(None), False),
}


@pytest.mark.parametrize(
    "kernel, dtype",
    [("FLASH", torch.bfloat16), ("EFFICIENT", torch.float32), ("EFFICIENT", torch.bfloat16)],
)
@pytest.mark.parametrize("value_dim", [64, 48])
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_block_kernels_match_sdpa(kernel, dtype, value_dim, block):
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=generator).to(dtype)

    query, key, value = randn(2, 8, 128, 64), randn(2, 2, 128, 64), randn(2, 2, 128, value_dim)
    rows, cols, causal = BLOCKS[block]
    query, key, value = query[:, :, rows], key[:, :, cols], value[:, :, cols]
    grad_out = randn(*query.shape[:3], value_dim)
    attention = BlockAttention(BlockKernel[kernel], None)
    out, lse, saved = attention.forward(query, key, value, causal)
    grads = attention.backward(grad_out, query, key, value, out, lse, causal, saved)
    want = _sdpa_with_grads(query, key, value, causal, grad_out, torch.float32)
    base = _sdpa_with_grads(query, key, value, causal, grad_out, dtype)
    for name, got, wanted, based in zip(("out", "q", "k", "v"), (out, *grads), want, base):
        assert got.shape == wanted.shape, name
        assert_as_accurate_as_sdpa(got, wanted, based, dtype, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merged_blocks_are_attention_over_both(dtype):
    generator = torch.Generator(device="cuda").manual_seed(1)
    query, key, value = (
        torch.randn(1, 4, 64, 64, device="cuda", generator=generator).to(dtype) for _ in range(3)
    )
    kernel = select_block_kernel(query.device, dtype, 64)
    attention = BlockAttention(kernel, None)
    out, lse, _ = attention.forward(query, key[:, :, :32], value[:, :, :32], False)
    out, lse = out.float(), lse.clone()
    merge_partial(out, lse, *attention.forward(query, key[:, :, 32:], value[:, :, 32:], False)[:2])
    want = F.scaled_dot_product_attention(query.float(), key.float(), value.float())
    base = F.scaled_dot_product_attention(query, key, value)
    assert_as_accurate_as_sdpa(out, want, base, dtype, "merged")


SEQ = 256


def _causal_attention(query, key, value):
    """Causal SDPA over [s, b, n, d], key/value heads repeated for their query heads."""
    repeats = query.shape[2] // key.shape[2]
    key, value = (t.repeat_interleave(repeats, dim=2) for t in (key, value))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)


def _output_and_grads(inputs, weights, attention):
    """`attention`'s output and the gradients of its weighted sum with respect to `inputs`."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = attention(*leaves)
    (out * weights).sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


def _context_parallel(algorithm, group):
    if algorithm == "a2a":

        def attention(query, key, value):
            def attend(q, k, v, heads):
                return _causal_attention(q, k, v).flatten(-2)

            out = all_to_all_attention(query, key, value, attend, group)
            return out.unflatten(-1, (query.shape[2], -1))

        return attention

    def attention(query, key, value):
        block = BlockAttention(select_block_kernel(query.device, query.dtype, 64), None)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if algorithm == "p2p":
            out = ring_attention(q, k, v, block, Ring(group))
        else:
            out = all_gather_attention(q, k, v, block, group)
        return out.permute(2, 0, 1, 3)

    return attention


def _two_gpu_run(algorithm: str, dtype: torch.dtype) -> None:
    """This rank's output and gradients against SDPA over the whole sequence
    (`assert_as_accurate_as_sdpa`)."""
    group = dist.group.WORLD
    rank, size = group.rank(), group.size()
    generator = torch.Generator().manual_seed(2)
    shapes = [(SEQ, 2, 8, 64), (SEQ, 2, 2, 64), (SEQ, 2, 2, 64), (SEQ, 2, 8, 64)]
    *inputs, weights = (
        torch.randn(shape, generator=generator).to(current_device(), dtype) for shape in shapes
    )

    def mine(t):
        return split_sequence(t, 0, rank, size)

    reference = _output_and_grads([t.float() for t in inputs], weights.float(), _causal_attention)
    baseline = _output_and_grads(inputs, weights, _causal_attention)
    local = [mine(t) for t in inputs]
    actual = _output_and_grads(local, mine(weights), _context_parallel(algorithm, group))
    for name, got, want, base in zip(("out", "q", "k", "v"), actual, reference, baseline):
        assert_as_accurate_as_sdpa(got, mine(want), mine(base), dtype, f"{algorithm} {name}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("algorithm", ["p2p", "allgather", "a2a"])
def test_context_parallel_attention_on_two_gpus(algorithm, dtype):
    run_distributed(_two_gpu_run, 2, algorithm, dtype)
