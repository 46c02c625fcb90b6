"""The FP8 linear layers' host path in C++ (`csrc/`), built at its first use.

An FP8 linear layer's forward casts its input and runs its GEMM; its backward casts the output
gradient, runs two GEMMs and sums the bias gradient. Called from Python, each of those costs the
host tens of microseconds (argument handling, allocations, a Triton launch, the `Fp8Tensor`
bookkeeping, and `torch._scaled_mm`'s descriptor set-up and algorithm query at every call),
which bounds the eager step of a model of small layers. The extension makes each pass one call:
the same casts (CUDA kernels with the Triton kernels' arithmetic, `csrc/fp8_kernels.cu`) and the
cuBLASLt GEMMs `torch._scaled_mm` runs, with their set-up cached per problem
(`csrc/fp8_gemm.cpp`): the tests find the results the same bit for bit. It also transposes the
FP8 weights for the input gradient.

It is built with PyTorch's extension builder (`torch.utils.cpp_extension.load`: nvcc and ninja,
linked against the cuBLASLt library torch loaded) the first time an FP8 linear layer runs on a
GPU, which takes about a minute, and cached where PyTorch caches its extensions
(`TORCH_EXTENSIONS_DIR`, by default under `~/.cache`). Where it cannot be built the layers run
the Python path, said once in a warning. `MEGATRON_FP8_CPP=0` keeps the Python path.
"""

from __future__ import annotations

import logging
import os
import warnings
from types import ModuleType

import torch

_logger = logging.getLogger(__name__)

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ENV_SWITCH = "MEGATRON_FP8_CPP"
"""Set to 0 to run the FP8 linear layers' Python path on GPUs too."""

_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = [
    os.path.join(_SOURCE_DIR, name) for name in ("fp8_linear.cpp", "fp8_gemm.cpp", "fp8_kernels.cu")
]
_module: ModuleType | None = None
_tried = False


def native_linear(x: torch.Tensor) -> ModuleType | None:
    """The built extension where it runs the casts and GEMMs of a layer whose flattened input is
    `x` (a bf16, fp16 or fp32 CUDA tensor, outside `torch.compile` tracing), else None: the
    caller runs the Python path. Called at every pass of every FP8 layer: a few attribute
    reads."""
    if not x.is_cuda or x.dtype not in _INPUT_DTYPES or torch.compiler.is_compiling():
        return None
    return _module if _tried else _load()


def native_transpose(data: torch.Tensor) -> ModuleType | None:
    """The built extension where it transposes `data` (2-D FP8 bytes on CUDA, outside
    `torch.compile` tracing), else None."""
    if not data.is_cuda or data.element_size() != 1 or torch.compiler.is_compiling():
        return None
    return _module if _tried else _load()


def _cublaslt_library() -> str:
    """The linker argument for cuBLASLt: the library file this process loaded with torch (the
    same library the extension then calls), else the toolkit's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                # address, permissions, offset, device, inode, then the path (spaces and all)
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith("libcublasLt.so") and os.path.exists(path):
                    return path
    except OSError:  # not Linux
        pass
    return "-lcublasLt"


def _load() -> ModuleType | None:
    """Builds (or loads the cached build of) the extension once per process."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        _logger.info("Loading the FP8 linear layers' C++ extension (built at its first use).")
        # The GPU's architecture in the name: a build cached for another GPU (a shared
        # TORCH_EXTENSIONS_DIR) has no kernels for this one, and PyTorch would reuse it.
        major, minor = torch.cuda.get_device_capability()
        _module = load(
            name=f"megatron_fp8_linear_sm{major}{minor}",
            sources=_SOURCES,
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            extra_ldflags=[_cublaslt_library()],
            verbose=False,
        )
    except Exception as error:  # no nvcc or ninja, a failed build: the Python path runs
        warnings.warn(
            f"FP8 linear layers run their Python path: the C++ extension in {_SOURCE_DIR} was not "
            f"built ({type(error).__name__}: {str(error).strip()[:300]}). Install the CUDA "
            f"toolkit's nvcc and ninja to build it, or set {ENV_SWITCH}=0 to silence this.",
            stacklevel=3,
        )
    return _module
