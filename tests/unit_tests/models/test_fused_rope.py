"""The fused rotary kernel (`megatron.core.fusions.fused_rope`) against the rotation computed in
float64, forward and backward, and inside the model against the PyTorch ops."""

import pytest
import torch

from megatron.core.fusions.fused_rope import fused_rope_supported
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    RotaryEmbedding,
    rotate_query_and_key,
)
from tests.unit_tests.model_builders import (
    assert_same_training_signal,
    build_tiny_gpt,
    make_token_batches,
    tiny_gpt_config,
)

# (seq, batch, query heads, key heads, head width, rotary percent): the 1.34B model's heads;
# more query heads than one program takes (grouped keys); odd head counts; partial rotation
# (pass-through channels).
SHAPES = [
    (64, 2, 16, 16, 128, 1.0),
    (16, 3, 72, 8, 64, 1.0),
    (9, 1, 5, 1, 32, 0.5),
    (8, 2, 3, 3, 96, 0.5),
]


def _rotate_and_backward(query, key, freqs, grads, interleaved, fused):
    query, key = (t.detach().requires_grad_() for t in (query, key))
    outs = rotate_query_and_key(query, key, freqs, rotary_interleaved=interleaved, fused=fused)
    torch.autograd.backward(outs, grads)
    return (*outs, query.grad, key.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotation_matches_float64(shape, interleaved, dtype):
    seq, batch, q_heads, k_heads, dim, percent = shape
    torch.manual_seed(0)
    freqs = RotaryEmbedding(dim, rotary_percent=percent, rotary_interleaved=interleaved)(seq)
    freqs = freqs.cuda()
    # Strided views, as the queries and keys are of the QKV projection's output.
    query = torch.randn(seq, batch, q_heads, 2 * dim, device="cuda", dtype=dtype)[..., dim:]
    key = torch.randn(seq, batch, 3 * dim, k_heads, device="cuda", dtype=dtype)[:, :, :dim]
    key = key.transpose(2, 3)
    grads = [torch.randn_like(t, memory_format=torch.contiguous_format) for t in (query, key)]
    assert fused_rope_supported(query, key, freqs)

    fused = _rotate_and_backward(query, key, freqs, grads, interleaved, fused=True)
    eager = _rotate_and_backward(query, key, freqs, grads, interleaved, fused=False)
    ref = _rotate_and_backward(
        query.double(),
        key.double(),
        freqs.double(),
        [g.double() for g in grads],
        interleaved,
        False,
    )

    assert all(t.dtype == dtype and t.is_contiguous() for t in fused)
    for name, got, unfused, expected in zip(("q", "k", "dq", "dk"), fused, eager, ref):
        torch.testing.assert_close(got, expected.to(dtype), msg=name)
        if dtype == torch.bfloat16:
            # fp32 tables and arithmetic, rounded once: more accurate than the unfused ops on
            # bf16 (bf16 tables, three roundings). In fp32 both err at rounding level.
            error = (got.double() - expected).abs().max()
            assert error <= (unfused.double() - expected).abs().max()
    if percent < 1:
        rot = freqs.shape[-1]
        for got, original in zip(fused, (query, key, *grads)):
            assert torch.equal(got[..., rot:], original[..., rot:])


@pytest.mark.gpu
def test_learned_angles_take_the_differentiable_ops():
    freqs = RotaryEmbedding(32)(8).cuda().requires_grad_()
    query, key = torch.randn(2, 8, 2, 4, 32, device="cuda")
    assert not fused_rope_supported(query, key, freqs)
    sum(t.sum() for t in rotate_query_and_key(query, key, freqs, fused=True)).backward()
    assert freqs.grad is not None and freqs.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_model_with_rope_fusion_matches_unfused(interleaved):
    configs = [
        tiny_gpt_config(apply_rope_fusion=fusion, rotary_interleaved=interleaved)
        for fusion in (False, True)
    ]
    assert_same_training_signal(configs, "cuda", position_embedding_type="rope")


@pytest.mark.gpu
def test_model_with_rope_fusion_runs_the_kernel():
    model = build_tiny_gpt(tiny_gpt_config(apply_rope_fusion=True), position_embedding_type="rope")
    tokens, labels = (t.cuda() for t in make_token_batches(1, 2)[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        model.cuda()(tokens, labels=labels).sum().backward()
        torch.cuda.synchronize()
    launches = [event.name for event in profiler.events() if "_rotate_kernel" in event.name]
    # One per layer forward and one backward (2 layers).
    assert len(launches) == 4, launches


def test_fused_falls_back_to_the_pytorch_ops_off_cuda():
    freqs = RotaryEmbedding(16)(8)
    query, key = torch.randn(2, 8, 2, 3, 16)
    assert not fused_rope_supported(query, key, freqs)
    for fused, unfused in zip(
        rotate_query_and_key(query, key, freqs, fused=True), rotate_query_and_key(query, key, freqs)
    ):
        assert torch.equal(fused, unfused)
