"""`SegmentCopy` (`megatron.core.fusions.segment_copy`): segments of one flat tensor copied and
cast into places of another in one launch, with `copy_`'s bytes, by the C++ extension's kernel
(`native_segment_copy`) and by the Triton kernel, and where it does not apply."""

import contextlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron.core.fusions import segment_copy
from megatron.core.fusions.native_segment_copy import native_segment_copy, triton_kernel
from megatron.core.fusions.segment_copy import SegmentCopy

KERNELS = ["cpp", "triton"]


def _kernel(name: str) -> contextlib.AbstractContextManager:
    """Copies inside run the C++ extension's kernel (which must have built) or Triton's."""
    if name == "triton":
        return triton_kernel()
    assert native_segment_copy() is not None, "the C++ extension did not build"
    return contextlib.nullcontext()


# Empty and one-element segments, and one over several programs' blocks.
NUMELS = [70, 0, 1, 5000, 4096, 33]
# Offsets and sizes in whole 16-byte vectors (of bf16 and fp16: 8 elements).
ALIGNED_NUMELS = [64, 0, 8, 5000, 4096, 40]


def _layout(
    num_shards: int, rank: int, numels: list[int] = NUMELS
) -> tuple[list[int], list[int], int]:
    """Megatron-FSDP's gather: chunk `rank` of each tensor back to back in the source, each
    tensor's `num_shards` chunks together in the target."""
    source_offsets, target_offsets, start = [], [], 0
    for index, numel in enumerate(numels):
        source_offsets.append(sum(numels[:index]))
        target_offsets.append(start + rank * numel)
        start += num_shards * numel
    return source_offsets, target_offsets, start


def test_it_does_not_apply_off_cuda():
    source, target = torch.randn(sum(NUMELS)), torch.empty(sum(NUMELS))
    offsets = _layout(1, 0)[0]
    assert SegmentCopy.make(source, target, offsets, offsets, NUMELS) is None


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("numels", [NUMELS, ALIGNED_NUMELS], ids=["unaligned", "aligned"])
@pytest.mark.parametrize(
    "source_dtype, target_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("num_shards,rank", [(1, 0), (3, 2)])
@pytest.mark.parametrize("offset", [0, 1], ids=["", "views-off-16-bytes"])
def test_segments_copied_as_copy_does_in_one_kernel(
    num_shards, rank, source_dtype, target_dtype, numels, kernel, offset
):
    """Also from views that start off 16 bytes (aligned segments copied element-wise there)."""
    torch.manual_seed(0)
    source_offsets, target_offsets, target_numel = _layout(num_shards, rank, numels)
    source = torch.randn(sum(numels) + offset, device="cuda").to(source_dtype)[offset:]
    target = torch.full((target_numel + offset,), 7.0, device="cuda", dtype=target_dtype)
    target = target[offset:]
    expected = target.clone()
    for s, t, n in zip(source_offsets, target_offsets, numels):
        expected[t : t + n].copy_(source[s : s + n])
    copy = SegmentCopy.make(source, target, source_offsets, target_offsets, numels)
    assert copy is not None
    with _kernel(kernel):
        assert copy.try_copy(source, target)  # compiles the kernel
        target.fill_(7.0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            assert copy.try_copy(source, target)
            torch.cuda.synchronize()
    names = {"cpp": "megatron_segment_copy::", "triton": "_segment_copy_kernel"}
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and names[kernel] in kernels[0], kernels
    # The segments' bytes are copy_'s, and the rest of the target is untouched.
    assert torch.equal(target, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_buffers_that_moved_and_a_cuda_graph(kernel):
    """The table holds offsets: other tensors of the same sizes (a buffer reallocated at each
    gather) take the same copy, captured in a graph too."""
    source_offsets, target_offsets, target_numel = _layout(2, 1)
    source = torch.randn(sum(NUMELS), device="cuda")
    target = torch.zeros(target_numel, device="cuda", dtype=torch.bfloat16)
    copy = SegmentCopy.make(source, target, source_offsets, target_offsets, NUMELS)
    other_source, other_target = torch.randn_like(source), torch.zeros_like(target)
    with _kernel(kernel):
        copy.try_copy(other_source, other_target)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            copy.try_copy(source, target)
    source.copy_(torch.randn_like(source))
    graph.replay()
    for s, t, n in zip(source_offsets, target_offsets, NUMELS):
        assert torch.equal(target[t : t + n], source[s : s + n].to(torch.bfloat16))
        assert torch.equal(other_target[t : t + n], other_source[s : s + n].to(torch.bfloat16))


@pytest.mark.gpu
def test_a_segment_past_a_tensor_is_refused():
    source = torch.randn(10, device="cuda")
    with pytest.raises(ValueError, match="ends past a tensor"):
        SegmentCopy.make(source, torch.empty(10, device="cuda"), [0], [5], [8])


@pytest.mark.gpu
def test_a_copy_past_the_size_bound_is_left_to_the_caller(monkeypatch):
    """Past `MAX_ELEMENTS` one launch would hold every SM for too long (module docstring)."""
    source_offsets, target_offsets, target_numel = _layout(1, 0)
    source = torch.randn(sum(NUMELS), device="cuda")
    target = torch.empty(target_numel, device="cuda")
    args = (source, target, source_offsets, target_offsets, NUMELS)
    monkeypatch.setattr(segment_copy, "MAX_ELEMENTS", sum(NUMELS))
    assert SegmentCopy.make(*args) is not None
    monkeypatch.setattr(segment_copy, "MAX_ELEMENTS", sum(NUMELS) - 1)
    assert SegmentCopy.make(*args) is None
