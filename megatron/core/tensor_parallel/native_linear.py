"""Gradient-accumulation fusion's linear layer as one C++ autograd node (`csrc/`), built at its
first use.

`grad_accumulation.linear` runs a linear layer whose weight gradient fuses into an engine's
`main_grad` as an autograd function; written in Python, its forward and backward cost the host
tens of microseconds more per layer than `F.linear`'s C++ node, which bounds the eager steps of
models of small layers (`--no-gradient-accumulation-fusion` was faster there). The extension's
node runs the same operators from C++ (the results are the same bit for bit) and calls Python
once per backward, to ask where the weight gradient goes (`grad_accumulation.native_target`).

It runs on CUDA tensors, built the first time such a layer runs on a GPU
(`megatron.core.native_extension`: a C++ compiler and ninja). Where it cannot be built the layers
run the Python function, said once in a warning. `MEGATRON_LINEAR_CPP=0` keeps the Python
function.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType

import torch

from megatron.core.native_extension import NativeExtension, cublaslt_library

ENV_SWITCH = "MEGATRON_LINEAR_CPP"
"""Set to 0 to run the fusing linear layers' Python autograd function on GPUs too."""


def _set_callback(module: ModuleType) -> None:
    # Imported here: `grad_accumulation` imports this module.
    from megatron.core.tensor_parallel.grad_accumulation import native_target

    module.set_target_callback(native_target)


_extension = NativeExtension(
    "megatron_linear_into_main_grad",
    [os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "linear_into_main_grad.cpp")],
    ENV_SWITCH,
    "gradient-accumulation fusion's linear layers",
    extra_ldflags=cublaslt_library,
    setup=_set_callback,
)


def native_linear_into_main_grad(input_: torch.Tensor) -> ModuleType | None:
    """The built extension where it runs the fusing linear layer of `input_` (a CUDA tensor),
    else None: the caller runs the Python function. Called at every forward of every fusing
    layer: a few attribute reads."""
    return _extension.module() if input_.is_cuda else None


def python_function() -> contextlib.AbstractContextManager:
    """The fusing linear layers whose forward runs inside it run their Python autograd function
    (their backward too): the two side by side in one process, as
    `tools/benchmark_native_host.py` times them."""
    return _extension.suspended()
