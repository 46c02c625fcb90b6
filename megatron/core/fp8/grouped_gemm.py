"""The grouped FP8 GEMMs of an MoE layer's experts (`torch._scaled_grouped_mm`), with the
kernel's rules checked on every device.

The rows (tokens) of the experts' inputs lie one expert after the other. PyTorch's grouped FP8
GEMM on Hopper (CUTLASS, row-wise scaling) multiplies, per group, a row-major first operand by a
column-major second one, and takes:

- two E4M3 operands (never E5M2: the output gradients of the `hybrid` format cannot use it),
  and writes bf16;
- fp32 scales per row of the first operand and per column of the second (this package's scales
  are per tensor: each is repeated over its rows or columns);
- contraction dimensions and widths in multiples of 16, and groups starting at 16-byte aligned
  addresses (the kernel's TMA loads): where the groups lie along the contraction (the weight
  gradient, which sums over each expert's tokens), each group's size must be a multiple of 16,
  and some PyTorch versions ask it of every group.

So every expert's rows are padded to a multiple of 16 with zeros (`ExpertRows`), and the rows
of padding are dropped from the outputs. Two shapes:

- `fp8_grouped_mm`: `[P, K] x [G, K, N] -> [P, N]`, the rows grouped (forward, input gradient);
- `fp8_grouped_wgrad`: `[N, P] x [P, K] -> [G, N, K]`, the contraction grouped (weight
  gradient).

The experts use it where Triton does not run (`expert_gemm_kernels` has grouped GEMMs without
these limits); off CUDA (and on GPUs or builds without either) they run one `torch._scaled_mm`
per expert (`megatron.core.fp8.experts`). `grouped_kernel_available` tells whether it runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from megatron.core.fp8 import kernels
from megatron.core.fp8.expert_gemm_kernels import TILE_ROWS
from megatron.core.fp8.quantize import GEMM_ALIGNMENT, round_up
from megatron.core.fusions.triton_launch import launches_on

_scaled_grouped_mm = getattr(torch, "_scaled_grouped_mm", None)
"""The kernel; None in builds without it."""

_AVAILABLE: dict[int | None, bool] = {}


def grouped_kernel_available(device: torch.device) -> bool:
    """Whether `torch._scaled_grouped_mm` runs on `device` (a CUDA device of compute capability
    9.x or 10.x whose PyTorch build has the kernel; tried once per device, then cached)."""
    if device.type != "cuda" or _scaled_grouped_mm is None:
        return False
    if device.index not in _AVAILABLE:
        e4m3 = torch.float8_e4m3fn
        a = fp8_zeros((GEMM_ALIGNMENT, GEMM_ALIGNMENT), e4m3, device)
        b = fp8_zeros((1, GEMM_ALIGNMENT, GEMM_ALIGNMENT), e4m3, device)
        ones = torch.ones(GEMM_ALIGNMENT, dtype=torch.float32, device=device)
        offsets = torch.tensor([GEMM_ALIGNMENT], dtype=torch.int32, device=device)
        try:
            _scaled_grouped_mm(
                a, b.transpose(1, 2), ones, ones.view(1, -1), offs=offsets, out_dtype=torch.bfloat16
            )
            works = True
        except (RuntimeError, NotImplementedError, ValueError):
            works = False
        _AVAILABLE[device.index] = works
    return _AVAILABLE[device.index]


def fp8_zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An FP8 tensor of zeros (made as bytes: the FP8 zero is the zero byte, and every build's
    fill kernels take bytes)."""
    return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)


class ExpertRows:
    """Where each expert's rows lie: back to back (`M` rows), and padded (`P` rows, each
    expert's `count` rounded up to a multiple of 16, zeros beyond it).

    Args:
        counts: the rows of each local expert (any, 0 included).
    """

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = [int(count) for count in counts]
        self.padded_counts = [round_up(count) for count in self.counts]
        self.starts = [0, *itertools.accumulate(self.counts)][:-1]
        self.padded_starts = [0, *itertools.accumulate(self.padded_counts)][:-1]
        self.rows = sum(self.counts)
        self.padded_rows = sum(self.padded_counts)
        self._gemm_tile_counts = [-(-count // TILE_ROWS) for count in self.padded_counts]
        self.gemm_tiles = sum(self._gemm_tile_counts)
        """The tiles of `TILE_ROWS` padded rows of all experts (an expert's last one partial)."""
        # The device tensors below, made once per device from one copy: a projection's forward
        # and backward (and its recomputation) share this object.
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._real_rows: dict[torch.device, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.counts)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """`x` (`[M, ...]`) as one view per expert."""
        return list(torch.split(x, self.counts))

    def kernel_table(self, device: torch.device) -> torch.Tensor:
        """int32 `[3G]` on `device`: each expert's first row, its rows, and its first tile of
        16 padded rows (what the experts' cast kernel reads)."""
        return self.gemm_table(device)[: 3 * len(self)]

    def gemm_table(self, device: torch.device) -> torch.Tensor:
        """int32 `[6G]` on `device`, copied there once: `kernel_table`, `offsets`, each
        expert's padded rows, and its first tile of `TILE_ROWS` padded rows (what
        `expert_gemm_kernels` reads)."""
        table = self._tables.get(device)
        if table is None:
            tiles = [start // GEMM_ALIGNMENT for start in self.padded_starts]
            ends = itertools.accumulate(self.padded_counts)
            gemm_tiles = [0, *itertools.accumulate(self._gemm_tile_counts)][:-1]
            values = [*self.starts, *self.counts, *tiles, *ends, *self.padded_counts, *gemm_tiles]
            table = torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)
            self._tables[device] = table
        return table

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """The real rows of `padded` (`[P, ...]`), back to back (`[M, ...]`)."""
        if self.padded_rows == self.rows:
            return padded
        return padded.index_select(0, self._real_row_index(padded.device))

    def _real_row_index(self, device: torch.device) -> torch.Tensor:
        """Where each real row lies in the padded layout, `[M]` on `device`."""
        index = self._real_rows.get(device)
        if index is None:
            starts, counts, tiles = self.kernel_table(device).long().view(3, -1)
            shifts = tiles * GEMM_ALIGNMENT - starts
            index = torch.arange(self.rows, device=device)
            index += shifts.repeat_interleave(counts, output_size=self.rows)
            self._real_rows[device] = index
        return index

    def offsets(self, device: torch.device) -> torch.Tensor:
        """The grouped GEMMs' `offs`: where each expert's padded rows end, int32 on `device`."""
        groups = len(self)
        return self.gemm_table(device)[3 * groups : 4 * groups]

    def row_scales(self, scale_invs: torch.Tensor) -> torch.Tensor:
        """One multiplier per padded row: each expert's `scale_invs[e]` over its rows."""
        groups = len(self)
        repeats = self.gemm_table(scale_invs.device)[4 * groups : 5 * groups]
        return scale_invs.repeat_interleave(repeats, output_size=self.padded_rows)


class DeviceExpertRows:
    """`ExpertRows` of counts that stay on the device: nothing is read on the host, so the
    layer needs no host synchronisation (and a CUDA graph can capture it).

    The table the kernels read is computed on the device; what the host needs to size the
    launches and buffers are upper bounds of what `ExpertRows` would give: `padded_rows`
    (each expert pads at most 15 rows) and `gemm_tiles` (each expert's last tile may be
    partial). The kernels' programs past the real tiles exit, and the padded buffers' rows past
    the real ones are never read. Only the Triton kernels take it (`expert_gemm_kernels`, and
    the cast of `kernels.cast_experts_to_fp8`); paths that split the rows per expert on the
    host take `on_host()`.

    Args:
        counts: the rows of each local expert, an integer tensor `[G]` on the rows' device,
            summing to at most `rows` (as a dropless dispatch sized without a host read gives
            them; the rows after their sum are padding, which no kernel reads or writes).
        rows: the rows of the experts' input, `M`.
    """

    def __init__(self, counts: torch.Tensor, rows: int) -> None:
        if counts.dim() != 1 or counts.dtype.is_floating_point:
            raise ValueError(
                f"DeviceExpertRows: counts {list(counts.shape)} of {counts.dtype}; give one "
                "integer per expert."
            )
        groups = counts.numel()
        self._counts = counts
        self.rows = rows
        self.padded_rows = round_up(rows + (GEMM_ALIGNMENT - 1) * groups)
        self.gemm_tiles = -(-self.padded_rows // TILE_ROWS) + groups
        self._table: torch.Tensor | None = None

    def __len__(self) -> int:
        return self._counts.numel()

    def gemm_table(self, device: torch.device) -> torch.Tensor:
        """`ExpertRows.gemm_table`, computed on the counts' device (`device`) once: in one
        launch on a GPU with Triton (elsewhere `on_host()`'s, which reads the counts)."""
        if self._table is None:
            if device != self._counts.device:
                raise ValueError(
                    f"DeviceExpertRows: the counts lie on {self._counts.device}, the kernels "
                    f"run on {device}."
                )
            if launches_on(self._counts):
                self._table = kernels.expert_rows_table(self._counts.contiguous(), TILE_ROWS)
            else:
                self._table = self.on_host().gemm_table(device)
        return self._table

    def kernel_table(self, device: torch.device) -> torch.Tensor:
        """`ExpertRows.kernel_table`: the first `3G` entries of `gemm_table`."""
        return self.gemm_table(device)[: 3 * len(self)]

    def on_host(self) -> ExpertRows:
        """The same rows as an `ExpertRows` (reads the counts on the host: on a GPU, it waits
        for the work queued before)."""
        return ExpertRows(self._counts.tolist())


def fp8_grouped_mm(
    a: torch.Tensor,
    a_scale_invs: torch.Tensor,
    b: torch.Tensor,
    b_scale_invs: torch.Tensor,
    rows: ExpertRows,
    *,
    fast_accum: bool = False,
) -> torch.Tensor:
    """`a_e @ b_e` for each expert e, dequantised by `a_scale_invs[e] * b_scale_invs[e]`, in
    bf16 (the rows of padding included).

    Args:
        a: `[P, K]` E4M3, row-major, each expert's rows padded (`rows`).
        a_scale_invs: `[G]` fp32, one multiplier per expert's rows of `a`.
        b: `[G, K, N]` E4M3, column-major in its last two dimensions.
        b_scale_invs: `[G]` fp32, one multiplier per expert of `b`.
        rows: where each expert's rows lie.
        fast_accum: Hopper's fast FP8 accumulation.

    Returns:
        `[P, N]` bf16.

    Raises:
        ValueError: an operand the kernel refuses.
    """
    groups, k, n = b.shape
    _check_e4m3(a, b)
    _check_groups(rows, groups)
    if a.dim() != 2 or a.shape != (rows.padded_rows, k):
        raise ValueError(
            f"fp8_grouped_mm: a is {list(a.shape)}, expected [{rows.padded_rows}, {k}] (the "
            "padded rows times the contraction dimension)."
        )
    _check_multiples(("contraction dimension", k), ("output width", n))
    _check_row_major("a", a)
    _check_column_major("b", b)
    scale_a = rows.row_scales(a_scale_invs)
    scale_b = b_scale_invs.view(groups, 1).expand(groups, n).contiguous()
    return _scaled_grouped_mm(
        a,
        b,
        scale_a,
        scale_b,
        offs=rows.offsets(a.device),
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )


def fp8_grouped_wgrad(
    a: torch.Tensor,
    a_scale_invs: torch.Tensor,
    b: torch.Tensor,
    b_scale_invs: torch.Tensor,
    rows: ExpertRows,
) -> torch.Tensor:
    """`a[:, rows of e] @ b[rows of e, :]` for each expert e (a sum over its padded rows),
    dequantised by `a_scale_invs[e] * b_scale_invs[e]`, in bf16.

    Args:
        a: `[N, P]` E4M3, row-major (the output gradient transposed, padded per expert).
        a_scale_invs: `[G]` fp32.
        b: `[P, K]` E4M3, column-major (the transposed view of the input's padded transpose).
        b_scale_invs: `[G]` fp32.
        rows: where each expert's rows lie.

    Returns:
        `[G, N, K]` bf16.

    Raises:
        ValueError: an operand the kernel refuses.
    """
    groups = len(rows)
    _check_e4m3(a, b)
    _check_groups(rows, groups)
    (n, p), (p_b, k) = a.shape, b.shape
    if p != rows.padded_rows or p_b != p:
        raise ValueError(
            f"fp8_grouped_wgrad: a {list(a.shape)} and b {list(b.shape)} must both contract "
            f"over the {rows.padded_rows} padded rows."
        )
    _check_multiples(("output height", n), ("output width", k))
    _check_row_major("a", a)
    _check_column_major("b", b)
    return _scaled_grouped_mm(
        a,
        b,
        a_scale_invs.repeat_interleave(n),
        b_scale_invs.repeat_interleave(k),
        offs=rows.offsets(a.device),
        out_dtype=torch.bfloat16,
    )


def _check_e4m3(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"the grouped FP8 GEMM multiplies E4M3 operands only, got {a.dtype} and {b.dtype}; "
            "multiply E5M2 operands one expert at a time (torch._scaled_mm)."
        )


def _check_groups(rows: ExpertRows, groups: int) -> None:
    if len(rows) != groups:
        raise ValueError(f"{len(rows)} experts' rows for {groups} groups of the grouped GEMM.")
    if any(count % GEMM_ALIGNMENT for count in rows.padded_counts):
        raise ValueError(f"every group's rows must be padded to a multiple of {GEMM_ALIGNMENT}.")


def _check_multiples(*sizes: tuple[str, int]) -> None:
    for what, size in sizes:
        if size % GEMM_ALIGNMENT:
            raise ValueError(
                f"the grouped FP8 GEMM needs the {what} ({size}) in a multiple of {GEMM_ALIGNMENT}."
            )


def _check_row_major(name: str, operand: torch.Tensor) -> None:
    if operand.stride(-1) != 1 or operand.stride(-2) % GEMM_ALIGNMENT:
        raise ValueError(
            f"the grouped FP8 GEMM's {name} must be row-major with 16-byte aligned rows, got "
            f"strides {operand.stride()}."
        )


def _check_column_major(name: str, operand: torch.Tensor) -> None:
    if operand.stride(-2) != 1 or operand.stride(-1) % GEMM_ALIGNMENT:
        raise ValueError(
            f"the grouped FP8 GEMM's {name} must be column-major with 16-byte aligned columns "
            f"(the transposed view of a row-major tensor), got strides {operand.stride()}."
        )
