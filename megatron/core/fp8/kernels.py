"""FP8 casts on CUDA in one pass: the cast, the absolute maximum and the transposed copy.

Casting an activation to FP8 with plain torch ops takes several passes over it (the absolute
maximum, the scale, the product, the clamp, the cast, and a transposed copy for the weight
gradient), which costs about as much as the FP8 GEMM saves. `cast_to_fp8` reads each element
once and writes its FP8 byte (and, where asked, the byte of the transposed copy), recording the
tensor's absolute maximum with an atomic max on the way:

- delayed scaling knows its scale before the cast (last pass's): one kernel;
- current scaling (`scale=None`) needs the absolute maximum first: an `amax` kernel, then the
  cast, which derives the scale from it on the GPU (no host synchronisation).

`cast_experts_to_fp8` casts the rows of an MoE layer's experts, each expert's with its own
scale, in one launch for all experts (two under current scaling), into the padded layout the
grouped GEMMs read (`megatron.core.fp8.grouped_quantize`).

`update_scales` is delayed scaling's per-pass update of every slot (roll the amax history,
take the new scale) in one launch, where its torch ops (`scaling.update_delayed_scaling`) are
some twenty.

`expert_rows_table` computes where each expert's rows lie, the table the experts' cast and
grouped GEMMs read, from counts on the GPU in one launch (`grouped_gemm.DeviceExpertRows`).

`transpose_fp8` makes the contiguous transpose of FP8 bytes (a weight's, for the input-gradient
GEMM) in tiles: torch's strided copy of one-byte elements reads them uncoalesced, at a few
percent of the memory bandwidth.

The results are those of `megatron.core.fp8.quantize`'s reference quantiser bit for bit
(`fp8(clamp(x * scale, -max, max))`, the product in fp32, the division in the scale correctly
rounded; a NaN stays NaN, and the absolute maximum skips NaNs as Transformer Engine's does).

Triton ships with PyTorch's CUDA builds; without it, or off CUDA, the reference runs.
"""

from __future__ import annotations

import torch

from megatron.core.fusions.triton_launch import TritonLaunch, launches_on

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds
    triton = None

GEMM_ALIGNMENT = 16
"""The transposed copy's rows are padded to this (Hopper FP8 GEMMs contract over multiples)."""

_BLOCK_ROWS = 64
_BLOCK_COLS = 128
_CAST_WARPS = 8
"""The cast's tile and warps: among tiles of 32 to 128 rows and columns (at most 8192 elements)
with 4 or 8 warps, the fastest or within 2% of it on an H200 (Triton 3.6) for the delayed cast
with its transposed copy of [4096, N] bf16 tensors, N = 4096, 6144, 14336 and 28672 (145 us for
N = 28672, where the 32x64 tile took 201 us)."""
_EXPERT_BLOCK_COLS = 128
"""The experts' cast: tiles of 16 rows (the padding's multiple, so that a tile holds one
expert's rows) by this many columns."""
_AMAX_BLOCK = 16384
_AMAX_WARPS = 16
_TRANSPOSE_BLOCK = 64
_TRANSPOSE_WARPS = 4
_SCALE_UPDATE_BLOCK = 128
"""Slots per program of the delayed-scaling update."""
_SCALE_UPDATE_ROWS = 16
"""Rows of the amax history that each step of the update's loop moves, for all of a program's
slots: on an H200 an update of a 1,024-row history took 0.38 ms moving one row a step (each
step waits on its load), 0.05 ms moving 16."""

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_ROUNDINGS = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def kernels_available(x: torch.Tensor) -> bool:
    """Whether `cast_to_fp8` runs its kernels for `x`: Triton, a CUDA tensor on the current
    device, a 2-D floating tensor, and no `torch.compile` tracing."""
    return (
        x.dim() == 2
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and launches_on(x)
    )


def cast_to_fp8(
    x: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    amax_out: torch.Tensor | None,
    *,
    rowwise: bool = True,
    transpose: bool = False,
    rounding: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """`x` cast to FP8 in one pass (two under current scaling).

    Args:
        x: `[rows, cols]`, contiguous, on CUDA (`kernels_available`).
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
        scale: one fp32 element, the scale to cast with (delayed scaling); None: current
            scaling, `max / amax` of `x` itself (1 where the maximum is 0 or not finite, the
            largest fp32 where the quotient overflows).
        amax_out: one fp32 element that `max |x|` is max-ed into; None: nothing recorded.
        rowwise: make the row-major copy.
        transpose: make the transposed copy, `[cols, rows]` with `rows` rounded up to 16, the
            columns beyond `rows` zero.
        rounding: `torch.bfloat16` or `torch.float16`: cast `x` rounded to that dtype first
            (the cast of `x.to(rounding)`, without making it); None or `torch.float32`: as it
            is.
        out: where the row-major copy goes (contiguous, `[rows, cols]`, of `dtype`); None: a
            new tensor.

    Returns:
        (the row-major FP8 copy or None, the scale's inverse as a new fp32 tensor of the
        scale's shape (0-d under current scaling), the transposed copy or None).
    """
    rows, cols = x.shape
    x = x.contiguous()
    limit = _FP8_MAX[dtype]
    if scale is None:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
        record_amax(x, amax)
        if amax_out is not None:
            torch.maximum(amax_out, amax, out=amax_out)
        scale_source, from_amax, record = amax, True, None
    else:
        scale_source, from_amax, record = scale, False, amax_out
    if out is not None and (
        out.shape != x.shape
        or out.dtype != dtype
        or out.device != x.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"cast_to_fp8: out must be a contiguous {list(x.shape)} {dtype} tensor on "
            f"{x.device}, got {list(out.shape)} {out.dtype} on {out.device}."
        )
    data = out
    if rowwise and data is None:
        data = torch.empty(rows, cols, dtype=dtype, device=x.device)
    padded_rows = -(-rows // GEMM_ALIGNMENT) * GEMM_ALIGNMENT
    transposed = torch.empty(cols, padded_rows, dtype=dtype, device=x.device) if transpose else None
    # Shaped as the reference quantiser's `scale.reciprocal()`.
    scale_inv = torch.empty(
        () if scale is None else scale.shape, dtype=torch.float32, device=x.device
    )
    # Plain integer arithmetic: `triton.cdiv` unwraps constexprs, microseconds per launch.
    grid = (-(-padded_rows // _BLOCK_ROWS), -(-cols // _BLOCK_COLS))
    dummy = scale_inv  # an unused pointer argument (never written when its flag is off)
    _launch_cast(
        grid,
        x,
        scale_source,
        record if record is not None else dummy,
        data if data is not None else dummy,
        transposed if transposed is not None else dummy,
        scale_inv,
        rows,
        cols,
        padded_rows,
        limit,
        SCALE_FROM_AMAX=from_amax,
        RECORD_AMAX=record is not None,
        ROWWISE=rowwise,
        TRANSPOSE=transpose,
        E4M3=dtype == torch.float8_e4m3fn,
        ROUNDING=_ROUNDINGS[rounding],
        BLOCK_ROWS=_BLOCK_ROWS,
        BLOCK_COLS=_BLOCK_COLS,
    )
    return data, scale_inv, transposed


def cast_experts_to_fp8(
    x: torch.Tensor,
    dtype: torch.dtype,
    table: torch.Tensor,
    padded_rows: int,
    scales: torch.Tensor | None,
    amax_out: torch.Tensor | None,
    scale_invs: torch.Tensor,
    *,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of `G` experts cast to FP8, each expert's with its own scale, into the padded
    layout (each expert's rows rounded up to a multiple of 16, zeros between).

    One program casts one tile of 16 padded rows, all of one expert: it finds the expert by a
    binary search in `table`, so the launch costs the same for any number of experts.

    Args:
        x: `[M, cols]`, contiguous, on CUDA (`kernels_available`), grouped by expert.
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
        table: int32 `[3G]` on `x`'s device: each expert's first row of `x`, its rows, and
            its first tile of 16 padded rows (`ExpertRows.kernel_table`).
        padded_rows: the rows of the padded layout (`P`, 16 times the tiles), or more
            (`DeviceExpertRows`' upper bound: the rows past the experts' are left unwritten).
        scales: `[G]` fp32 (delayed scaling's); None: current scaling, each expert's
            `max / amax` of its own rows.
        amax_out: `[G]` fp32 that each expert's `max |rows|` is max-ed into; None: nothing.
        scale_invs: `[G]` fp32 (any stride) that each expert with rows gets its scale's inverse
            in; the others' are left as they are.
        transpose: also make the transposed copy `[cols, P]`.

    Returns:
        (the padded copy `[P, cols]`, the transposed copy or None).
    """
    cols = x.shape[1]
    groups = scale_invs.shape[0]
    x = x.contiguous()
    tiles = padded_rows // GEMM_ALIGNMENT
    data = torch.empty(padded_rows, cols, dtype=dtype, device=x.device)
    transposed = torch.empty(cols, padded_rows, dtype=dtype, device=x.device) if transpose else None
    if tiles == 0:
        return data, transposed
    grid = (tiles, -(-cols // _EXPERT_BLOCK_COLS))
    search_steps = max(groups - 1, 1).bit_length()
    if scales is None:
        scales = torch.zeros(groups, dtype=torch.float32, device=x.device)
        _launch_expert_amax(
            grid,
            x,
            table,
            scales,
            cols,
            groups,
            SEARCH_STEPS=search_steps,
            BLOCK_COLS=_EXPERT_BLOCK_COLS,
        )
        if amax_out is not None:
            torch.maximum(amax_out, scales, out=amax_out)
        from_amax, record = True, None
    else:
        from_amax, record = False, amax_out
    _launch_expert_cast(
        grid,
        x,
        table,
        scales,
        record if record is not None else scales,
        data,
        transposed if transposed is not None else data,
        scale_invs,
        scale_invs.stride(0),
        cols,
        padded_rows,
        groups,
        _FP8_MAX[dtype],
        SCALE_FROM_AMAX=from_amax,
        RECORD_AMAX=record is not None,
        TRANSPOSE=transpose,
        E4M3=dtype == torch.float8_e4m3fn,
        SEARCH_STEPS=search_steps,
        BLOCK_COLS=_EXPERT_BLOCK_COLS,
    )
    return data, transposed


def expert_rows_table(counts: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """`ExpertRows.gemm_table` of `counts` (`[G]` integers, contiguous, on the current CUDA
    device, Triton present) computed there in one launch: int32 `[6G]`, each expert's first
    row, rows, first tile of 16 padded rows, end of its padded rows, padded rows, and first
    tile of `tile_rows` padded rows."""
    groups = counts.numel()
    table = torch.empty(6 * groups, dtype=torch.int32, device=counts.device)
    if groups:
        block = max(triton.next_power_of_2(groups), 16)
        _launch_rows_table((1,), counts, table, groups, TILE_ROWS=tile_rows, BLOCK=block)
    return table


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """`data.transpose(-2, -1).contiguous()` for a 2-D FP8 tensor, or a 3-D stack of them (an MoE
    projection's expert weights: one launch for all), on CUDA (`data.is_cuda`, Triton present).

    Args:
        data: `[rows, cols]` or `[count, rows, cols]`, contiguous.
    """
    *stack, rows, cols = data.shape
    out = torch.empty(*stack, cols, rows, dtype=data.dtype, device=data.device)
    if data.numel():
        matrices = stack[0] if stack else 1
        grid = (-(-cols // _TRANSPOSE_BLOCK), -(-rows // _TRANSPOSE_BLOCK), matrices)
        _launch_transpose(grid, data, out, rows, cols, BLOCK=_TRANSPOSE_BLOCK)
    return out


def updates_scales(history: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `update_scales` runs its kernel for this delayed-scaling state: an fp32 amax
    history `[H, n]` and scales `[n]`, contiguous, on the current CUDA device."""
    return (
        history.dim() == 2
        and history.dtype == scale.dtype == torch.float32
        and history.is_contiguous()
        and scale.is_contiguous()
        and scale.shape == history.shape[1:]
        and scale.device == history.device
        and history.numel() < 2**31  # the kernel's offsets are 32-bit
        and launches_on(history)
    )


def update_scales(
    history: torch.Tensor, scale: torch.Tensor, scaled_max: float, take_max: bool
) -> None:
    """`megatron.core.fp8.scaling.update_delayed_scaling` in one kernel (the same values):
    each slot whose row-0 amax is not zero rolls its history (row 0 to the end, row 1 out,
    row 0 zeroed) and takes `scaled_max / amax` as its scale, `amax` the history's maximum
    (`take_max`, NaNs skipped) or row 0, where that is finite and positive."""
    rows, cols = history.shape
    if cols:
        _launch_scale_update(
            (-(-cols // _SCALE_UPDATE_BLOCK),),
            history,
            scale,
            rows,
            cols,
            scaled_max,
            TAKE_MAX=take_max,
            BLOCK=_SCALE_UPDATE_BLOCK,
            BLOCK_ROWS=_SCALE_UPDATE_ROWS,
        )


def amax_kernel_available(x: torch.Tensor, amax: torch.Tensor) -> bool:
    """Whether `record_amax` runs its kernel for `x` and `amax`: both contiguous, `x`
    floating point of any shape (stacked expert weights are 3-D) on the current CUDA device,
    `amax` fp32 beside it, and no `torch.compile` tracing."""
    return (
        x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and amax.dtype == torch.float32
        and x.is_contiguous()
        and amax.is_contiguous()
        and amax.device == x.device
        and launches_on(x)
    )


def record_amax(x: torch.Tensor, amax: torch.Tensor) -> None:
    """Max-es `max |x|` (NaNs skipped) into `amax` (fp32, contiguous), segment `i` of `x`'s
    elements into `amax[i]` where `amax` has several (`quantize.record_amax`), `x` contiguous."""
    segments = amax.numel()
    numel = x.numel() // segments
    if numel:
        grid = (-(-numel // _AMAX_BLOCK), segments)
        _launch_amax(grid, x, amax, numel, BLOCK=_AMAX_BLOCK)


if triton is not None:

    @triton.jit
    def _scale_from(amax, limit):
        """Transformer Engine's `compute_scale_from_amax`: `limit / amax`, correctly rounded;
        1 where `amax` is 0 or not finite; the largest fp32 where the quotient overflows."""
        finite = (amax == amax) & (amax < float("inf"))
        safe = tl.where(finite & (amax > 0), amax, 1.0)
        scale = tl.math.div_rn(tl.full(amax.shape, limit, tl.float32), safe)
        scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
        return tl.where(finite & (amax > 0), scale, 1.0)

    @triton.jit
    def _tile_amax(values):
        """`max |values|`, NaNs skipped (Transformer Engine's `fmaxf`)."""
        magnitude = tl.abs(values)
        magnitude = tl.where(magnitude == magnitude, magnitude, 0.0)
        return tl.max(tl.max(magnitude, axis=1), axis=0)

    @triton.jit
    def _rounded(values, ROUNDING: tl.constexpr):
        """`values` (fp32) rounded to bf16 (1) or fp16 (2) and back, or as they are (0)."""
        if ROUNDING == 1:
            values = values.to(tl.bfloat16).to(tl.float32)
        elif ROUNDING == 2:
            values = values.to(tl.float16).to(tl.float32)
        return values

    @triton.jit
    def _to_fp8(values, E4M3: tl.constexpr):
        """`values` (fp32, within the format's range) rounded to FP8."""
        if E4M3:
            fp8 = values.to(tl.float8e4nv)
        else:
            fp8 = values.to(tl.float8e5)
        return fp8

    @triton.jit
    def _transpose_kernel(x_ptr, out_ptr, rows, cols, BLOCK: tl.constexpr):
        # Program (i, j) writes output rows i*BLOCK.. (input columns) and output columns
        # j*BLOCK.. (input rows); the load is indexed in the output's order, and Triton stages
        # the tile through shared memory so that both the load and the store are coalesced.
        # Program (i, j, k) does so for matrix k of a stack.
        out_row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[:, None]
        out_col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :]
        matrix = tl.program_id(2).to(tl.int64) * rows * cols
        inside = (out_row < cols) & (out_col < rows)
        values = tl.load(x_ptr + matrix + out_col * cols + out_row, mask=inside)
        tl.store(out_ptr + matrix + out_row * rows + out_col, values, mask=inside)

    @triton.jit
    def _amax_kernel(x_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
        # Axis 1: the segment of `numel` elements, whose amax goes into `amax_ptr[segment]`.
        # 64-bit offsets: tensors of 2**31 elements and more exist (a long sequence's gradients).
        segment = tl.program_id(1).to(tl.int64)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(x_ptr + segment * numel + offsets, mask=offsets < numel, other=0.0)
        magnitude = tl.abs(values.to(tl.float32))
        magnitude = tl.where(magnitude == magnitude, magnitude, 0.0)  # NaNs skipped
        tl.atomic_max(amax_ptr + segment, tl.max(magnitude, axis=0))

    @triton.jit
    def _cast_kernel(
        x_ptr,
        scale_ptr,
        amax_ptr,
        out_ptr,
        out_t_ptr,
        scale_inv_ptr,
        rows,
        cols,
        padded_rows,
        limit,
        SCALE_FROM_AMAX: tl.constexpr,
        RECORD_AMAX: tl.constexpr,
        ROWWISE: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        E4M3: tl.constexpr,
        ROUNDING: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
    ):
        # 64-bit offsets: tensors of 2**31 elements and more exist (a long sequence's gradients).
        row_block, col_block = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        row = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
        col = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
        inside = (row < rows) & (col < cols)
        values = tl.load(x_ptr + row * cols + col, mask=inside, other=0.0).to(tl.float32)
        values = _rounded(values, ROUNDING)

        scale = tl.load(scale_ptr)
        if SCALE_FROM_AMAX:
            scale = _scale_from(scale, limit)
        if (row_block == 0) & (col_block == 0):
            tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
        if RECORD_AMAX:
            tl.atomic_max(amax_ptr, _tile_amax(values))

        scaled = tl.clamp(values * scale, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
        if ROWWISE:
            tl.store(out_ptr + row * cols + col, _to_fp8(scaled, E4M3), mask=inside)
        if TRANSPOSE:
            # The tile read again in the transposed order (from L2: this program just read it),
            # which lets Triton give the load and the store each a coalesced layout. A register
            # transpose (`tl.trans`) of fp32 tiles gave wrong bytes.
            row_t = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[None, :]
            col_t = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[:, None]
            inside_t = (row_t < rows) & (col_t < cols)
            values_t = tl.load(x_ptr + row_t * cols + col_t, mask=inside_t, other=0.0)
            values_t = _rounded(values_t.to(tl.float32), ROUNDING)
            scaled_t = tl.clamp(values_t * scale, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
            # Rows beyond `rows` (up to `padded_rows`) were loaded as 0: their bytes are zero.
            tl.store(
                out_t_ptr + col_t * padded_rows + row_t,
                _to_fp8(scaled_t, E4M3),
                mask=(row_t < padded_rows) & (col_t < cols),
            )

    @triton.jit
    def expert_of_tile(tile_starts, groups, tile, SEARCH_STEPS: tl.constexpr):
        """The expert whose tiles include `tile`: the last whose first tile (`tile_starts`,
        `groups` ascending int32) is at or before it (empty experts own none), by a binary
        search of `SEARCH_STEPS` (the bit length of `groups - 1`) steps."""
        low, high = 0, groups - 1
        for _ in tl.static_range(SEARCH_STEPS):
            middle = (low + high + 1) // 2
            before = tl.load(tile_starts + middle) <= tile
            low = tl.where(before, middle, low)
            high = tl.where(before, high, middle - 1)
        return low

    @triton.jit
    def _rows_table_kernel(
        counts_ptr, table_ptr, groups, TILE_ROWS: tl.constexpr, BLOCK: tl.constexpr
    ):
        index = tl.arange(0, BLOCK)
        inside = index < groups
        counts = tl.load(counts_ptr + index, mask=inside, other=0).to(tl.int32)
        padded = (counts + 15) // 16 * 16
        ends = tl.cumsum(padded, axis=0)
        gemm_tiles = (padded + TILE_ROWS - 1) // TILE_ROWS
        tl.store(table_ptr + index, tl.cumsum(counts, axis=0) - counts, mask=inside)
        tl.store(table_ptr + groups + index, counts, mask=inside)
        tl.store(table_ptr + 2 * groups + index, (ends - padded) // 16, mask=inside)
        tl.store(table_ptr + 3 * groups + index, ends, mask=inside)
        tl.store(table_ptr + 4 * groups + index, padded, mask=inside)
        gemm_starts = tl.cumsum(gemm_tiles, axis=0) - gemm_tiles
        tl.store(table_ptr + 5 * groups + index, gemm_starts, mask=inside)

    @triton.jit
    def tiles_end(tile_starts, rows, groups, TILE: tl.constexpr):
        """The first tile of `TILE` padded rows past the last expert's (`tile_starts`: each
        expert's first tile, `rows`: its rows, `groups` int32 each): a grid sized by an upper
        bound (`DeviceExpertRows`) has programs from there on, with nothing to do."""
        last_rows = tl.load(rows + groups - 1)
        return tl.load(tile_starts + groups - 1) + (last_rows + TILE - 1) // TILE

    @triton.jit
    def _expert_tile(table_ptr, groups, SEARCH_STEPS: tl.constexpr):
        """The expert of this program's tile (16 padded rows), the first row of `x` it reads
        and how many of its rows are the expert's (the rest are padding)."""
        tile = tl.program_id(0)
        tile_starts = table_ptr + 2 * groups
        low = expert_of_tile(tile_starts, groups, tile, SEARCH_STEPS)
        skipped = (tile - tl.load(tile_starts + low)) * 16
        first_row = tl.load(table_ptr + low) + skipped
        rows = tl.minimum(tl.load(table_ptr + groups + low) - skipped, 16)
        return low, first_row, rows, skipped == 0

    @triton.jit
    def _expert_amax_kernel(
        x_ptr,
        table_ptr,
        amax_ptr,
        cols,
        groups,
        SEARCH_STEPS: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
    ):
        if tl.program_id(0) >= tiles_end(table_ptr + 2 * groups, table_ptr + groups, groups, 16):
            return
        expert, first_row, rows, _ = _expert_tile(table_ptr, groups, SEARCH_STEPS)
        row = tl.arange(0, 16)[:, None]
        col = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
        inside = (row < rows) & (col < cols)
        offsets = (first_row.to(tl.int64) + row) * cols + col
        values = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.atomic_max(amax_ptr + expert, _tile_amax(values))

    @triton.jit
    def _expert_cast_kernel(
        x_ptr,
        table_ptr,
        scale_ptr,
        amax_ptr,
        out_ptr,
        out_t_ptr,
        scale_inv_ptr,
        scale_inv_stride,
        cols,
        padded_rows,
        groups,
        limit,
        SCALE_FROM_AMAX: tl.constexpr,
        RECORD_AMAX: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        E4M3: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
    ):
        if tl.program_id(0) >= tiles_end(table_ptr + 2 * groups, table_ptr + groups, groups, 16):
            return
        expert, first_row, rows, first_tile = _expert_tile(table_ptr, groups, SEARCH_STEPS)
        col_block = tl.program_id(1).to(tl.int64)
        padded_row = tl.program_id(0).to(tl.int64) * 16
        row = tl.arange(0, 16)[:, None]
        col = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
        inside = (row < rows) & (col < cols)
        offsets = (first_row.to(tl.int64) + row) * cols + col
        values = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)

        scale = tl.load(scale_ptr + expert)
        if SCALE_FROM_AMAX:
            scale = _scale_from(scale, limit)
        if first_tile & (col_block == 0):
            inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
            tl.store(scale_inv_ptr + expert * scale_inv_stride, inverse)
        if RECORD_AMAX:
            tl.atomic_max(amax_ptr + expert, _tile_amax(values))

        # Rows of padding were loaded as 0: their bytes are zero.
        scaled = tl.clamp(values * scale, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + (padded_row + row) * cols + col, _to_fp8(scaled, E4M3), mask=col < cols)
        if TRANSPOSE:
            # Read again in the transposed order, as `_cast_kernel` does, for coalescing.
            row_t = tl.arange(0, 16)[None, :]
            col_t = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[:, None]
            offsets_t = (first_row.to(tl.int64) + row_t) * cols + col_t
            values_t = tl.load(x_ptr + offsets_t, mask=(row_t < rows) & (col_t < cols), other=0.0)
            scaled_t = tl.clamp(
                values_t.to(tl.float32) * scale, -limit, limit, propagate_nan=tl.PropagateNan.ALL
            )
            tl.store(
                out_t_ptr + col_t * padded_rows + padded_row + row_t,
                _to_fp8(scaled_t, E4M3),
                mask=col_t < cols,
            )

    @triton.jit
    def _scale_update_kernel(
        history_ptr,
        scale_ptr,
        rows,
        cols,
        scaled_max,
        TAKE_MAX: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
    ):
        col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = col < cols
        current = tl.load(history_ptr + col, mask=inside, other=0.0)
        used = (current != 0) | (current != current)  # a NaN counts as used
        amax = current
        if TAKE_MAX:
            amax = tl.where(current == current, current, 0.0)
        # `BLOCK_ROWS` rows at a time, each stored one row up. Every row a block stores into
        # was loaded by this block or the one before: the barrier between a block's loads and
        # its stores keeps any thread from writing a row another has yet to read.
        for start in range(1, rows, BLOCK_ROWS):
            row = start + tl.arange(0, BLOCK_ROWS)
            block = (row < rows)[:, None] & inside[None, :]
            values = tl.load(history_ptr + row[:, None] * cols + col[None, :], mask=block)
            if TAKE_MAX:
                values_seen = tl.where(block & (values == values), values, 0.0)
                amax = tl.maximum(amax, tl.max(values_seen, axis=0))
            tl.debug_barrier()
            shifted = block & (row >= 2)[:, None] & used[None, :]
            tl.store(history_ptr + (row[:, None] - 1) * cols + col[None, :], values, mask=shifted)
        tl.store(history_ptr + (rows - 1) * cols + col, current, mask=inside & used)
        tl.store(history_ptr + col, tl.zeros_like(current), mask=inside & used)
        old = tl.load(scale_ptr + col, mask=inside, other=1.0)
        # A slot whose amax is zero or not finite keeps its scale (an infinite one clamped).
        valid = (amax == amax) & (amax < float("inf")) & (amax > 0) & used
        new = tl.where(valid, _scale_from(amax, scaled_max), old)
        new = tl.where(tl.abs(new) == float("inf"), 3.4028234663852886e38, new)
        tl.store(scale_ptr + col, new, mask=inside)

    _launch_cast = TritonLaunch(_cast_kernel, num_warps=_CAST_WARPS)
    _launch_expert_amax = TritonLaunch(_expert_amax_kernel, num_warps=4)
    _launch_expert_cast = TritonLaunch(_expert_cast_kernel, num_warps=4)
    _launch_transpose = TritonLaunch(_transpose_kernel, num_warps=_TRANSPOSE_WARPS)
    _launch_amax = TritonLaunch(_amax_kernel, num_warps=_AMAX_WARPS)
    _launch_scale_update = TritonLaunch(_scale_update_kernel, num_warps=4)
    _launch_rows_table = TritonLaunch(_rows_table_kernel, num_warps=4)
