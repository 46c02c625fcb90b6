"""`SegmentCopy`'s launch from C++ (`csrc/segment_copy.cpp`, `csrc/segment_copy_kernels.cu`),
built at its first use.

Megatron-FSDP casts each unit's shard of the main weights into the unsharded buffer with one
`SegmentCopy` launch per gather, twice per unit and step under ZeRO-3. Through Triton's launcher
each launch costs the host the derivation of its arguments' specialisations and their packing;
the extension checks the tensors and launches its CUDA kernel (the same layout of programs, each
element converted as `copy_` converts it) in one C++ call.

It is built the first time a segment copy runs on a GPU (`megatron.core.native_extension`: a
C++ compiler, ninja and the CUDA toolkit's nvcc). Where it cannot be built the Triton kernel
runs, said once in a warning. `MEGATRON_SEGMENT_COPY_CPP=0` keeps the Triton kernel.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType

from megatron.core.native_extension import NativeExtension

ENV_SWITCH = "MEGATRON_SEGMENT_COPY_CPP"
"""Set to 0 to launch the segment copies' Triton kernel from Python."""

_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")

_extension = NativeExtension(
    "megatron_segment_copy",
    [os.path.join(_SOURCE_DIR, name) for name in ("segment_copy.cpp", "segment_copy_kernels.cu")],
    ENV_SWITCH,
    "segment copies (Megatron-FSDP's gather casts)",
)


def native_segment_copy() -> ModuleType | None:
    """The built extension, else None: the caller launches the Triton kernel. Called at every
    copy (the caller has checked that the tensors are on the current CUDA device): an attribute
    read."""
    return _extension.module()


def triton_kernel() -> contextlib.AbstractContextManager:
    """The segment copies run inside it launch the Triton kernel: the two side by side in one
    process."""
    return _extension.suspended()
