"""The FP8 linear layers in C++ (`csrc/`), built at its first use.

An FP8 linear layer's forward casts its input and runs its GEMM; its backward casts the output
gradient, runs two GEMMs and sums the bias gradient. Called from Python, each of those costs the
host tens of microseconds (argument handling, allocations, a Triton launch, the `Fp8Tensor`
bookkeeping, and `torch._scaled_mm`'s descriptor set-up and algorithm query at every call), and
a Python autograd function as much again, which bounds the eager step of a model of small
layers. The extension makes the layer one C++ autograd node: the same casts (CUDA kernels with
the Triton kernels' arithmetic, `csrc/fp8_kernels.cu`) and the cuBLASLt GEMMs
`torch._scaled_mm` runs, with their set-up cached per problem (`csrc/fp8_gemm.cpp`): the tests
find the results the same bit for bit. Its backward asks Python once, for where the weight
gradient goes and for the FP8 weight's transpose (`linear.native_backward_inputs`). The
extension also transposes the FP8 weights, those of a group in one call (`transpose_all`).

It is built the first time an FP8 linear layer runs on a GPU (`megatron.core.native_extension`:
nvcc and ninja, linked against the cuBLASLt library torch loaded). Where it cannot be built the
layers run the Python path, said once in a warning. `MEGATRON_FP8_CPP=0` keeps the Python path.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType

import torch

from megatron.core.native_extension import NativeExtension, cublaslt_library

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ENV_SWITCH = "MEGATRON_FP8_CPP"
"""Set to 0 to run the FP8 linear layers' Python path on GPUs too."""

_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = ("fp8_linear.cpp", "fp8_gemm.cpp", "fp8_kernels.cu")


def _set_callback(module: ModuleType) -> None:
    # Imported here: `linear` imports this module.
    from megatron.core.fp8.linear import native_backward_inputs

    module.set_backward_callback(native_backward_inputs)


_extension = NativeExtension(
    "megatron_fp8_linear",
    [os.path.join(_SOURCE_DIR, name) for name in _SOURCES],
    ENV_SWITCH,
    "FP8 linear layers",
    extra_ldflags=cublaslt_library,
    setup=_set_callback,
)


def native_linear(x: torch.Tensor) -> ModuleType | None:
    """The built extension where it runs a layer whose input is `x` (a bf16, fp16 or fp32 CUDA
    tensor, outside `torch.compile` tracing), else None: the caller runs the Python path.
    Called at every forward of every FP8 layer: a few attribute reads."""
    if not x.is_cuda or x.dtype not in _INPUT_DTYPES or torch.compiler.is_compiling():
        return None
    return _extension.module()


def native_transpose(data: torch.Tensor) -> ModuleType | None:
    """The built extension where it transposes `data` (2-D FP8 bytes on CUDA, outside
    `torch.compile` tracing), else None."""
    if not data.is_cuda or data.element_size() != 1 or torch.compiler.is_compiling():
        return None
    return _extension.module()


def python_function() -> contextlib.AbstractContextManager:
    """The FP8 linear layers whose forward runs inside it run their Python autograd function
    (their backward too): the two side by side in one process, as
    `tools/benchmark_native_host.py` times them."""
    return _extension.suspended()
