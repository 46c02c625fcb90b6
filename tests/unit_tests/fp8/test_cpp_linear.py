"""The FP8 linear layers' C++ path (`cpp_linear.py`, `csrc/fp8_linear.cu`) against their Python
path on the GPU, bit for bit: the cast (bytes, scale inverse, transposed copy, recorded amax)
against the plain-torch reference quantiser for each input dtype, format and scaling, at odd
shapes, and against the Triton cast with NaN, inf and an unaligned input; and a linear layer's
output, input, weight (returned, written over or added into a main_grad) and bias gradients and
delayed-scaling records, for each format and recipe. Off CUDA the Python path runs."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from megatron.core.fp8 import cpp_linear, kernels, quantize
from megatron.core.fp8 import linear as fp8_linear
from megatron.core.tensor_parallel.grad_accumulation import (
    FusionTarget,
    linear,
    register_main_grad,
)
from tests.unit_tests.fp8.test_kernels import FORMATS, _bytes, _input
from tests.unit_tests.fp8.test_linear import _slots

SHAPES = [(1, 16), (17, 48), (100, 4096), (64, 130), (4096, 1408)]


@pytest.fixture(scope="module")
def native():
    module = cpp_linear.native_linear(torch.zeros(1, 16, device="cuda"))
    assert module is not None, "the C++ extension did not build on this GPU machine"
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_cast_is_the_reference_bit_for_bit(native, fmt, shape, source, delayed):
    dtype = FORMATS[fmt]
    x = _input(shape, source, seed=shape[0] * shape[1] + 1)
    # A delayed scale and amax record are views into a state's vectors (0-d, offset).
    scale = torch.tensor([1.0, 3.7], device="cuda")[1] if delayed else None
    amax_native = torch.tensor([0.0, 0.5], device="cuda")[1]
    amax_reference = amax_native.clone()
    data, scale_inv, transposed = native.cast(x, scale, amax_native, dtype == FORMATS["e4m3"])
    expected = quantize._quantize_reference(x, dtype, scale, amax_reference, transpose=True)
    assert data.dtype == transposed.dtype == dtype
    assert torch.equal(_bytes(data), _bytes(expected.data))
    assert torch.equal(scale_inv, expected.scale_inv)
    assert torch.equal(_bytes(transposed), _bytes(expected.transposed))
    assert torch.equal(amax_native, amax_reference)


@pytest.mark.gpu
def test_cast_of_unaligned_and_special_values(native):
    """An input starting one element into its storage (scalar loads), NaN, inf and values past
    the format's maximum."""
    whole = _input((33, 65), torch.bfloat16, seed=7)
    whole[3, 5], whole[4, 6], whole[5, 7], whole[6, 8] = float("nan"), float("inf"), -1e30, 1e30
    x = whole.view(-1)[1 : 1 + 33 * 64].view(33, 64)
    scale = torch.tensor(2.0, device="cuda")
    amax_native, amax_triton = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    data, scale_inv, transposed = native.cast(x, scale, amax_native, False)
    expected = kernels.cast_to_fp8(x, torch.float8_e5m2, scale, amax_triton, transpose=True)
    assert torch.equal(_bytes(data), _bytes(expected[0]))
    assert torch.equal(_bytes(transposed), _bytes(expected[2]))
    assert torch.equal(amax_native, amax_triton)
    assert torch.isinf(amax_native)


class _Engine:
    """Stands for a data-parallel engine that keeps fp32 main gradients."""

    def __init__(self, weight: torch.nn.Parameter, overwrite: bool):
        self.main_grad = torch.full(weight.shape, 0.5, device="cuda")
        self.overwrite = overwrite

    def main_grad_of(self, param: torch.nn.Parameter) -> FusionTarget:
        return FusionTarget(self.main_grad, self.overwrite)


def _run(fmt: str, kind: str, bias: bool, fused: bool | None, python: bool) -> dict:
    """A forward and backward of a [96, 256] bf16 layer on [2, 50, 256] tokens (100: not a
    multiple of 16); `fused`: the weight gradient written over (True) or added into (False) a
    main_grad; `python`: with the C++ path off."""
    generator = torch.Generator(device="cuda").manual_seed(11)
    weight = torch.nn.Parameter(torch.randn(96, 256, device="cuda", generator=generator).bfloat16())
    bias_ = torch.randn(96, device="cuda", generator=generator).bfloat16()
    bias_ = torch.nn.Parameter(bias_) if bias else None
    x = torch.randn(2, 50, 256, device="cuda", generator=generator).bfloat16().requires_grad_()
    grad = (torch.randn(2, 50, 96, device="cuda", generator=generator) * 1e-3).bfloat16()
    engine = None
    if fused is not None:
        engine = _Engine(weight, fused)
        register_main_grad(weight, engine.main_grad_of)
    slots = _slots(fmt, kind)
    python_path = mock.patch.object(fp8_linear, "native_linear", lambda x: None)
    with python_path if python else contextlib.nullcontext():
        y = linear(x, weight, bias_, slots)
        y.backward(grad)
    return dict(
        y=y,
        dx=x.grad,
        dw=weight.grad if engine is None else engine.main_grad,
        db=None if bias_ is None else bias_.grad,
        state=None if slots.state is None else slots.state.scaling_tensors(),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("fused", [None, True, False], ids=["returned", "written", "added"])
def test_layer_equals_the_python_path(native, fmt, kind, bias, fused):
    native_run = _run(fmt, kind, bias, fused, python=False)
    python_run = _run(fmt, kind, bias, fused, python=True)
    for key in ("y", "dx", "dw", "db"):
        if python_run[key] is None:
            assert native_run[key] is None
        else:
            assert torch.equal(native_run[key], python_run[key]), key
    if kind == "delayed":
        for name, value in python_run["state"].items():
            assert torch.equal(native_run["state"][name], value), name


@pytest.mark.gpu
def test_the_layer_takes_the_native_path(native):
    """A layer on the GPU calls the extension once forward and once backward."""
    calls = []

    class _Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(native, name)

    with mock.patch.object(fp8_linear, "native_linear", lambda x: _Spy()):
        _run("hybrid", "delayed", True, None, python=False)
    assert calls == ["linear_forward", "linear_backward"]


def test_no_native_path_off_cuda():
    assert cpp_linear.native_linear(torch.zeros(4, 16)) is None
