"""The fused SwiGLU kernels (`megatron.core.fusions.fused_swiglu`) against SwiGLU computed in
float64, forward and backward, and inside the model against the PyTorch ops."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import gated_linear_unit, quick_gelu
from megatron.core.fusions.fused_swiglu import fused_swiglu, fused_swiglu_supported
from megatron.core.transformer.mlp import mlp_activation
from tests.unit_tests.model_builders import (
    assert_same_training_signal,
    build_tiny_gpt,
    make_token_batches,
    tiny_gpt_config,
)

DEVICE = "cuda"

# [..., 2 * ffn]: the 1.34B-class MLP's width over several column blocks and an odd one; a
# width below one block; a 2-D token-major input as the MoE experts' grouped GEMM gives.
SHAPES = [(16, 2, 2 * 5632), (7, 3, 2 * 1000), (5, 2 * 24), (33, 2 * 96)]


def _swiglu_and_backward(x, grad, fused, weights=None, weights_grad=True):
    x = x.detach().requires_grad_()
    if weights is not None:
        weights = weights.detach().requires_grad_(weights_grad)
    if fused:
        out = fused_swiglu(x, weights)
    else:
        out = gated_linear_unit(x, F.silu)
        if weights is not None:  # as the experts: the product in fp32, rounded once
            out = (out * weights).to(x.dtype)
    out.backward(grad)
    return out, x.grad, None if weights is None else weights.grad


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rows apart", "channels apart"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_swiglu_matches_float64(shape, dtype, layout):
    torch.manual_seed(0)
    # Strided views: rows further apart than their width (addressed in place), or channels
    # not adjacent (copied for the kernels); and an output gradient that is not contiguous,
    # as backward may deliver it.
    wide = 3 * torch.randn(*shape[:-1], 2 * shape[-1], device=DEVICE, dtype=dtype)
    x = wide[..., : shape[-1]] if layout == "rows apart" else wide[..., ::2]
    ffn = shape[-1] // 2
    grad = torch.randn(ffn, *shape[:-1], device=DEVICE, dtype=dtype).movedim(0, -1)
    assert fused_swiglu_supported(x) and not x.is_contiguous() and not grad.is_contiguous()

    fused = _swiglu_and_backward(x, grad, fused=True)[:2]
    unfused = _swiglu_and_backward(x, grad, fused=False)[:2]
    expected = _swiglu_and_backward(x.double(), grad.double(), fused=False)[:2]
    for name, got, plain, ref in zip(("out", "grad"), fused, unfused, expected):
        assert got.dtype == dtype and got.shape == ref.shape and got.is_contiguous(), name
        torch.testing.assert_close(got, ref.to(dtype), msg=name)
        if dtype != torch.float32:
            # fp32 arithmetic rounded once, against the unfused ops' rounding of every
            # intermediate to the tensors' dtype: more accurate on average.
            errors = [(t.double() - ref).square().mean() for t in (got, plain)]
            assert errors[0] < errors[1], (name, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, ffn", [(4096, 2816), (9, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_matches_float64(rows, ffn, dtype):
    """An MoE expert's rows times their fp32 routing weights: the output, the input's gradient
    and the weights' (a sum over each row, over several column blocks in the first shape)."""
    torch.manual_seed(0)
    x = 3 * torch.randn(rows, 2 * ffn, device=DEVICE, dtype=dtype)
    weights = torch.rand(rows, 1, device=DEVICE)
    grad = torch.randn(rows, ffn, device=DEVICE, dtype=dtype)

    fused = _swiglu_and_backward(x, grad, True, weights)
    unfused = _swiglu_and_backward(x, grad, False, weights)
    expected = _swiglu_and_backward(x.double(), grad.double(), False, weights.double())
    for name, got, plain, ref in zip(("out", "grad", "weights grad"), fused, unfused, expected):
        assert got.dtype == plain.dtype and got.shape == ref.shape, name
        # The weights' gradient sums a row of `ffn` products: fp32 accumulation error.
        tolerance = dict(rtol=1e-4, atol=1e-4) if name == "weights grad" else {}
        torch.testing.assert_close(got, ref.to(got.dtype), **tolerance, msg=name)
        if x.dtype != torch.float32 and name != "weights grad":
            # Rounded once, against the unfused ops' rounding of the activation first.
            errors = [(t.double() - ref).square().mean() for t in (got, plain)]
            assert errors[0] < errors[1], (name, errors)


@pytest.mark.gpu
def test_weights_of_another_count_or_device_are_refused():
    x = torch.randn(4, 2 * 8, device=DEVICE)
    for weights in (torch.ones(3, device=DEVICE), torch.ones(4)):
        with pytest.raises(ValueError, match="one weight per row"):
            fused_swiglu(x, weights)


@pytest.mark.gpu
def test_strided_weights_and_weights_without_gradient():
    """A column of the routing weights (every other element) and a broadcast weight are read
    as their values; weights that need no gradient get none."""
    torch.manual_seed(0)
    x = torch.randn(64, 2 * 40, device=DEVICE)
    probs = torch.rand(64, 2, device=DEVICE)
    for weights in (probs[:, 1:], torch.rand(1, 1, device=DEVICE).expand(64, 1)):
        expected = gated_linear_unit(x, F.silu) * weights
        torch.testing.assert_close(fused_swiglu(x, weights), expected)
    grad = torch.randn(64, 40, device=DEVICE)
    fused = _swiglu_and_backward(x, grad, True, probs[:, :1], weights_grad=False)
    expected = _swiglu_and_backward(x, grad, False, probs[:, :1], weights_grad=False)
    assert fused[2] is None
    for got, want in zip(fused[:2], expected[:2]):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_fused_swiglu_keeps_only_its_input_for_backward():
    """Backward needs only the input, which the layer keeps anyway; the unfused ops keep the
    SiLU's output too (a tensor of the MLP's width more per layer)."""
    x = torch.randn(64, 2 * 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    saved = {}
    for fused in (True, False):
        storages = set()

        def pack(tensor, storages=storages):
            storages.add(tensor.untyped_storage().data_ptr())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fused_swiglu(x) if fused else gated_linear_unit(x, F.silu)
        saved[fused] = storages
    assert saved[True] == {x.untyped_storage().data_ptr()}
    assert len(saved[False]) > 1


@pytest.mark.gpu
def test_empty_input():
    x = torch.empty(0, 2 * 64, device=DEVICE, requires_grad=True)
    out = fused_swiglu(x)
    out.sum().backward()
    assert out.shape == (0, 64) and x.grad.shape == x.shape


@pytest.mark.gpu
def test_model_with_swiglu_fusion_matches_unfused():
    configs = [
        tiny_gpt_config(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=f)
        for f in (False, True)
    ]
    assert_same_training_signal(configs, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_moe_experts_with_swiglu_fusion_match_unfused(grouped_gemm, bias):
    """With biases, the experts' bias gradients are the expert-bias kernel's in both."""
    configs = [
        tiny_gpt_config(
            num_moe_experts=4,
            moe_ffn_hidden_size=16,
            moe_grouped_gemm=grouped_gemm,
            add_bias_linear=bias,
            gated_linear_unit=True,
            activation_func=F.silu,
            bias_activation_fusion=fusion,
        )
        for fusion in (False, True)
    ]
    assert_same_training_signal(configs, DEVICE)


@pytest.mark.gpu
def test_model_with_swiglu_fusion_runs_the_kernels():
    config = tiny_gpt_config(
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True
    )
    model = build_tiny_gpt(config)
    tokens, labels = (t.to(DEVICE) for t in make_token_batches(1, 2)[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        model.to(DEVICE)(tokens, labels=labels).sum().backward()
        torch.cuda.synchronize()
    names = [event.name for event in profiler.events()]
    # One launch per layer and direction (2 layers).
    assert sum("_swiglu_forward_kernel" in name for name in names) == 2, names
    assert sum("_swiglu_backward_kernel" in name for name in names) == 2, names


def test_off_cuda_the_pytorch_ops_run():
    x, weights = torch.randn(4, 2 * 8), torch.rand(4, 1)
    assert not fused_swiglu_supported(x)
    config = tiny_gpt_config(gated_linear_unit=True, activation_func=F.silu)
    fused = dataclasses.replace(config, bias_activation_fusion=True)
    assert torch.equal(mlp_activation(x, fused), gated_linear_unit(x, F.silu))
    assert torch.equal(mlp_activation(x, fused, weights), gated_linear_unit(x, F.silu) * weights)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fields",
    [
        dict(activation_func=F.silu, activation_func_clamp_value=7.0),
        dict(activation_func=F.silu, glu_linear_offset=1.0),
        dict(activation_func=quick_gelu),
    ],
)
def test_other_gated_activations_take_the_pytorch_ops(fields):
    """The kernels compute plain SwiGLU only: the clamp, the offset or another gate would change
    these values (beyond the clamp, large enough to tell)."""
    x = 10 * torch.randn(4, 2 * 8, device=DEVICE)
    config = tiny_gpt_config(gated_linear_unit=True, **fields)
    fused = dataclasses.replace(config, bias_activation_fusion=True)
    assert torch.equal(mlp_activation(x, fused), mlp_activation(x, config))
    assert not torch.allclose(mlp_activation(x, fused), fused_swiglu(x))
