"""The tables of a Triton launch over many tensors at once: which tensor and which chunk of it
each program takes, and which tensors such a launch can address.

A multi-tensor kernel (`fused_adam`'s step, `megatron.core.fp8.multi_tensor_cast`'s casts) reads
each tensor's addresses from a row of a table on the device and splits every tensor into chunks
of a fixed number of elements, one program per chunk: a tensor's chunks are programs in a row.
"""

from __future__ import annotations

import torch

ELEMENTWISE_BLOCK = 1024
"""Elements a program of an elementwise multi-tensor kernel (a cast, a copy) reads per
iteration: eight per thread of `ELEMENTWISE_WARPS` warps."""

ELEMENTWISE_BLOCKS = 4
"""Iterations per program of such a kernel, amortising the loads of its tensor's row of the
table."""

ELEMENTWISE_PROGRAM_ELEMENTS = ELEMENTWISE_BLOCK * ELEMENTWISE_BLOCKS
"""Elements each program of such a kernel takes: the chunk size of its `program_table`."""

ELEMENTWISE_WARPS = 4
"""Warps per program of such a kernel."""


def program_table(numels: torch.Tensor, elements_per_program: int) -> torch.Tensor:
    """Each program's (tensor index, chunk index) for tensors of `numels` elements (1-D,
    int64), in chunks of `elements_per_program`: int32 `[programs, 2]` on the host. An empty
    tensor gets no program."""
    chunks = (numels + elements_per_program - 1) // elements_per_program
    tensor_of = torch.repeat_interleave(torch.arange(len(numels)), chunks)
    first = torch.cumsum(chunks, 0) - chunks
    chunk_of = torch.arange(len(tensor_of)) - first[tensor_of]
    return torch.stack([tensor_of, chunk_of], dim=1).to(torch.int32)


def aligned(address: int, numel: int) -> bool:
    """`numel` elements at `address` start on a 16-byte boundary of real memory. A DTensor, with
    no storage of its own, reports address 0, which a kernel must not be handed; an empty
    tensor reports 0 too, but gets no programs, so its address is never read."""
    return numel == 0 or (address != 0 and address % 16 == 0)
