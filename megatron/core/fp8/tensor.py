"""`Fp8Tensor`: FP8 bytes with the scale that dequantises them.

A plain tuple, not a tensor subclass: every consumer is this package's own code (the GEMMs and the
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
