"""Gradient-accumulation fusion's C++ linear layer (`native_linear.py`,
`csrc/linear_into_main_grad.cpp`) against its Python autograd function on the GPU: the output,
input, weight (returned, written over or added into a main_grad of either dtype) and bias
gradients bit for bit (bf16 and fp16 through cuBLASLt with cached plans, ATen's GEMMs under
`torch.use_deterministic_algorithms`), and torch's `.grad` semantics off the happy path
(`torch.autograd.grad`, `backward(inputs=...)`, a kept `.grad`, recomputation,
`create_graph=True`, an engine's error) against plain autograd. Off CUDA the Python function
runs. The fp32 accumulation itself is checked against fp32 products by
`test_gradient_accumulation_fusion.py`, whose `linear` runs this node on CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron.core.tensor_parallel.grad_accumulation import FusionTarget, linear, register_main_grad
from megatron.core.tensor_parallel.native_linear import (
    native_linear_into_main_grad,
    python_function,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_PYTHON_NODE = "_LinearIntoMainGradBackward"


@pytest.fixture(scope="module")
def native():
    module = native_linear_into_main_grad(torch.zeros(1, device="cuda"))
    assert module is not None, "the C++ extension did not build on this GPU machine"
    return module


class _Engine:
    """Hands out one target per weight and counts the calls (an engine's `main_grad_of`)."""

    def __init__(self, target: torch.Tensor, overwrite: bool):
        self.target = target
        self.overwrite = overwrite
        self.calls = 0

    def main_grad_of(self, param: torch.nn.Parameter) -> FusionTarget:
        self.calls += 1
        return FusionTarget(self.target, self.overwrite)


def _run(
    native_path: bool,
    dtype,
    main_dtype,
    overwrite: bool,
    bias: bool,
    tokens: tuple[int, int] = (4, 33),
    features: tuple[int, int] = (64, 96),
    transposed_input: bool = False,
):
    """One layer's forward and backward: [*tokens, in] -> [*tokens, out] (`features`), the input
    made as [tokens[1], tokens[0], in] and transposed where `transposed_input` (not contiguous)."""
    torch.manual_seed(0)
    (in_features, out_features), device = features, "cuda"
    weight = torch.nn.Parameter(torch.randn(out_features, in_features, device=device, dtype=dtype))
    bias_param = (
        torch.nn.Parameter(torch.randn(out_features, device=device, dtype=dtype)) if bias else None
    )
    shape = (out_features, in_features)
    start = torch.full(shape, torch.nan) if overwrite else torch.randn(shape)
    engine = _Engine(start.to(device, main_dtype), overwrite)
    register_main_grad(weight, engine.main_grad_of)
    if transposed_input:
        x = torch.randn(tokens[1], tokens[0], in_features, device=device, dtype=dtype)
        x = x.transpose(0, 1).requires_grad_()
    else:
        x = torch.randn(*tokens, in_features, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(*tokens, out_features, device=device, dtype=dtype)
    with contextlib.nullcontext() if native_path else python_function():
        y = linear(x, weight, bias_param)
    node = type(y.grad_fn).__name__
    y.backward(g)
    assert weight.grad is None and engine.calls == 1
    grads = (x.grad, engine.target, None if bias_param is None else bias_param.grad)
    return node, y.detach(), grads


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("main_dtype", ["fp32", "same"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_cpp_layer_is_the_python_function_bit_for_bit(
    native, dtype, main_dtype, overwrite, bias
):
    main = torch.float32 if main_dtype == "fp32" else dtype
    node, out, grads = _run(True, dtype, main, overwrite, bias)
    python_node, expected_out, expected = _run(False, dtype, main, overwrite, bias)
    assert python_node == _PYTHON_NODE and node != _PYTHON_NODE
    assert torch.equal(out, expected_out)
    for grad, want in zip(grads, expected):
        assert (grad is None and want is None) or torch.equal(grad, want)
    assert not grads[1].isnan().any()


@pytest.mark.parametrize(
    "tokens, features, transposed_input",
    [((2, 512), (1024, 3072), False), ((1, 1), (64, 96), False), ((4, 33), (64, 96), True)],
    ids=["1024-tokens", "one-token", "transposed-input"],
)
@pytest.mark.parametrize("main_dtype", ["fp32", "same"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_shapes_of_the_cpp_layer_bit_for_bit(
    native, dtype, main_dtype, tokens, features, transposed_input
):
    """The C++ layer against the Python function at a layer's size (where cuBLAS may split the
    inner dimension), at one token (whose products the node leaves to ATen, as matrix-vector
    products), and on an input that is not contiguous (whose bias ATen adds after the
    product)."""
    main = torch.float32 if main_dtype == "fp32" else dtype
    shape = dict(tokens=tokens, features=features, transposed_input=transposed_input)
    node, out, grads = _run(True, dtype, main, False, True, **shape)
    python_node, expected_out, expected = _run(False, dtype, main, False, True, **shape)
    assert python_node == _PYTHON_NODE and node != _PYTHON_NODE
    assert torch.equal(out, expected_out)
    for grad, want in zip(grads, expected):
        assert torch.equal(grad, want)


def _run_with_residual(native_path: bool, dtype: torch.dtype, residual: str | None, bias: bool):
    """A [4, 33, 64] -> [4, 33, 96] layer, its weight gradient written over an fp32 main_grad,
    plus a residual of the output's dtype and layout ("dense"), in fp32, not contiguous
    ("strided"), or none (the same layer and inputs)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(96, 64, device="cuda", dtype=dtype))
    bias_param = torch.nn.Parameter(torch.randn(96, device="cuda", dtype=dtype)) if bias else None
    engine = _Engine(torch.full((96, 64), torch.nan, device="cuda"), overwrite=True)
    register_main_grad(weight, engine.main_grad_of)
    x = torch.randn(4, 33, 64, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(4, 33, 96, device="cuda", dtype=dtype)
    skip = torch.randn(33, 4, 96, device="cuda")
    skip = skip.transpose(0, 1) if residual == "strided" else skip.view(4, 33, 96)
    skip = skip.to(torch.float32 if residual == "fp32" else dtype).requires_grad_()
    skip = skip if residual is not None else None
    g = g if skip is None else g.to(skip.dtype)
    with contextlib.nullcontext() if native_path else python_function():
        y = linear(x, weight, bias_param, residual=skip)
    y.backward(g)
    grads = (x.grad, engine.target, None if bias_param is None else bias_param.grad)
    return dict(y=y.detach(), grads=grads, dr=None if skip is None else skip.grad, r=skip, g=g)


def assert_within_a_rounding(fused: torch.Tensor, residual: torch.Tensor, output: torch.Tensor):
    """`fused` is `residual + output` rounded once where `output` was rounded before: within the
    dtype's epsilon of the operands' magnitudes of the exact sum."""
    exact = residual.detach().float() + output.float()
    bound = torch.finfo(fused.dtype).eps * (residual.detach().float().abs() + output.float().abs())
    assert ((fused.float() - exact).abs() <= bound).all()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_residual_joins_the_forward_gemm(native, dtype, bias):
    """A residual of the output's dtype and layout is added by the forward GEMM (cuBLAS's C,
    rounded once with the product and the bias, with no add kernel of its own); its gradient is
    the output's, and the others are the Python path's bit for bit."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run = _run_with_residual(True, dtype, "dense", bias)
    expected = _run_with_residual(False, dtype, "dense", bias)
    alone = _run_with_residual(True, dtype, None, bias)
    assert not [e.name for e in profile.events() if e.name in ("aten::add", "aten::add_")]
    assert_within_a_rounding(run["y"], run["r"], alone["y"])
    assert_within_a_rounding(expected["y"], run["r"], alone["y"])
    for grad, want in zip(run["grads"], expected["grads"]):
        assert (grad is None and want is None) or torch.equal(grad, want)
    assert torch.equal(run["dr"], run["g"]) and torch.equal(expected["dr"], run["g"])


@pytest.mark.parametrize("residual", ["fp32", "strided"])
def test_a_residual_the_gemm_cannot_take_is_added_after(native, residual):
    """A residual of another dtype, or not of dense rows, is added after the GEMM, as the
    Python path adds it: the same bits."""
    run = _run_with_residual(True, torch.bfloat16, residual, True)
    expected = _run_with_residual(False, torch.bfloat16, residual, True)
    assert torch.equal(run["y"], expected["y"]) and torch.equal(run["dr"], expected["dr"])
    for grad, want in zip(run["grads"], expected["grads"]):
        assert torch.equal(grad, want)


_ATEN_GEMMS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul"}


@contextlib.contextmanager
def _deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@contextlib.contextmanager
def _no_reduced_precision_reduction():
    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = previous


# GEMM settings: what each sets, and whether the node then runs ATen's GEMMs.
_SETTINGS = {
    "default": (contextlib.nullcontext, False),
    "deterministic": (_deterministic, True),
    "no-reduced-precision-reduction": (_no_reduced_precision_reduction, True),
}


def _bf16_layer() -> tuple[torch.nn.Parameter, torch.nn.Parameter, torch.Tensor, torch.Tensor]:
    """A bf16 layer's weight and bias, an input and an output gradient."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(96, 64, device="cuda", dtype=torch.bfloat16))
    bias = torch.nn.Parameter(torch.randn(96, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(4, 33, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 33, 96, device="cuda", dtype=torch.bfloat16)
    return weight, bias, x, g


def _bf16_pass(native_path: bool, setting: str, fused: bool):
    """A bf16 layer's forward and backward under a GEMM `setting`: the ATen ops they ran, and
    the output and the weight, bias and input gradients."""
    weight, bias, x, g = _bf16_layer()
    engine = _Engine(torch.zeros(96, 64, device="cuda"), overwrite=False)
    register_main_grad(weight, engine.main_grad_of)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with _SETTINGS[setting][0]():
        with torch.profiler.profile(activities=activities) as profile:
            with contextlib.nullcontext() if native_path else python_function():
                y = linear(x, weight, bias)
            if fused:
                y.backward(g)
                grads = (engine.target, bias.grad, x.grad)
            else:
                grads = torch.autograd.grad(y, (weight, bias, x), g)
    assert engine.calls == (1 if fused else 0)
    ops = {event.name for event in profile.events() if event.name.startswith("aten::")}
    return ops, (y.detach(), *grads)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("setting", list(_SETTINGS))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "returned"])
def test_bf16_products_go_through_cublaslt(native, setting, fused):
    """A bf16 layer's three GEMMs run through the cached cuBLASLt plans (no ATen GEMM in forward
    or backward), whether the weight gradient goes to the engine or is returned
    (`torch.autograd.grad`); under `torch.use_deterministic_algorithms`, or with bf16
    reductions in reduced precision disallowed, the node runs ATen's. Either way the results
    are the Python function's bit for bit, and plain `F.linear`'s to bf16's rounding (its weight
    gradient is rounded to bf16; the engine's is summed in fp32)."""
    ops, results = _bf16_pass(True, setting, fused)
    _, expected = _bf16_pass(False, setting, fused)
    assert bool(ops & _ATEN_GEMMS) == _SETTINGS[setting][1], sorted(ops)
    for got, want in zip(results, expected):
        assert torch.equal(got, want)
    weight, bias, x, g = _bf16_layer()
    y = torch.nn.functional.linear(x, weight, bias)
    y.backward(g)
    for got, plain in zip(results, (y, weight.grad, bias.grad, x.grad)):
        torch.testing.assert_close(got.float(), plain.detach().float(), rtol=1.6e-2, atol=1e-5)


def _registered() -> tuple[torch.nn.Parameter, _Engine]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 5, device="cuda", dtype=torch.float64))
    engine = _Engine(torch.zeros(6, 5, device="cuda", dtype=torch.float64), overwrite=False)
    register_main_grad(weight, engine.main_grad_of)
    return weight, engine


def test_autograd_grad_inputs_recompute_and_a_kept_grad(native):
    """Only a backward that accumulates into the weight fuses: `torch.autograd.grad` returns the
    weight's gradient when asked for it, neither it nor `backward(inputs=...)` without the
    weight asks the engine, a recomputed layer fuses once, and a `.grad` kept from an earlier
    backward is accumulated into by autograd."""
    weight, engine = _registered()
    x = torch.randn(3, 4, 5, device="cuda", dtype=torch.float64, requires_grad=True)

    def loss_of(x):
        return linear(x, weight).square().sum()

    expected_w, expected_x = torch.autograd.grad(x.matmul(weight.t()).square().sum(), (weight, x))
    assert type(loss_of(x).grad_fn.next_functions[0][0]).__name__ != _PYTHON_NODE
    (grad_x,) = torch.autograd.grad(loss_of(x), x)
    grad_w, grad_x2 = torch.autograd.grad(loss_of(x), (weight, x))
    loss_of(x).backward(inputs=[x])
    assert engine.calls == 0 and torch.count_nonzero(engine.target) == 0
    assert weight.grad is None
    torch.testing.assert_close(grad_w, expected_w)
    for grad in (grad_x, grad_x2, x.grad):
        torch.testing.assert_close(grad, expected_x)
    torch.utils.checkpoint.checkpoint(loss_of, x, use_reentrant=False).backward()
    loss_of(x).backward()
    assert engine.calls == 2 and weight.grad is None
    torch.testing.assert_close(engine.target, 2 * expected_w)
    weight.grad = torch.ones_like(weight)
    loss_of(x).backward()
    assert engine.calls == 2
    torch.testing.assert_close(weight.grad, 1 + expected_w)


def test_create_graph_fuses_once_differentiable(native):
    """`backward(create_graph=True)`: the weight's gradient goes to the engine, the input's and
    the bias's equal `F.linear`'s, and differentiating them again raises."""
    weight, engine = _registered()
    bias = torch.nn.Parameter(torch.randn(6, device="cuda", dtype=torch.float64))
    x = torch.randn(3, 4, 5, device="cuda", dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(
        torch.nn.functional.linear(x, weight, bias).square().sum(), (weight, x, bias)
    )
    linear(x, weight, bias).square().sum().backward(create_graph=True)
    assert weight.grad is None
    for grad, want in zip((engine.target, x.grad, bias.grad), expected):
        torch.testing.assert_close(grad, want)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        x.grad.sum().backward()


def test_an_engine_error_reaches_the_caller(native):
    """An exception raised where the engine is asked for the target leaves the backward as
    itself, with its message."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 5, device="cuda"))

    class Failing:
        def main_grad_of(self, param):
            raise ValueError("no room for this gradient")

    engine = Failing()
    register_main_grad(weight, engine.main_grad_of)
    x = torch.randn(2, 5, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match="no room for this gradient"):
        linear(x, weight).sum().backward()
