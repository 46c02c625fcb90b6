"""The fused rotary embedding as one C++ autograd node with its CUDA kernel (`csrc/rope.cpp`,
`csrc/rope_kernels.cu`), built at its first use.

`fused_rope.fused_rotary_pos_emb` rotates a layer's queries and keys in one kernel each way; from
Python that costs the host an autograd function, its argument handling and Triton's launcher per
layer and direction, inside a step about as much as the PyTorch operators it replaces. The
extension's node does it from C++: the Triton kernel's arithmetic (in fp32, one rounding), its
multiply-add order fixed, so its results and the Triton kernel's may differ in the last place.

It is built the first time the rotation runs on a GPU (`megatron.core.native_extension`: a C++
compiler, ninja and the CUDA toolkit's nvcc). Where it cannot be built the Triton kernel runs,
said once in a warning. `MEGATRON_ROPE_CPP=0` keeps the Triton kernel.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType

import torch

from megatron.core.native_extension import NativeExtension

ENV_SWITCH = "MEGATRON_ROPE_CPP"
"""Set to 0 to rotate with the Triton kernel from Python."""

_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")

_extension = NativeExtension(
    "megatron_rope",
    [os.path.join(_SOURCE_DIR, name) for name in ("rope.cpp", "rope_kernels.cu")],
    ENV_SWITCH,
    "fused rotary embeddings",
)


def native_rope(query: torch.Tensor) -> ModuleType | None:
    """The built extension where it rotates `query` (a CUDA tensor) and its keys, else None:
    the caller launches the Triton kernel. Called at every layer's rotation: an attribute
    read."""
    return _extension.module() if query.is_cuda else None


def triton_kernel() -> contextlib.AbstractContextManager:
    """The rotations whose forward runs inside it run the Triton kernel from Python (their
    backward too): the two side by side in one process."""
    return _extension.suspended()
