"""`Fp8Tensor`: FP8 bytes with the scale that dequantises them; `BlockFp8Tensor`: FP8 bytes with
one scale per block.

Plain tuples, not tensor subclasses: every consumer is this package's own code (the GEMMs and the
linear layers), and a subclass would have to be taught autograd, FSDP's views and
`torch.compile`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Fp8Tensor(NamedTuple):
    """A tensor quantised to FP8 with one scale (per-tensor recipes).

    The high-precision value is `data.float() * scale_inv`; the quantiser computed
    `data = fp8(clamp(x * scale))` with `scale_inv = 1 / scale`.

    Attributes:
        data: the FP8 values, `[rows, cols]` row-major (or a view of them: a transposed view
            is a column-major operand of a GEMM).
        scale_inv: fp32, one element: the dequantisation multiplier.
        transposed: the same values transposed, `[cols, rows16]` row-major, `rows16` the rows
            rounded up to a multiple of 16 with zero columns beyond `rows` (the operand a
            GEMM contracting over the rows needs on Hopper); None when not made.
        transposed_scale_inv: the multiplier of `transposed`; None: `scale_inv` (per-tensor
            scales are the same whichever way the bytes lie).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    transposed: torch.Tensor | None = None
    transposed_scale_inv: torch.Tensor | None = None

    def t(self) -> Fp8Tensor:
        """The transposed view of `data` (no copy), with the same scale."""
        return Fp8Tensor(self.data.t(), self.scale_inv)

    def transposed_operand(self) -> Fp8Tensor:
        """`transposed` as a tensor of its own (its scale and no further copy).

        Raises:
            ValueError: no transposed copy was made.
        """
        if self.transposed is None:
            raise ValueError("this Fp8Tensor has no transposed copy; quantise with transpose=True.")
        scale_inv = self.transposed_scale_inv
        return Fp8Tensor(self.transposed, self.scale_inv if scale_inv is None else scale_inv)

    def dequantize(self) -> torch.Tensor:
        """The values in fp32: `data * scale_inv`."""
        return self.data.float() * self.scale_inv


class BlockFp8Tensor(NamedTuple):
    """A tensor quantised to FP8 with one scale per block (the blockwise recipe,
    `megatron.core.fp8.blockwise`).

    `scale_inv[i, j]` dequantises the block of `data` at rows `i * block[0]` onward and columns
    `j * block[1]` onward; blocks at the ends may be partial (the quantiser scaled them as if
    zero-padded). The strides of `scale_inv` are those the blockwise GEMM takes, so that it
    needs no copy (`blockwise.py` says which).

    Attributes:
        data: the FP8 values, `[rows, cols]`, row-major, or the transposed view of row-major
            values (the column-major second operand of a GEMM).
        scale_inv: fp32, `[ceil(rows / block[0]), ceil(cols / block[1])]`: the dequantisation
            multipliers.
        block: `(1, 128)`, `(128, 128)`, or `(128, 1)` for the transposed view of a
            `(1, 128)` tensor.
        transposed: the same tensor transposed and quantised again from the high-precision
            values, `[cols, rows128]` row-major with `(1, 128)` blocks, `rows128` the rows
            rounded up to a multiple of 128 with zero columns beyond `rows` (the operand of a
            GEMM contracting over the rows); None when not made.
        transposed_scale_inv: the block multipliers of `transposed`; None when not made.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    transposed: torch.Tensor | None = None
    transposed_scale_inv: torch.Tensor | None = None

    def t(self) -> BlockFp8Tensor:
        """The transposed view of `data` and of its blocks (no copy)."""
        return BlockFp8Tensor(self.data.t(), self.scale_inv.t(), (self.block[1], self.block[0]))

    def transposed_operand(self) -> BlockFp8Tensor:
        """`transposed` as a tensor of its own, with its `(1, 128)` blocks.

        Raises:
            ValueError: no transposed copy was made.
        """
        if self.transposed is None:
            raise ValueError(
                "this BlockFp8Tensor has no transposed copy; quantise with transpose=True."
            )
        return BlockFp8Tensor(self.transposed, self.transposed_scale_inv, (1, 128))

    def dequantize(self) -> torch.Tensor:
        """The values in fp32: each block of `data` times its multiplier."""
        rows, cols = self.data.shape
        scale = self.scale_inv.repeat_interleave(self.block[0], dim=0)[:rows]
        scale = scale.repeat_interleave(self.block[1], dim=1)[:, :cols]
        return self.data.float() * scale
