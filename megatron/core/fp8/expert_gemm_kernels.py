"""The MoE experts' grouped FP8 GEMMs: one Triton launch for all the experts of a projection.

One `torch._scaled_mm` per expert costs the host about 40 us a GEMM: for 64 experts, 192 GEMM
launches per projection and microbatch, which bound a DeepSeek-V3-shaped model's FP8 step to the
host. PyTorch's grouped kernel (`torch._scaled_grouped_mm`, `megatron.core.fp8.grouped_gemm`)
multiplies E4M3 operands into bf16 only, so it cannot take `hybrid`'s E5M2 output gradients or a
weight gradient accumulated into an fp32 `main_grad`. The two kernels here take any FP8 operands
(E4M3 or E5M2, mixed) and write bf16, fp16 or fp32:

- `grouped_mm`: `[P, K] x [G, K, N] -> [P, N]`, the rows grouped by expert (the forward and
  the input gradient);
- `grouped_wgrad_into`: `[N, P] x [P, K]`, summed over each expert's rows, into (or added to)
  `[G, N, K]` (the weight gradient, into a `main_grad`).

The operands are those of PyTorch's grouped kernel (`ExpertRows`' padded layout, each expert's
rows a multiple of 16 with zero rows between; the first operand row-major, the second
column-major), each expert's product dequantised by its two multipliers (`scale_inv`s) as
`torch._scaled_mm` does, accumulated in fp32. The products are those of one `torch._scaled_mm`
per expert up to the order and precision of the sums: Hopper's FP8 tensor cores add in reduced
precision, and like cuBLAS without fast accumulation (and DeepSeek-V3's recipe) the backward
GEMMs promote their partial sums into fp32 every `block_k` products (`MM_TILES`,
`WGRAD_TILES`); the forward GEMM may sum in the tensor cores throughout (`fast_accum`).

Each program computes one tile of one expert's product: it finds the expert by a binary search
in `ExpertRows`' table (the forward-shaped GEMM, whose tiles of rows are per expert), or from
its program index (the weight gradient, `G` equal products), so a launch costs the host the same
for any number of experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron.core.fusions.triton_launch import TritonLaunch, launches_on_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds
    triton = None


class Tiles(NamedTuple):
    """A kernel's tile (`block_k` is also the promotion interval: each tile's `tl.dot` sums
    that many products in the tensor cores' precision before they join the fp32 accumulator)
    and launch options."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


MM_TILES = Tiles(128, 128, 128, warps=4, stages=3)
WGRAD_TILES = Tiles(128, 128, 64, warps=4, stages=4)
"""The fastest on an H200 (torch 2.11's Triton) among tiles of 64 to 256 rows and columns, 32 to
128 deep, with 4 or 8 warps and 2 to 4 stages, for the two projections of 64 experts of a
DeepSeek-V3 shape (hidden 2048, expert FFN 1408, 4096 tokens routed to 6 experts each)."""
TILE_ROWS = MM_TILES.block_m
"""The rows of an expert that one program of `grouped_mm` multiplies (`ExpertRows.gemm_tiles`
counts each expert's tiles of this height)."""

_CAPABLE: dict[int, bool] = {}
"""Device index -> compute capability 9.0 or later."""
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernels_available(device: torch.device) -> bool:
    """Whether the kernels run on `device`: Triton, the current CUDA device of an NVIDIA GPU
    with FP8 tensor cores that Triton multiplies in (compute capability 9.0 and later), no
    `torch.compile` tracing."""
    # ROCm's FP8 formats are others (e4m3fnuz).
    if not launches_on_device(device) or torch.version.hip is not None:
        return False
    current = torch.cuda.current_device()
    if current not in _CAPABLE:
        _CAPABLE[current] = torch.cuda.get_device_capability(current) >= (9, 0)
    return _CAPABLE[current]


def grouped_mm(
    a: torch.Tensor,
    a_scale_invs: torch.Tensor,
    b: torch.Tensor,
    b_scale_invs: torch.Tensor,
    table: torch.Tensor,
    tiles: int,
    *,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    real_rows: int | None = None,
) -> torch.Tensor:
    """`a_e @ b_e * a_scale_invs[e] * b_scale_invs[e]` for each expert e.

    Args:
        a: `[P, K]` FP8, row-major, each expert's rows padded (zero rows between experts).
        a_scale_invs: `[G]` fp32 (any stride), a multiplier per expert's rows of `a`.
        b: `[G, K, N]` FP8, column-major in its last two dimensions.
        b_scale_invs: `[G]` fp32 (any stride), a multiplier per expert of `b`.
        table: int32 on `a`'s device, `ExpertRows`' (`gemm_table`): each expert's first row
            and rows at `[0, 2G)` (unpadded), its first tile of 16 padded rows at `[2G, 3G)`,
            its padded rows at `[4G, 5G)`, its first tile of `TILE_ROWS` rows at `[5G, 6G)`.
        tiles: the tiles of `TILE_ROWS` rows of all experts (`ExpertRows.gemm_tiles`), or more
            (`DeviceExpertRows`' upper bound: the programs past the real tiles exit).
        out_dtype: bf16, fp16 or fp32.
        fast_accum: sum in the tensor cores' precision throughout (Hopper's fast FP8
            accumulation, as the forward GEMMs use), rather than promoting the partial sums
            every `MM_TILES.block_k` products.
        real_rows: the experts' rows without padding, `M` (`ExpertRows.rows`): the product
            is written without the padding rows, each expert's rows back to back (as
            `ExpertRows.unpad` leaves them), rather than in `a`'s layout.

    Returns:
        `[P, N]` of `out_dtype` (the rows of padding give zero rows), or `[M, N]` where
        `real_rows` is given.
    """
    groups, k, n = b.shape
    _check_operands(a, b, out_dtype, table, groups)
    if a.shape[1] != k or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(
            f"grouped_mm: a {list(a.shape)} (row-major) and b {list(b.shape)} (column-major) "
            "must share the contraction dimension."
        )
    out_rows = a.shape[0] if real_rows is None else real_rows
    out = torch.empty(out_rows, n, dtype=out_dtype, device=a.device)
    if tiles == 0 or n == 0:
        return out
    col_tiles = -(-n // MM_TILES.block_n)
    _launch_grouped_mm(
        (tiles * col_tiles,),
        a,
        a_scale_invs,
        a_scale_invs.stride(0),
        b,
        b.stride(0),
        b.stride(2),
        b_scale_invs,
        b_scale_invs.stride(0),
        out,
        table,
        groups,
        a.stride(0),
        k,
        n,
        col_tiles,
        PROMOTE=not fast_accum,
        UNPAD=real_rows is not None,
        SEARCH_STEPS=max(groups - 1, 1).bit_length(),
        BLOCK_M=TILE_ROWS,
        BLOCK_N=MM_TILES.block_n,
        BLOCK_K=MM_TILES.block_k,
    )
    return out


def grouped_wgrad_into(
    out: torch.Tensor,
    a: torch.Tensor,
    a_scale_invs: torch.Tensor,
    b: torch.Tensor,
    b_scale_invs: torch.Tensor,
    table: torch.Tensor,
    *,
    accumulate: bool,
) -> None:
    """`out[e] = a[:, rows of e] @ b[rows of e, :] * a_scale_invs[e] * b_scale_invs[e]` for
    each expert e (`+=` where `accumulate`; an expert without rows gets zeros, or keeps its
    gradient).

    Args:
        out: `[G, N, K]` bf16, fp16 or fp32, any strides (a `main_grad`).
        a: `[N, P]` FP8, row-major (the output gradient transposed, padded per expert).
        a_scale_invs: `[G]` fp32 (any stride).
        b: `[P, K]` FP8, column-major (the transposed view of the input's padded transpose).
        b_scale_invs: `[G]` fp32 (any stride).
        table: int32 on `a`'s device, `ExpertRows`' (`gemm_table`).
        accumulate: add to `out` rather than write over it.
    """
    groups, n, k = out.shape
    _check_operands(a, b, out.dtype, table, groups)
    if a.shape[0] != n or b.shape[1] != k or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"grouped_wgrad_into: a {list(a.shape)} times b {list(b.shape)} does not make the "
            f"experts' [{n}, {k}] gradients of out {list(out.shape)}."
        )
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError("grouped_wgrad_into: a must be row-major and b column-major.")
    if groups == 0 or n == 0 or k == 0:
        return
    tiles = WGRAD_TILES
    row_tiles, col_tiles = -(-n // tiles.block_m), -(-k // tiles.block_n)
    _launch_grouped_wgrad(
        (groups * row_tiles * col_tiles,),
        a,
        a_scale_invs,
        a_scale_invs.stride(0),
        b,
        b.stride(1),
        b_scale_invs,
        b_scale_invs.stride(0),
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        table,
        groups,
        a.stride(0),
        n,
        k,
        row_tiles,
        col_tiles,
        ACCUMULATE=accumulate,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
    )


def _check_operands(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, table: torch.Tensor, groups: int
) -> None:
    if table.numel() != 6 * groups:
        raise ValueError(
            f"the grouped FP8 GEMM's table has {table.numel()} entries for {groups} experts; "
            "give ExpertRows.gemm_table of the experts' rows."
        )
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        raise ValueError(f"the grouped FP8 GEMM takes FP8 operands, got {a.dtype} and {b.dtype}.")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"the grouped FP8 GEMM writes bf16, fp16 or fp32, not {out_dtype}.")


if triton is not None:
    from megatron.core.fp8.kernels import expert_of_tile, tiles_end

    @triton.jit
    def _grouped_mm_kernel(
        a_ptr,
        a_scale_ptr,
        a_scale_stride,
        b_ptr,
        b_group_stride,
        b_col_stride,
        b_scale_ptr,
        b_scale_stride,
        out_ptr,
        table_ptr,
        groups,
        a_row_stride,
        k,
        n,
        col_tiles,
        PROMOTE: tl.constexpr,
        UNPAD: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # The column tiles of one tile of rows run one after the other: its rows are read from
        # L2 by all but the first.
        tile = tl.program_id(0) // col_tiles
        tile_starts = table_ptr + 5 * groups
        if tile >= tiles_end(tile_starts, table_ptr + 4 * groups, groups, BLOCK_M):
            return
        expert = expert_of_tile(tile_starts, groups, tile, SEARCH_STEPS)
        first_row = tl.load(table_ptr + 2 * groups + expert).to(tl.int64) * 16
        expert_rows = tl.load(table_ptr + 4 * groups + expert)
        local = (tile - tl.load(tile_starts + expert)) * BLOCK_M + tl.arange(0, BLOCK_M)
        row = first_row + local
        row_inside = local < expert_rows
        col = (tl.program_id(0) % col_tiles).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_inside = col < n
        b_base = b_ptr + expert.to(tl.int64) * b_group_stride
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            depth = start + tl.arange(0, BLOCK_K)
            depth_inside = depth < k
            a = tl.load(
                a_ptr + row[:, None] * a_row_stride + depth[None, :],
                mask=row_inside[:, None] & depth_inside[None, :],
                other=0.0,
            )
            b = tl.load(
                b_base + depth[:, None] + col[None, :] * b_col_stride,
                mask=depth_inside[:, None] & col_inside[None, :],
                other=0.0,
            )
            if PROMOTE:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b, acc)
        acc = acc * (
            tl.load(a_scale_ptr + expert * a_scale_stride)
            * tl.load(b_scale_ptr + expert * b_scale_stride)
        )
        if UNPAD:  # the expert's real rows only, from its first unpadded row
            row = tl.load(table_ptr + expert).to(tl.int64) + local
            row_inside = local < tl.load(table_ptr + groups + expert)
        tl.store(
            out_ptr + row[:, None] * n + col[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_inside[:, None] & col_inside[None, :],
        )

    @triton.jit
    def _grouped_wgrad_kernel(
        a_ptr,
        a_scale_ptr,
        a_scale_stride,
        b_ptr,
        b_col_stride,
        b_scale_ptr,
        b_scale_stride,
        out_ptr,
        out_group_stride,
        out_row_stride,
        out_col_stride,
        table_ptr,
        groups,
        a_row_stride,
        n,
        k,
        row_tiles,
        col_tiles,
        ACCUMULATE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # One expert's tiles one after the other, a row of tiles at a time: its operands are
        # read from L2 by all but the first.
        expert_tiles = row_tiles * col_tiles
        expert = tl.program_id(0) // expert_tiles
        tile = tl.program_id(0) % expert_tiles
        row = (tile // col_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        col = (tile % col_tiles).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_inside, col_inside = row < n, col < k
        first = tl.load(table_ptr + 2 * groups + expert).to(tl.int64) * 16
        # A multiple of 16, said so: the mask `depth < end` is then the same for each 16 bytes
        # of a row, and the loads move 16 bytes at a time (masked byte by byte, the kernel
        # took 2.5 times as long).
        end = first + tl.multiple_of(tl.load(table_ptr + 4 * groups + expert), 16)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(first, end, BLOCK_K):
            depth = start + tl.arange(0, BLOCK_K)
            depth_inside = depth < end
            a = tl.load(
                a_ptr + row[:, None] * a_row_stride + depth[None, :],
                mask=row_inside[:, None] & depth_inside[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + depth[:, None] + col[None, :] * b_col_stride,
                mask=depth_inside[:, None] & col_inside[None, :],
                other=0.0,
            )
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        acc = acc * (
            tl.load(a_scale_ptr + expert * a_scale_stride)
            * tl.load(b_scale_ptr + expert * b_scale_stride)
        )
        out = (
            out_ptr
            + expert.to(tl.int64) * out_group_stride
            + row[:, None] * out_row_stride
            + col[None, :] * out_col_stride
        )
        inside = row_inside[:, None] & col_inside[None, :]
        if ACCUMULATE:
            # An expert without rows keeps its gradient as it is (even a -0.0): no row is its.
            inside = (row[:, None] < tl.where(end > first, n, 0)) & col_inside[None, :]
            acc += tl.load(out, mask=inside, other=0.0).to(tl.float32)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=inside)

    _launch_grouped_mm = TritonLaunch(
        _grouped_mm_kernel, num_warps=MM_TILES.warps, num_stages=MM_TILES.stages
    )
    _launch_grouped_wgrad = TritonLaunch(
        _grouped_wgrad_kernel, num_warps=WGRAD_TILES.warps, num_stages=WGRAD_TILES.stages
    )
