"""`MultiTensorCast`: many tensors cast to E4M3, each with its own scale, in one launch.

An engine that keeps FP8 compute weights (`fp8_param_gather`) casts every FP8 weight of a
parameter group after each optimizer step: a Llama-3-8B layer has four, a 1.34B GPT's 24 layers
96. One cast kernel per weight costs the host a launch and the quantiser's bookkeeping each,
which bound the eager step of a model whose GEMMs are small; the casts of a group share a
dtype, a rounding and a destination format, so one kernel can take them all.

The kernel walks a table of the tensors (source address, destination address, number of
elements, index of the scale) and one of its programs (the tensor and the block each casts):
both made once for a set of tensors and kept on the device, since an engine casts the same
buffers at every refresh; each launch reads the scales from a tensor passed to it. Each element
is cast as `megatron.core.fp8.quantize.quantize` casts it (`fp8(clamp(x * scale, -448, 448))`,
`x` first rounded to the model dtype where asked, the product in fp32, NaN kept): the bytes are
the same.

It runs on CUDA with Triton, for contiguous sources and destinations that start on 16-byte
boundaries, made outside CUDA-graph capture (a captured step replays
the launch made in the eager steps before it); `MultiTensorCast.make` says None elsewhere, and
the caller casts tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.core.fp8.kernels import _ROUNDINGS
from megatron.core.fp8.recipe import fp8_max
from megatron.core.fusions.multi_tensor_tables import (
    ELEMENTWISE_PROGRAM_ELEMENTS,
    ELEMENTWISE_WARPS,
    aligned,
    program_table,
)
from megatron.core.fusions.triton_launch import TritonLaunch, launches_on
from megatron.core.utils import cuda_graph_capturing

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds
    triton = None


class MultiTensorCast:
    """The casts of `sources[i]` into `targets[i]` (E4M3) with `scales[scale_indices[i]]`, for
    every `i`, in one launch (module docstring). Make it with `make`.

    Args:
        key: the tensors' addresses, sizes and dtypes, and the scale indices, which `casts`
            compares (`_key`).
        table: the tensors' rows, on the device.
        programs: each program's row and block, on the device.
        scale_count: how many scales the casts read (the largest scale index, plus one).
        source_dtype: the sources' dtype.
        rounding: the dtype the sources are rounded to before the cast, or None.
    """

    def __init__(
        self,
        key: tuple[tuple[int, int, torch.dtype, int, int], ...],
        table: torch.Tensor,
        programs: torch.Tensor,
        scale_count: int,
        source_dtype: torch.dtype,
        rounding: torch.dtype | None,
    ) -> None:
        self._key = key
        self._table = table
        self._programs = programs
        self._scale_count = scale_count
        self._constants = dict(
            SOURCE=_TRITON_DTYPES[source_dtype],
            ROUNDING=_ROUNDINGS[rounding],
            BLOCK=_BLOCK,
            BLOCKS=ELEMENTWISE_PROGRAM_ELEMENTS // _BLOCK,
        )

    @classmethod
    def make(
        cls,
        sources: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        scale_indices: Sequence[int],
        rounding: torch.dtype | None,
    ) -> MultiTensorCast | None:
        """The launch of these casts, or None where the kernel cannot take them (the module
        docstring's conditions).

        Args:
            sources: tensors of one floating dtype, each the size of its target.
            targets: contiguous E4M3 tensors.
            scale_indices: each cast's scale in the tensor a launch is given.
            rounding: bf16 or fp16 to round the sources to first; None or fp32: as they are.
        """
        # Its tables are copied to the device, which a stream being captured cannot do.
        if triton is None or not sources or cuda_graph_capturing():
            return None
        dtype = sources[0].dtype
        device = sources[0].device
        for source, target in zip(sources, targets, strict=True):
            if (
                not launches_on(source)
                or source.dtype != dtype
                or dtype not in _TRITON_DTYPES
                or target.dtype != torch.float8_e4m3fn
                or target.device != device
                or source.numel() != target.numel()
                or not (source.is_contiguous() and target.is_contiguous())
                or not aligned(source.data_ptr(), source.numel())
                or not aligned(target.data_ptr(), target.numel())
            ):
                return None
        key = _key(sources, targets, scale_indices)
        rows = [
            (source.data_ptr(), target.data_ptr(), source.numel(), index)
            for source, target, index in zip(sources, targets, scale_indices, strict=True)
        ]
        table = torch.tensor(rows, dtype=torch.int64)
        programs = program_table(table[:, 2], ELEMENTWISE_PROGRAM_ELEMENTS)
        scale_count = max(scale_indices) + 1
        return cls(key, table.to(device), programs.to(device), scale_count, dtype, rounding)

    def casts(
        self,
        sources: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        scale_indices: Sequence[int],
    ) -> bool:
        """Whether this launch casts `sources` into `targets` with these scales (the same memory
        and scale indices as made)."""
        return _key(sources, targets, scale_indices) == self._key

    def __call__(self, scales: torch.Tensor) -> None:
        """Casts every source into its target with its scale in `scales` (fp32, 1-D, on the
        targets' device).

        Raises:
            ValueError: `scales` is not such a tensor, or has fewer scales than the casts read.
        """
        if (
            scales.dtype != torch.float32
            or not scales.is_contiguous()
            or scales.device != self._table.device
            or scales.numel() < self._scale_count
        ):
            raise ValueError(
                f"MultiTensorCast: scales must be a contiguous fp32 tensor of at least "
                f"{self._scale_count} elements on {self._table.device}, got {scales.dtype} "
                f"{list(scales.shape)} on {scales.device} (contiguous: "
                f"{scales.is_contiguous()})."
            )
        count = self._programs.shape[0]
        if count:
            limit = fp8_max(torch.float8_e4m3fn)
            _launch((count,), self._table, self._programs, scales, limit, **self._constants)


def _key(
    sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], scale_indices: Sequence[int]
) -> tuple[tuple[int, int, torch.dtype, int, int], ...]:
    """What a launch's tables depend on: each source's address, size and dtype, and each
    target's address and scale index."""
    return tuple(
        (source.data_ptr(), source.numel(), source.dtype, target.data_ptr(), index)
        for source, target, index in zip(sources, targets, scale_indices, strict=True)
    )


_BLOCK = 512
"""Elements a program casts per iteration: four per thread (a 16-byte load of fp32 main weights,
8 bytes of bf16 ones). Timed on an H200 for fp32 sources, it casts at 4.1 TB/s against 3.6 for
the elementwise kernels' eight."""
assert ELEMENTWISE_PROGRAM_ELEMENTS % _BLOCK == 0, "a program's chunk is whole iterations"

_TRITON_DTYPES = (
    {}
    if triton is None
    else {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
)

if triton is not None:
    from megatron.core.fp8.kernels import _rounded, _to_fp8

    @triton.jit
    def _multi_cast_kernel(
        table,
        programs,
        scales,
        limit,
        SOURCE: tl.constexpr,
        ROUNDING: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        program = tl.program_id(0)
        # A row: source address, destination address, number of elements, scale index.
        row = table + tl.load(programs + 2 * program).to(tl.int64) * 4
        start = tl.load(programs + 2 * program + 1).to(tl.int64) * (BLOCK * BLOCKS)
        # Every address starts on a 16-byte boundary (`make`).
        source = tl.multiple_of(tl.load(row).to(tl.pointer_type(SOURCE)), 16)
        target = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.float8e4nv)), 16)
        numel = tl.load(row + 2)
        scale = tl.load(scales + tl.load(row + 3))
        for block in range(BLOCKS):
            offsets = start + block * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < numel
            values = tl.load(source + offsets, mask=mask, other=0.0).to(tl.float32)
            values = _rounded(values, ROUNDING)
            scaled = tl.clamp(values * scale, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
            tl.store(target + offsets, _to_fp8(scaled, True), mask=mask)

    _launch = TritonLaunch(_multi_cast_kernel, num_warps=ELEMENTWISE_WARPS)
