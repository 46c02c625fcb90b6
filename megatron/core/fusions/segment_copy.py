"""`SegmentCopy`: fixed segments of one flat tensor copied (and cast) into fixed places of
another, in one launch.

Megatron-FSDP's gather first casts this rank's shard of the main weights (one flat buffer: its
chunk of each tensor, back to back) into its block of each compute weight in the unsharded
buffer (each tensor's N chunks together), then all-gathers. As a list of (block, chunk) pairs
that is one `_foreach_copy_` launch per 320 x 65,536 elements (three for a layer of a 1.34B
GPT, twice per layer and step under ZeRO-3), or one `copy_` per tensor. The segments' offsets
are the layout's, fixed for the buffers' life whatever their addresses (the unsharded buffer is
reallocated at each gather), so one table of them, made once and kept on the device, lets one
kernel copy every segment: the host launches once, and a CUDA graph replays the launch as it is.

Each element is copied as `copy_` copies it (a cast rounds to nearest even): the bytes are the
same. It runs on CUDA with Triton for fp32, bf16 and fp16 tensors, up to `MAX_ELEMENTS`;
elsewhere `SegmentCopy.make` says None (and `try_copy` False where the current device is
another), and the caller copies segment by segment. Where its C++ extension builds
(`native_segment_copy`), a CUDA kernel with the Triton kernel's layout runs instead, launched in
one C++ call, which costs the host less than Triton's launcher.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.core.fusions.multi_tensor_tables import (
    ELEMENTWISE_BLOCK,
    ELEMENTWISE_BLOCKS,
    ELEMENTWISE_PROGRAM_ELEMENTS,
    ELEMENTWISE_WARPS,
    program_table,
)
from megatron.core.fusions.native_segment_copy import native_segment_copy
from megatron.core.fusions.triton_launch import TritonLaunch, launches_on, launches_on_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds
    triton = None


MAX_ELEMENTS = 1 << 26
"""The most elements one copy takes (about 0.1 ms of an H200's bandwidth). A copy that overlaps
compute runs on a side stream, and its launch fills every SM until its last blocks are placed:
a kernel launched on the compute stream meanwhile waits for them. As one launch, the cast of an
MoE layer's stacked experts (276M elements, 0.4 ms) held a gather of the MoE benchmark's
backward for 0.4 ms; cast tensor by tensor (`megatron.core.multi_tensor`) each launch is
shorter. Fewer programs, each looping over more blocks, left the SMs free but halved the copy's
bandwidth. `make` says None past this size."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SegmentCopy:
    """`target[t_i : t_i + n_i] = source[s_i : s_i + n_i]` (cast to `target`'s dtype) for every
    segment `i`, in one launch. Make it with `make`.

    Args:
        table: each segment's (source offset, target offset, elements), int64 on the device.
        programs: each program's segment and block (`program_table`), on the device.
        align: a number of elements that divides every offset and size (the vector width the
            kernels may load), or 1.
    """

    def __init__(self, table: torch.Tensor, programs: torch.Tensor, align: int) -> None:
        self._table = table
        self._programs = programs
        self._align = align

    @classmethod
    def make(
        cls,
        source: torch.Tensor,
        target: torch.Tensor,
        source_offsets: Sequence[int],
        target_offsets: Sequence[int],
        numels: Sequence[int],
    ) -> SegmentCopy | None:
        """The copy of these segments from tensors like `source` into tensors like `target`
        (flat and contiguous, the same sizes and dtypes at every copy; their memory may move);
        None where its kernel does not apply: not on a CUDA device with Triton, a dtype other
        than fp32, bf16 and fp16, no element to copy, or more than `MAX_ELEMENTS`.

        Raises:
            ValueError: a segment past the end of `source` or `target`.
        """
        if (
            not launches_on_device(source.device)
            or target.device != source.device
            or source.dtype not in _DTYPES
            or target.dtype not in _DTYPES
            or source.dim() != 1
            or target.dim() != 1
            or not source.is_contiguous()
            or not target.is_contiguous()
            or not any(numels)
            or sum(numels) > MAX_ELEMENTS
        ):
            return None
        for s, t, n in zip(source_offsets, target_offsets, numels):
            if s + n > source.numel() or t + n > target.numel():
                raise ValueError(
                    f"SegmentCopy: a segment of {n} elements at {s} (source) / {t} (target) "
                    f"ends past a tensor ({source.numel()} / {target.numel()} elements)."
                )
        rows = torch.tensor(list(zip(source_offsets, target_offsets, numels)), dtype=torch.int64)
        programs = program_table(rows[:, 2], ELEMENTWISE_PROGRAM_ELEMENTS)
        # 16 bytes of the narrower dtype: where every offset and size is a multiple of that,
        # the kernels load and store whole vectors (of tensors that start on 16 bytes; each
        # kernel checks the addresses it is given).
        vector = 16 // min(source.element_size(), target.element_size())
        aligned = all(n % vector == 0 for n in (*source_offsets, *target_offsets, *numels))
        return cls(rows.to(source.device), programs.to(source.device), vector if aligned else 1)

    def try_copy(self, source: torch.Tensor, target: torch.Tensor) -> bool:
        """Copies the segments of `source` into `target` (tensors like `make`'s) and returns
        True where the kernel runs now; False, copying nothing, where it does not (another
        current device, or `torch.compile` tracing)."""
        if not launches_on(source):
            return False
        native = native_segment_copy()
        if native is not None:
            native.copy(
                source,
                target,
                self._table,
                self._programs,
                ELEMENTWISE_PROGRAM_ELEMENTS,
                self._align,
            )
        else:
            _launch_copy(
                (len(self._programs),), source, target, self._table, self._programs,
                BLOCK=ELEMENTWISE_BLOCK, BLOCKS=ELEMENTWISE_BLOCKS, ALIGN=self._align,
            )  # fmt: skip
        return True


if triton is not None:

    @triton.jit
    def _segment_copy_kernel(
        source_ptr, target_ptr, table_ptr, programs_ptr,
        BLOCK: tl.constexpr, BLOCKS: tl.constexpr, ALIGN: tl.constexpr,
    ):  # fmt: skip
        """Program p: block `programs[p, 1]` (BLOCKS x BLOCK elements) of segment
        `programs[p, 0]`. Every segment's offsets and size are multiples of ALIGN elements
        (what lets the loads and stores be vectorised)."""
        program = tl.program_id(0)
        segment = tl.load(programs_ptr + 2 * program).to(tl.int64)
        first = tl.load(programs_ptr + 2 * program + 1).to(tl.int64) * (BLOCK * BLOCKS)
        source_offset = tl.multiple_of(tl.load(table_ptr + 3 * segment), ALIGN)
        target_offset = tl.multiple_of(tl.load(table_ptr + 3 * segment + 1), ALIGN)
        numel = tl.multiple_of(tl.load(table_ptr + 3 * segment + 2), ALIGN)
        for block in tl.static_range(BLOCKS):
            index = first + block * BLOCK + tl.arange(0, BLOCK)
            inside = index < numel
            values = tl.load(source_ptr + source_offset + index, mask=inside)
            tl.store(
                target_ptr + target_offset + index,
                values.to(target_ptr.dtype.element_ty),
                mask=inside,
            )

    _launch_copy = TritonLaunch(_segment_copy_kernel, num_warps=ELEMENTWISE_WARPS)
