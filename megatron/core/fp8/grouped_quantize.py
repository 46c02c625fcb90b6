"""Quantisation of an MoE layer's expert rows to FP8, one scale per expert, in one pass.

An expert projection's input (and its output gradient) comes grouped by expert, and each
expert's rows are cast with a scale of their own (`megatron.core.fp8.experts`). Cast one expert
at a time, a layer of 64 experts costs 64 launches per tensor and direction, and an MoE model
with many experts becomes bound by the host. `quantize_experts` casts all of them at once into
the layout the GEMMs read (`GroupedFp8Tensor`): on CUDA one kernel (`kernels.cast_experts_to_fp8`;
two under current scaling, the first taking each expert's absolute maximum), elsewhere the
reference quantiser of `megatron.core.fp8.quantize` once per expert. The bytes, scales and
recorded absolute maxima are those of `quantize` applied to each expert's rows alone, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron.core.fp8 import kernels
from megatron.core.fp8.grouped_gemm import DeviceExpertRows, ExpertRows, fp8_zeros
from megatron.core.fp8.quantize import quantize
from megatron.core.fp8.tensor import Fp8Tensor

_SCALE_STRIDE = 4
"""Each expert's dequantisation multiplier lies 16 bytes after the previous one: cuBLASLt reads a
scale from a 16-byte aligned address (`GroupedFp8Tensor.per_expert` hands single ones to it)."""


class GroupedFp8Tensor(NamedTuple):
    """The rows of every expert quantised with the expert's scale, in the padded layout of
    `ExpertRows` (each expert's rows rounded up to a multiple of 16, zero rows between).

    Attributes:
        data: `[P, cols]` row-major: the first operand of the grouped GEMMs; None where only
            the transposed copy is kept (an input saved for its weight gradient).
        scale_invs: `[G]` fp32, each expert's dequantisation multiplier (1 for an expert
            without rows), 16 bytes apart (a strided view).
        rows: where each expert's rows lie.
        transposed: `[cols, P]` row-major, the transposed bytes (the operand of the weight
            gradient, which contracts over the rows); None when not made.
    """

    data: torch.Tensor | None
    scale_invs: torch.Tensor
    rows: ExpertRows | DeviceExpertRows
    transposed: torch.Tensor | None = None

    def per_expert(self, tensor: torch.Tensor, dim: int) -> list[Fp8Tensor | None]:
        """`tensor` (`data`, `transposed` or a view of either, padded along `dim`) split into
        each expert's padded part, with the expert's scale (views made in two calls, whatever
        the number of experts); None for an expert without rows. A per-expert GEMM over a
        padded part gives zero rows (or adds zeros) for the padding. `rows` must be an
        `ExpertRows` (counts on the host)."""
        rows = self.rows
        parts = tensor.split(rows.padded_counts, dim)
        # A copy may have packed them (a saved-tensor hook's, when offloading activations).
        scales = aligned_scale_invs(self.scale_invs)
        return [
            None if count == 0 else Fp8Tensor(part, scale)
            for part, scale, count in zip(parts, scales, rows.counts)
        ]


def quantize_experts(
    x: torch.Tensor,
    rows: ExpertRows | DeviceExpertRows,
    dtype: torch.dtype,
    *,
    scales: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    transpose: bool = False,
) -> GroupedFp8Tensor:
    """Each expert's rows of `x` quantised to `dtype` with the expert's scale.

    Args:
        x: `[M, cols]`, grouped by expert (`rows`).
        rows: where each expert's rows lie (off CUDA, `DeviceExpertRows` are read on the
            host).
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
        scales: `[G]` fp32, the scale of each expert's cast (delayed scaling's); None:
            current scaling, each expert's from the absolute maximum of its own rows.
        amax_out: `[G]` fp32 that each expert's `max |rows|` is max-ed into (an expert
            without rows leaves its element as it is); None: nothing recorded.
        transpose: also make the transposed copy.

    Returns:
        The quantised rows.
    """
    groups = len(rows)
    for name, tensor in (("scales", scales), ("amax_out", amax_out)):
        if tensor is not None and tuple(tensor.shape) != (groups,):
            raise ValueError(
                f"quantize_experts: {name} has shape {list(tensor.shape)}; give one element "
                f"per expert ([{groups}])."
            )
    if x.shape[0] != rows.rows:
        raise ValueError(
            f"quantize_experts: x has {x.shape[0]} rows, the experts' counts sum to {rows.rows}."
        )
    device = x.device
    scale_invs = _scale_storage(groups, device).fill_(1.0)
    if kernels.kernels_available(x):
        data, transposed = kernels.cast_experts_to_fp8(
            x,
            dtype,
            rows.kernel_table(device),
            rows.padded_rows,
            scales,
            amax_out,
            scale_invs,
            transpose=transpose,
        )
        return GroupedFp8Tensor(data, scale_invs, rows, transposed)
    return _quantize_experts_reference(x, rows, dtype, scales, amax_out, transpose, scale_invs)


def aligned_scale_invs(scale_invs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of `scale_invs` (`[G]` fp32) as a one-element tensor at a 16-byte aligned address,
    where cuBLASLt reads a GEMM's scale: views where they lie 16 bytes apart, else views of a
    copy laid out so (`_scale_storage`)."""
    if scale_invs.stride(0) != _SCALE_STRIDE or scale_invs.data_ptr() % 16:
        copy = _scale_storage(len(scale_invs), scale_invs.device)
        copy.copy_(scale_invs)
        scale_invs = copy
    return scale_invs.split(1)


def _scale_storage(groups: int, device: torch.device) -> torch.Tensor:
    """`[groups]` fp32 (uninitialised), 16 bytes apart (`_SCALE_STRIDE`)."""
    return torch.empty(groups, _SCALE_STRIDE, dtype=torch.float32, device=device)[:, 0]


def _quantize_experts_reference(
    x: torch.Tensor,
    rows: ExpertRows | DeviceExpertRows,
    dtype: torch.dtype,
    scales: torch.Tensor | None,
    amax_out: torch.Tensor | None,
    transpose: bool,
    scale_invs: torch.Tensor,
) -> GroupedFp8Tensor:
    """`quantize_experts` as `quantize` of each expert's rows (off CUDA, and the reference of
    the kernel's bytes), into buffers of `rows.padded_rows`."""
    data = fp8_zeros((rows.padded_rows, x.shape[1]), dtype, x.device)
    transposed = fp8_zeros((x.shape[1], rows.padded_rows), dtype, x.device) if transpose else None
    host = rows.on_host() if isinstance(rows, DeviceExpertRows) else rows
    # Device rows may leave padding after the real rows, which are not cast.
    parts = zip(host.split(x[: host.rows]), host.padded_starts, host.padded_counts)
    for index, (part, start, padded_count) in enumerate(parts):
        if part.shape[0] == 0:  # no cast: its scale is not used, its amax not recorded
            continue
        cast = quantize(
            part,
            dtype,
            scale=None if scales is None else scales.narrow(0, index, 1),
            amax_out=None if amax_out is None else amax_out.narrow(0, index, 1),
            transpose=transpose,
            out=data.narrow(0, start, part.shape[0]),
        )
        scale_invs[index] = cast.scale_inv.reshape(())
        if transposed is not None:
            transposed.narrow(1, start, padded_count).copy_(cast.transposed)
    return GroupedFp8Tensor(data, scale_invs, rows, transposed)
