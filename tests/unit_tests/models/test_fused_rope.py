"""The fused rotary kernels (`megatron.core.fusions.fused_rope`: the C++ node's CUDA kernel,
`native_rope`, and the Triton kernel) against the rotation computed in float64, forward and
backward, and inside the model against the PyTorch ops."""

import contextlib

import pytest
import torch

from megatron.core.fusions.fused_rope import fused_rope_supported, rope_shapes_fusable
from megatron.core.fusions.native_rope import native_rope, triton_kernel
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

DEVICE = "cuda"
KERNELS = ["cpp", "triton"]


def _kernel(name: str) -> contextlib.AbstractContextManager:
    """Rotations inside run the C++ node (which must have built) or the Triton kernel."""
    if name == "triton":
        return triton_kernel()
    assert native_rope(torch.empty(1, device=DEVICE)) is not None, "the C++ extension did not build"
    return contextlib.nullcontext()


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
    used = [(out, grad) for out, grad in zip(outs, grads) if grad is not None]
    torch.autograd.backward(*zip(*used))
    return (*outs, query.grad, key.grad)


def _compare_with_float64(query, key, freqs, grads, interleaved):
    """Fused against the PyTorch ops in float64 (and, in half precision, more accurate than the
    PyTorch ops in that precision); returns the fused outputs and gradients."""
    fused = _rotate_and_backward(query, key, freqs, grads, interleaved, fused=True)
    eager = _rotate_and_backward(query, key, freqs, grads, interleaved, fused=False)
    grads64 = [None if g is None else g.double() for g in grads]
    ref = _rotate_and_backward(
        query.double(), key.double(), freqs.double(), grads64, interleaved, fused=False
    )
    for name, got, unfused, expected in zip(("q", "k", "dq", "dk"), fused, eager, ref):
        if expected is None:  # an output the loss does not use: no gradient, or zeros
            assert got is None or not got.any(), name
            continue
        torch.testing.assert_close(got, expected.to(got.dtype), msg=name)
        if got.dtype != torch.float32:
            # fp32 tables and arithmetic, rounded once: more accurate on average than the
            # unfused ops (tables in the tensors' dtype, three roundings). The largest errors
            # are half a unit in the last place for both; in fp32 both err at rounding level.
            errors = [(t.double() - expected).square().mean() for t in (got, unfused)]
            assert errors[0] < errors[1], (name, errors)
    return fused


def _freqs(seq, dim, percent=1.0, interleaved=False):
    rope = RotaryEmbedding(dim, rotary_percent=percent, rotary_interleaved=interleaved)
    return rope(seq).to(DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rotation_matches_float64(shape, interleaved, dtype, kernel):
    seq, batch, q_heads, k_heads, dim, percent = shape
    torch.manual_seed(0)
    freqs = _freqs(seq, dim, percent, interleaved)
    # Strided views, as the queries and keys are of the QKV projection's output: channels of
    # the queries' heads far apart, every other head of the keys.
    query = torch.randn(seq, batch, q_heads, 2 * dim, device=DEVICE, dtype=dtype)[..., dim:]
    key = torch.randn(seq, batch, 2 * k_heads, dim, device=DEVICE, dtype=dtype)[:, :, ::2]
    # Gradients as backward may deliver them: not contiguous.
    grads = [torch.randn(dim, *t.shape[:-1], device=DEVICE, dtype=dtype) for t in (query, key)]
    grads = [g.movedim(0, -1) for g in grads]
    assert fused_rope_supported(query, key, freqs)

    with _kernel(kernel):
        fused = _compare_with_float64(query, key, freqs, grads, interleaved)
    assert all(t.dtype == dtype and t.is_contiguous() for t in fused)
    if percent < 1:
        rot = freqs.shape[-1]
        for got, original in zip(fused, (query, key, *grads)):
            assert torch.equal(got[..., rot:], original[..., rot:])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "offset, dim, rot",
    [(0, 64, 64), (4, 64, 64), (2, 64, 64), (1, 64, 64), (0, 40, 20), (1, 33, 12)],
)
def test_every_load_width(offset, dim, rot, dtype, interleaved, kernel):
    """Views whose addresses and strides are multiples of 16, 8, 4 and 2 bytes (the C++
    kernel's loads are as wide as they allow: 8, 4, 2, 1 bf16 channels), rotated widths whose
    halves are not multiples of the widest load, and an odd head width."""
    seq, batch, q_heads, k_heads = 6, 2, 3, 2
    torch.manual_seed(2)
    freqs = _freqs(seq, dim, rot / dim, interleaved)
    assert freqs.shape[-1] == rot

    def view(heads):
        return torch.randn(seq, batch, heads, dim + offset, device=DEVICE, dtype=dtype)[
            ..., offset:
        ]

    query, key = view(q_heads), view(k_heads)
    grads = [view(q_heads), view(k_heads)]
    with _kernel(kernel):
        _compare_with_float64(query, key, freqs, grads, interleaved)


@pytest.mark.gpu
def test_no_heads_rotate_to_empty_tensors():
    """Queries and keys with no heads (the C++ node launches nothing)."""
    freqs = _freqs(8, 32)
    query, key = (torch.randn(8, 2, 0, 32, device=DEVICE, requires_grad=True) for _ in range(2))
    with _kernel("cpp"):
        rotated = rotate_query_and_key(query, key, freqs, fused=True)
        sum(t.sum() for t in rotated).backward()
    assert [t.shape for t in rotated] == [query.shape, key.shape]
    assert query.grad.shape == query.shape and key.grad.shape == key.shape


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_channels_not_adjacent_and_one_output_unused(kernel):
    """Keys whose channels are not adjacent (copied for the kernel), and a loss that uses the
    rotated queries only (the keys' incoming gradient is zeros)."""
    seq, batch, heads, dim = 8, 2, 4, 32
    torch.manual_seed(1)
    freqs = _freqs(seq, dim)
    query = torch.randn(seq, batch, heads, dim, device=DEVICE)
    key = torch.randn(seq, batch, dim, heads, device=DEVICE).transpose(2, 3)
    assert key.stride(-1) != 1 and fused_rope_supported(query, key, freqs)
    grad = torch.randn(seq, batch, heads, dim, device=DEVICE)
    with _kernel(kernel):
        _, _, _, key_grad = _compare_with_float64(query, key, freqs, [grad, None], False)
    assert torch.equal(key_grad, torch.zeros_like(key_grad))


@pytest.mark.gpu
def test_learned_angles_take_the_differentiable_ops():
    freqs = RotaryEmbedding(32)(8).to(DEVICE).requires_grad_()
    query, key = torch.randn(2, 8, 2, 4, 32, device=DEVICE)
    assert not fused_rope_supported(query, key, freqs)
    sum(t.sum() for t in rotate_query_and_key(query, key, freqs, fused=True)).backward()
    assert freqs.grad is not None and freqs.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "overrides, rotary_percent",
    [
        (dict(), 1.0),
        (dict(rotary_interleaved=True), 1.0),
        # Grouped keys, normalised queries and keys, half the channels rotated.
        (dict(num_query_groups=2, qk_layernorm=True), 0.5),
    ],
)
def test_model_with_rope_fusion_matches_unfused(overrides, rotary_percent):
    configs = [tiny_gpt_config(apply_rope_fusion=fusion, **overrides) for fusion in (False, True)]
    assert_same_training_signal(
        configs, DEVICE, position_embedding_type="rope", rotary_percent=rotary_percent
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_model_with_rope_fusion_runs_the_kernel(kernel):
    model = build_tiny_gpt(tiny_gpt_config(apply_rope_fusion=True), position_embedding_type="rope")
    tokens, labels = (t.to(DEVICE) for t in make_token_batches(1, 2)[0])
    with _kernel(kernel):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            model.to(DEVICE)(tokens, labels=labels).sum().backward()
            torch.cuda.synchronize()
    names = {"cpp": "megatron_rope::", "triton": "_rotate_kernel"}
    launches = [event.name for event in profiler.events() if names[kernel] in event.name]
    # One per layer forward and one backward (2 layers).
    assert len(launches) == 4, launches


@pytest.mark.gpu
def test_a_twice_differentiated_rotation_raises():
    """The C++ node is differentiable once, as the Triton path: the gradients of a
    `create_graph=True` backward raise if differentiated again."""
    freqs = _freqs(8, 32)
    query, key = (t.requires_grad_() for t in torch.randn(2, 8, 2, 4, 32, device=DEVICE))
    with _kernel("cpp"):
        rotated = rotate_query_and_key(query, key, freqs, fused=True)
    sum(t.square().sum() for t in rotated).backward(create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        query.grad.sum().backward()


def test_shapes_the_kernel_does_not_cover():
    query, key = torch.randn(2, 8, 2, 4, 32)
    freqs = RotaryEmbedding(32)(8)
    assert rope_shapes_fusable(query, key, freqs)
    assert rope_shapes_fusable(query, key[:, :, :1], RotaryEmbedding(32, rotary_percent=0.5)(8))
    refused = {
        "keys of another length": (query, key[:4], freqs),
        "angles per batch entry": (query, key, freqs.expand(8, 2, 1, 32)),
        "more angles than channels": (query[..., :16], key[..., :16], freqs),
        "an odd number of angles": (query, key, freqs[..., :31]),
        "float64": (query.double(), key.double(), freqs),
        "mixed dtypes": (query.half(), key, freqs),
    }
    for case, (q, k, f) in refused.items():
        assert not rope_shapes_fusable(q, k, f), case


def test_off_cuda_the_pytorch_ops_run():
    freqs = RotaryEmbedding(16)(8)
    query, key = torch.randn(2, 8, 2, 3, 16)
    assert not fused_rope_supported(query, key, freqs)
    for fused, unfused in zip(
        rotate_query_and_key(query, key, freqs, fused=True), rotate_query_and_key(query, key, freqs)
    ):
        assert torch.equal(fused, unfused)
