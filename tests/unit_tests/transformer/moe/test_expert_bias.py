"""The fused MoE expert bias (`megatron.core.fusions.expert_bias`) against the experts' PyTorch
ops computed in float64: the output and the gradients of the rows, the bias and the routing
weights, with padding rows after the experts' and an expert without rows."""

import pytest
import torch

from megatron.core.fusions.expert_bias import add_expert_bias, expert_bias_fusable

COUNTS = [5, 0, 70, 9]
MANY_COUNTS = [(11 * i) % 37 for i in range(40)]
"""More experts than the kernels' smallest vector of counts (16), some without rows."""
PADDING = 12
DEVICE = "cuda"


def _reference(x, bias, counts, weights):
    """The experts' PyTorch ops: each row's expert bias (zero for padding), times its weight."""
    table = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
    lengths = torch.cat([counts, (x.shape[0] - counts.sum()).view(1)])
    rows = table.repeat_interleave(lengths, dim=0, output_size=x.shape[0])
    return x + (rows if weights is None else rows * weights)


def _run(function, x, bias, counts, weights, grad):
    inputs = [t.detach().requires_grad_() if t is not None else None for t in (x, bias, weights)]
    out = function(inputs[0], inputs[1], counts, inputs[2])
    out.backward(grad.to(out.dtype))  # the values of `grad` in every dtype here
    return out, *(t.grad if t is not None else None for t in inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("counts_list", [COUNTS, MANY_COUNTS], ids=["4-experts", "40-experts"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_expert_bias_matches_float64(dtype, weighted, counts_list):
    torch.manual_seed(0)
    real = sum(counts_list)
    rows, width = real + PADDING, 1100  # two column blocks, the second partial
    x = torch.randn(rows, width, device=DEVICE, dtype=dtype)
    bias = torch.randn(len(counts_list), width, device=DEVICE, dtype=dtype)
    counts = torch.tensor(counts_list, device=DEVICE)
    weights = None
    if weighted:  # fp32 routing weights, zero for the padding rows as the dispatchers give them
        weights = torch.rand(rows, 1, device=DEVICE)
        weights[real:] = 0
    grad = torch.randn(rows, width, device=DEVICE, dtype=dtype)  # the reference's too
    assert expert_bias_fusable(x)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused = _run(add_expert_bias, x, bias, counts, weights, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    double = [None if t is None else t.double() for t in (x, bias, weights)]
    expected = _run(_reference, double[0], double[1], counts, double[2], grad.double())
    names = ("out", "x grad", "bias grad", "weights grad")
    for name, got, want in zip(names, fused, expected):
        if want is None:
            assert got is None, name
            continue
        # The bias and weight gradients sum up to 70 rows or 1100 columns in fp32.
        tolerance = dict(rtol=2e-5, atol=2e-4) if "bias" in name or "weights" in name else {}
        if dtype == torch.bfloat16 and name == "bias grad":
            tolerance = {}  # rounded once to bf16
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want.to(got.dtype), **tolerance, msg=name)
    assert fused[0].dtype == dtype
    # An expert without rows gets a zero gradient.
    for expert, count in enumerate(counts_list):
        if count == 0:
            assert not fused[2][expert].any()


def test_off_cuda_the_pytorch_ops_run():
    assert not expert_bias_fusable(torch.randn(4, 8))


@pytest.mark.gpu
def test_strided_inputs_and_a_cuda_graph_replayed_with_other_counts():
    """A row-strided `x` and a non-contiguous bias give the contiguous ones' results; a graph
    captured once adds the biases of other counts when replayed (they are read on the
    device), backward included."""
    torch.manual_seed(0)
    rows, width = sum(COUNTS) + PADDING, 300
    wide = torch.randn(rows, 2 * width, device=DEVICE)
    x = wide[:, :width]
    bias = torch.randn(width, len(COUNTS), device=DEVICE).t()
    weights = torch.rand(rows, 1, device=DEVICE)
    counts = torch.tensor(COUNTS, device=DEVICE)
    grad = torch.randn(rows, width, device=DEVICE)
    strided = _run(add_expert_bias, x, bias, counts, weights, grad)
    plain = _run(add_expert_bias, x.contiguous(), bias.contiguous(), counts, weights, grad)
    for got, want in zip(strided, plain):
        assert torch.equal(got, want)

    x_in, bias_in, weights_in = (t.detach().clone().requires_grad_() for t in (x, bias, weights))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = add_expert_bias(x_in, bias_in, counts, weights_in)
        out.backward(grad)
    other = [0, 60, 20, 4]
    counts.copy_(torch.tensor(other, device=DEVICE))
    # The replay writes the captured gradients anew (they were None before the capture).
    graph.replay()
    expected = _run(_reference, x, bias, counts, weights, grad)
    for got, want in zip((out, x_in.grad, bias_in.grad, weights_in.grad), expected):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-4)
