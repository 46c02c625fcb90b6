"""`MultiTensorCast`: many tensors cast to E4M3 in one launch give the reference quantiser's
bytes, tensor by tensor (GPU); where the kernel cannot take the tensors, `make` says so and the
caller casts them one by one (every device)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.multi_tensor_cast import MultiTensorCast
from megatron.core.fp8.quantize import _quantize_reference

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SIZES = (1, 15, 1024, 4096 + 5, 3 * 4096, 70_000)
"""Elements of each piece: under, at and over the kernel's blocks and programs."""


def _pieces(dtype: torch.dtype, device: str):
    """Sources with special values, and E4M3 targets viewing one buffer at 16-byte aligned
    offsets (as an engine's FP8 shard holds its tensors)."""
    generator = torch.Generator().manual_seed(0)
    sources = []
    for i, numel in enumerate(SIZES):
        values = torch.randn(numel, generator=generator) * 10.0 ** (i - 2)
        values[: min(numel, 4)] = torch.tensor([float("nan"), float("inf"), -1e6, 0.0])[
            : min(numel, 4)
        ]
        sources.append(values.to(dtype).to(device))
    offsets = [0]
    for numel in SIZES:
        offsets.append(offsets[-1] + -(-numel // 16) * 16)
    buffer = torch.zeros(offsets[-1], dtype=torch.uint8, device=device)
    targets = [buffer[start : start + n].view(E4M3) for start, n in zip(offsets, SIZES)]
    return sources, targets


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype, rounding", [(torch.float32, BF16), (torch.float32, None), (BF16, None)]
)
def test_each_target_holds_the_reference_casts_bytes(dtype, rounding):
    sources, targets = _pieces(dtype, "cuda")
    indices = [0, 1, 2, 2, 3, 4]  # two pieces share a scale
    scales = torch.tensor([1.0, 448.0, 0.03125, 3.0e5, 2.5], device="cuda")
    cast = MultiTensorCast.make(sources, targets, indices, rounding)
    assert cast is not None and cast.casts(sources, targets, indices)
    cast(scales)
    for source, target, index in zip(sources, targets, indices):
        expected = _quantize_reference(
            source, E4M3, scales[index : index + 1], None, False, rounding=rounding
        )
        assert torch.equal(target.view(torch.uint8), expected.data.view(torch.uint8))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ["unaligned source", "unaligned target", "strided", "e5m2"])
def test_tensors_the_kernel_cannot_take_are_refused(case):
    sources, targets = _pieces(torch.float32, "cuda")
    if case == "unaligned source":
        sources[1] = torch.zeros(SIZES[1] + 1, device="cuda")[1:]
    elif case == "unaligned target":
        targets[1] = torch.zeros(SIZES[1] + 1, dtype=torch.uint8, device="cuda")[1:].view(E4M3)
    elif case == "strided":
        sources[2] = torch.zeros(2 * SIZES[2], device="cuda")[::2]
    else:
        targets[0] = targets[0].view(torch.uint8).view(torch.float8_e5m2)
    assert MultiTensorCast.make(sources, targets, range(len(SIZES)), None) is None


@pytest.mark.gpu
@needs_cuda
def test_a_launch_casts_only_the_memory_and_scales_it_was_made_for():
    sources, targets = _pieces(torch.float32, "cuda")
    indices = list(range(len(SIZES)))
    cast = MultiTensorCast.make(sources, targets, indices, None)
    moved = [source.clone() for source in sources]
    assert cast.casts(sources, targets, indices) and not cast.casts(moved, targets, indices)
    assert not cast.casts(sources[:-1], targets[:-1], indices[:-1])
    # The same tensors read other scales (a group's scales placed after another group's).
    assert not cast.casts(sources, targets, [index + 1 for index in indices])


def test_off_cuda_make_says_none():
    sources, targets = _pieces(torch.float32, "cpu")
    assert MultiTensorCast.make(sources, targets, range(len(SIZES)), BF16) is None
