"""The FP8 linear layers' C++ path (`cpp_linear.py`, `csrc/fp8_linear.cpp`) against their Python
path on the GPU, bit for bit: the cast (bytes, scale inverse, transposed copy, recorded amax)
against the plain-torch reference quantiser for each input dtype, format and scaling, at odd
shapes, and against the Triton cast with NaN, inf and an unaligned input, and its refusals; and a
linear layer's output, input, weight (returned, written over, copied or added into a main_grad)
and bias gradients and delayed-scaling records, for each format and recipe, each input dtype,
and the weight gradient in high precision. Off CUDA the Python path runs."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from megatron.core.fp8 import cpp_linear, kernels, quantize
from megatron.core.fp8 import linear as fp8_linear
from megatron.core.fp8.weights import Fp8Weight, fp8_weight_of
from megatron.core.tensor_parallel.grad_accumulation import (
    FusionTarget,
    linear,
    register_main_grad,
)
from tests.unit_tests.fp8.test_kernels import FORMATS, _bytes, _input
from tests.unit_tests.fp8.test_linear import _Engine, _slots
from tests.unit_tests.tensor_parallel.test_native_linear import assert_within_a_rounding

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
@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_of_unaligned_and_special_values(native, fmt):
    """An input starting one element into its storage (scalar loads), NaN, inf and values past
    the format's maximum."""
    dtype = FORMATS[fmt]
    whole = _input((33, 65), torch.bfloat16, seed=7)
    whole[3, 5], whole[4, 6], whole[5, 7], whole[6, 8] = float("nan"), float("inf"), -1e30, 1e30
    x = whole.view(-1)[1 : 1 + 33 * 64].view(33, 64)
    scale = torch.tensor(2.0, device="cuda")
    amax_native, amax_triton = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    data, scale_inv, transposed = native.cast(x, scale, amax_native, dtype == FORMATS["e4m3"])
    expected = kernels.cast_to_fp8(x, dtype, scale, amax_triton, transpose=True)
    assert torch.equal(_bytes(data), _bytes(expected[0]))
    assert torch.equal(_bytes(transposed), _bytes(expected[2]))
    assert torch.equal(amax_native, amax_triton)
    assert torch.isinf(amax_native)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [*SHAPES, (33, 65), (130, 7), (144, 272), (16, 4096), (4096, 16)], ids=str
)
def test_transpose_is_torch_transpose(native, shape):
    """Sizes that are multiples of 16 take the 16-byte kernel (whole tiles and partial ones),
    the others the 4-byte one."""
    data = _input(shape, torch.float32, seed=3).to(torch.float8_e4m3fn)
    assert torch.equal(_bytes(native.transpose(data)), _bytes(data.t().contiguous()))
    # A transposed view (not contiguous) transposes back to the original.
    assert torch.equal(_bytes(native.transpose(data.t())), _bytes(data))


@pytest.mark.gpu
def test_transpose_of_bytes_off_a_16_byte_boundary(native):
    """Sizes the 16-byte kernel takes, at an address it does not: the 4-byte kernel's."""
    data = _input((144 * 272 + 4,), torch.float32, seed=5).to(torch.float8_e4m3fn)
    matrix = data[4:].view(144, 272)
    assert matrix.data_ptr() % 16 == 4
    assert torch.equal(_bytes(native.transpose(matrix)), _bytes(matrix.t().contiguous()))


@pytest.mark.gpu
def test_cast_refuses_what_it_cannot_run(native):
    x = torch.ones(4, 16, device="cuda")
    with pytest.raises(RuntimeError, match="bf16, fp16 or fp32 input"):
        native.cast(x.double(), None, None, True)
    with pytest.raises(RuntimeError, match="the scale must be one fp32 element on cuda"):
        native.cast(x, torch.ones(2, device="cuda"), None, True)
    with pytest.raises(RuntimeError, match="the amax record must be one fp32 element on cuda"):
        native.cast(x, None, torch.zeros(()), True)
    with pytest.raises(RuntimeError, match="columns"):
        native.cast(torch.ones(1, 65535 * 128 + 1, device="cuda"), None, None, True)


@pytest.mark.gpu
def test_a_misshapen_weight_is_refused_before_the_amax_is_recorded(native):
    x = torch.ones(2, 8, 32, device="cuda", dtype=torch.bfloat16)
    weight = torch.nn.Parameter(torch.zeros(48, 16, device="cuda"))  # [out, in], in != 32
    one, record = torch.ones((), device="cuda"), torch.zeros((), device="cuda")
    data = weight.detach().to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"an input \[\.\.\., in\], a weight \[out, in\]"):
        native.linear(
            x, weight, None, None, one, record, None, None, data, one, True, False, True, False
        )
    other = torch.zeros(48, 32, device="cuda").to(torch.float8_e4m3fn)  # not the weight's shape
    with pytest.raises(RuntimeError, match="FP8 bytes of the weight's shape"):
        native.linear(
            x, weight, None, None, one, record, None, None, other, one, True, False, True, False
        )
    assert record.item() == 0  # no cast ran


class _FixedTarget:
    """An engine whose main_grad for the weight is the tensor given, whatever it is."""

    def __init__(self, main_grad: torch.Tensor) -> None:
        self.main_grad = main_grad

    def main_grad_of(self, param: torch.nn.Parameter) -> FusionTarget:
        return FusionTarget(self.main_grad, True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "main_grad, error, match",
    [
        (
            torch.zeros(96, 255),
            RuntimeError,
            r"target must be \[96, 256\] on cuda:0, got \[96, 255\]",
        ),
        (torch.zeros(96, 256, dtype=torch.float64), ValueError, "bf16, fp16 or fp32 main_grads"),
    ],
    ids=["misshapen", "float64"],
)
def test_backward_refuses_a_main_grad_it_cannot_write(native, main_grad, error, match):
    """An engine's main_grad of another shape or a dtype the FP8 GEMM does not write is refused
    before the output gradient's cast records its amax."""
    weight = torch.nn.Parameter(torch.randn(96, 256, device="cuda", dtype=torch.bfloat16))
    engine = _FixedTarget(main_grad.cuda())
    register_main_grad(weight, engine.main_grad_of)
    slots = _slots("hybrid", "delayed")
    x = torch.randn(2, 50, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = linear(x, weight, None, slots)
    before = slots.state.scaling_tensors()["amax_history_bwd"].clone()
    with pytest.raises(error, match=match):
        y.sum().backward()
    assert torch.equal(slots.state.scaling_tensors()["amax_history_bwd"], before)


def _run(
    fmt: str,
    kind: str,
    bias: bool,
    fused: bool | None,
    python: bool,
    dtype: torch.dtype = torch.bfloat16,
    contiguous: bool = True,
    wgrad: bool = True,
    rows: int = 50,
    residual: str | None = None,
) -> dict:
    """A forward and backward of a [96, 256] layer on [2, rows, 256] tokens (100 by default: not
    a multiple of 16) in `dtype`; `fused`: the weight gradient written over (True) or added into
    (False) a (`contiguous` or not) main_grad; `wgrad`: the weight gradient's GEMM in FP8;
    `residual`: a residual added to the output, of the output's dtype and layout ("dense"), in
    fp32, or not contiguous ("strided"); `python`: with the C++ path off."""
    generator = torch.Generator(device="cuda").manual_seed(11)
    weight = torch.nn.Parameter(torch.randn(96, 256, device="cuda", generator=generator).to(dtype))
    bias_ = torch.randn(96, device="cuda", generator=generator).to(dtype)
    bias_ = torch.nn.Parameter(bias_) if bias else None
    x = torch.randn(2, rows, 256, device="cuda", generator=generator).to(dtype).requires_grad_()
    grad = (torch.randn(2, rows, 96, device="cuda", generator=generator) * 1e-3).to(dtype)
    skip = None
    if residual is not None:
        skip = torch.randn(rows, 2, 96, device="cuda", generator=generator)
        skip = skip.transpose(0, 1) if residual == "strided" else skip.view(2, rows, 96)
        skip = skip.to(torch.float32 if residual == "fp32" else dtype).requires_grad_()
        grad = grad.to(skip.dtype)
    engine = None
    if fused is not None:
        engine = _Engine(weight, fused, contiguous)
        register_main_grad(weight, engine.main_grad_of)
    slots = _slots(fmt, kind, wgrad=wgrad)
    python_path = mock.patch.object(fp8_linear, "native_linear", lambda x: None)
    with python_path if python else contextlib.nullcontext():
        y = linear(x, weight, bias_, slots, residual=skip)
        y.backward(grad)
    return dict(
        y=y,
        dx=x.grad,
        dw=weight.grad if engine is None else engine.main_grad,
        db=None if bias_ is None else bias_.grad,
        r=skip,
        dr=None if skip is None else skip.grad,
        dy=grad,
        state=None if slots.state is None else slots.state.scaling_tensors(),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("fused", [None, True, False], ids=["returned", "written", "added"])
def test_layer_equals_the_python_path(native, fmt, kind, bias, fused):
    _assert_same_runs(_run(fmt, kind, bias, fused, False), _run(fmt, kind, bias, fused, True))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant",
    [
        dict(dtype=torch.float16),
        dict(dtype=torch.float32),
        dict(fused=True, contiguous=False),
        dict(fused=False, contiguous=False),
        dict(fused=True, wgrad=False),
        dict(fused=False, wgrad=False),
        dict(fused=None, wgrad=False),
        dict(rows=0),
        dict(rows=0, fused=True),
        dict(rows=0, fused=False),
    ],
    ids=[
        "fp16",
        "fp32",
        "copied",
        "added_strided",
        "bf16_wgrad_written",
        "bf16_wgrad_added",
        "bf16_wgrad",
        "no_tokens",
        "no_tokens_written",
        "no_tokens_added",
    ],
)
def test_layer_variants_equal_the_python_path(native, variant):
    """fp16 and fp32 layers, a main_grad the GEMM cannot write, the weight gradient in high
    precision (`--no-fp8-wgrad`), and a batch of no tokens (its weight gradient zero)."""
    run = dict(fmt="hybrid", kind="delayed", bias=True, fused=None) | variant
    _assert_same_runs(_run(**run, python=False), _run(**run, python=True))


def _partial_backward(mode: str, python: bool) -> dict:
    """A [96, 256] layer whose weight gradient an engine would fuse, run forward and then
    through a backward that asks for part of the gradients (`mode`); `python`: with the C++
    path off."""
    generator = torch.Generator(device="cuda").manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(96, 256, device="cuda", generator=generator).bfloat16())
    bias = torch.nn.Parameter(torch.randn(96, device="cuda", generator=generator).bfloat16())
    x = torch.randn(2, 50, 256, device="cuda", generator=generator).bfloat16()
    x.requires_grad_(mode != "input_needs_no_grad")
    weight.requires_grad_(mode != "frozen_weight")
    grad = (torch.randn(2, 50, 96, device="cuda", generator=generator) * 1e-3).bfloat16()
    engine = _Engine(weight, overwrite=True)
    register_main_grad(weight, engine.main_grad_of)
    slots = _slots("hybrid", "delayed")
    with (
        mock.patch.object(fp8_linear, "native_linear", lambda x: None)
        if python
        else (contextlib.nullcontext())
    ):
        y = linear(x, weight, bias, slots)
        if mode == "weight_returned":
            returned = torch.autograd.grad(y, [weight], grad)
        elif mode == "input_only":
            y.backward(grad, inputs=[x])
            returned = ()
        else:
            y.backward(grad)
            returned = ()
    return dict(
        returned=returned,
        dx=x.grad,
        db=bias.grad,
        main_grad=engine.main_grad,
        state=slots.state.scaling_tensors(),
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode", ["weight_returned", "input_only", "frozen_weight", "input_needs_no_grad"]
)
def test_partial_backwards_equal_the_python_path(native, mode):
    """`torch.autograd.grad` of the weight (returned, the engine's main_grad untouched), a
    backward whose inputs leave the weight out, a frozen weight, an input that needs no
    gradient."""
    native_run, python_run = _partial_backward(mode, False), _partial_backward(mode, True)
    assert len(native_run["returned"]) == len(python_run["returned"])
    for ours, theirs in zip(native_run["returned"], python_run["returned"]):
        assert torch.equal(ours, theirs)
    for key in ("dx", "db"):
        assert (native_run[key] is None) == (python_run[key] is None), key
        if python_run[key] is not None:
            assert torch.equal(native_run[key], python_run[key]), key
    assert torch.equal(native_run["main_grad"], python_run["main_grad"])
    if mode in ("weight_returned", "input_only"):
        assert torch.all(native_run["main_grad"] == 0.5)  # the engine's values, untouched
    for name, value in python_run["state"].items():
        assert torch.equal(native_run["state"][name], value), name


@pytest.mark.gpu
def test_a_gradient_of_the_bias_alone_casts_nothing(native):
    """The node computes what the running backward needs: the bias's gradient alone is the
    output gradient's column sums, with no cast (no amax recorded) and no weight gradient."""
    weight = torch.nn.Parameter(torch.randn(96, 256, device="cuda", dtype=torch.bfloat16))
    bias = torch.nn.Parameter(torch.randn(96, device="cuda", dtype=torch.bfloat16))
    engine = _Engine(weight, overwrite=True)
    register_main_grad(weight, engine.main_grad_of)
    slots = _slots("hybrid", "delayed")
    x = torch.randn(2, 50, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 50, 96, device="cuda", dtype=torch.bfloat16)
    y = linear(x, weight, bias, slots)
    before = slots.state.scaling_tensors()["amax_history_bwd"].clone()
    (bias_grad,) = torch.autograd.grad(y, [bias], grad)
    assert torch.equal(bias_grad, grad.reshape(-1, 96).sum(0))
    assert torch.equal(slots.state.scaling_tensors()["amax_history_bwd"], before)
    assert torch.all(engine.main_grad == 0.5)


@pytest.mark.gpu
def test_a_weight_written_in_place_before_backward_is_refused(native):
    """As for any autograd function that saved it: the backward would multiply by the new
    values."""
    weight = torch.nn.Parameter(torch.randn(96, 256, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(2, 50, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = linear(x, weight, None, _slots("hybrid", "delayed"))
    with torch.no_grad():
        weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def _assert_same_runs(native_run: dict, python_run: dict, keys=("y", "dx", "dw", "db", "dr")):
    for key in keys:
        if python_run[key] is None:
            assert native_run[key] is None
        else:
            assert torch.equal(native_run[key], python_run[key]), key
    if python_run["state"] is not None:
        for name, value in python_run["state"].items():
            assert torch.equal(native_run["state"][name], value), name


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [None, True], ids=["returned", "written"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_a_residual_joins_the_forward_gemm(native, bias, fused):
    """A residual of the output's dtype and layout is added by the forward GEMM (rounded once
    with the product: within a rounding of the Python path's `residual + output`, and no add
    kernel of its own); its gradient is the output's, and the others are the Python path's bit
    for bit."""
    run = dict(fmt="hybrid", kind="delayed", bias=bias, fused=fused, residual="dense")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        native_run = _run(**run, python=False)
    python_run = _run(**run, python=True)
    alone = _run(**(run | dict(residual=None)), python=False)
    assert not [e.name for e in profile.events() if e.name in ("aten::add", "aten::add_")]
    for y in (native_run["y"], python_run["y"]):
        assert_within_a_rounding(y, native_run["r"], alone["y"].detach())
    _assert_same_runs(native_run, python_run, keys=("dx", "dw", "db", "dr"))
    assert torch.equal(native_run["dr"], native_run["dy"])


@pytest.mark.gpu
@pytest.mark.parametrize("residual", ["fp32", "strided"])
def test_a_residual_the_gemm_cannot_take_is_added_after(native, residual):
    """A residual of another dtype, or not of dense rows, is added after the GEMM, as the
    Python path adds it: the same bits."""
    run = dict(fmt="hybrid", kind="delayed", bias=True, fused=True, residual=residual)
    _assert_same_runs(_run(**run, python=False), _run(**run, python=True))


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
    assert calls == ["linear"]


@pytest.mark.gpu
def test_backward_makes_the_weight_transpose_once(native):
    """The first backward of an FP8 weight makes its transposed copy (`torch`'s transpose of
    the FP8 bytes) and keeps it with the weight; the next backward multiplies by that copy
    instead of making another."""
    weight = torch.nn.Parameter(torch.randn(96, 256, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(2, 50, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    slots = _slots("hybrid", "delayed")
    made = []
    transpose = Fp8Weight._transpose

    def counted(fp8_weight: Fp8Weight):
        made.append(transpose(fp8_weight))
        return made[-1]

    with mock.patch.object(Fp8Weight, "_transpose", counted):
        linear(x, weight, None, slots).sum().backward()
        fp8_weight = fp8_weight_of(weight)
        assert len(made) == 1
        assert torch.equal(_bytes(made[0].data), _bytes(fp8_weight.tensor.data.t().contiguous()))
        linear(x, weight, None, slots).sum().backward()
    assert fp8_weight_of(weight) is fp8_weight
    assert len(made) == 1
    assert fp8_weight.transposed() is made[0]


def test_no_native_path_off_cuda():
    assert cpp_linear.native_linear(torch.zeros(4, 16)) is None
