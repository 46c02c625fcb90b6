"""`segment_sum` (the MoE expert biases' gradient) against per-segment sums in float64, on CPU
(`index_add`, as `repeat_interleave`'s backward) and by the Triton kernel on CUDA."""

import pytest
import torch

from megatron.core.fusions import segment_sum as segment_sum_module
from megatron.core.fusions.segment_sum import segment_sum

# Segments longer than the kernel's row tile and not a multiple of it, empty ones (an expert
# without tokens), and the padding rows' segment last.
LENGTHS = [70, 0, 33, 1, 0, 129, 7]


def _reference(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    pieces = torch.split(x.double(), lengths)
    return torch.stack([piece.sum(dim=0) for piece in pieces])


def _check(
    device: str,
    dtype: torch.dtype,
    width: tuple[int, ...],
    no_sync: bool = False,
    extra_rows: int = 0,
) -> torch.Tensor:
    """`segment_sum` of random rows against float64 sums; `no_sync`: its call (and only its: the
    checks read values) raises on a host synchronisation; `extra_rows`: rows after the
    segments, which no sum includes (an MoE layer's padding rows)."""
    torch.manual_seed(0)
    x = torch.randn(sum(LENGTHS) + extra_rows, *width, dtype=dtype, device=device)
    lengths = torch.tensor(LENGTHS, device=device)
    if no_sync:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = segment_sum(x, lengths)
    finally:
        if no_sync:
            torch.cuda.set_sync_debug_mode("default")
    assert got.dtype == dtype and got.shape == (len(LENGTHS), *width)
    expected = _reference(x[: sum(LENGTHS)], LENGTHS)
    torch.testing.assert_close(got, expected.to(dtype))
    for empty in (1, 4):
        assert not got[empty].any()
    return got


@pytest.mark.parametrize("width", [(24,), (3, 5)])
def test_segment_sums_on_cpu(width):
    got = _check("cpu", torch.float32, width)
    # The same bits as repeat_interleave's own backward, which this replaces.
    table = torch.zeros(len(LENGTHS), *width, requires_grad=True)
    lengths = torch.tensor(LENGTHS)
    torch.manual_seed(0)
    grad = torch.randn(sum(LENGTHS), *width)
    table.repeat_interleave(lengths, dim=0, output_size=sum(LENGTHS)).backward(grad)
    assert torch.equal(got, table.grad)


def test_rows_after_the_segments_are_not_summed_on_cpu():
    _check("cpu", torch.float32, (8,), extra_rows=9)


@pytest.mark.gpu
@pytest.mark.parametrize("extra_rows", [0, 40])
@pytest.mark.parametrize("width", [(300,), (3, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_sums_on_cuda_match_float64_without_a_host_read(width, dtype, extra_rows):
    _check("cuda", dtype, width, no_sync=True, extra_rows=extra_rows)


@pytest.mark.gpu
def test_no_rows_on_cuda():
    """A rank whose experts got no tokens: every sum is zero."""
    got = segment_sum(
        torch.empty(0, 16, device="cuda"), torch.zeros(3, dtype=torch.long, device="cuda")
    )
    assert got.shape == (3, 16) and not got.any()


@pytest.mark.gpu
def test_segment_sums_in_a_cuda_graph():
    # One pass (240 rows), and two (the same segments, each 5 times longer).
    for scale in (1, 5):
        lengths = torch.tensor([n * scale for n in LENGTHS], device="cuda")
        x = torch.randn(int(lengths.sum()), 64, device="cuda")
        segment_sum(x, lengths)  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = segment_sum(x, lengths)
        # Other values and other lengths: the replay reads both on the device.
        other = [n * scale for n in (7, 33, 0, 70, 1, 129, 0)]
        x.copy_(torch.randn_like(x))
        lengths.copy_(torch.tensor(other))
        graph.replay()
        torch.testing.assert_close(out, _reference(x[: sum(other)], other).float())


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
def test_weighted_rows(device):
    """Each row times its weight (the experts' routing weights, in fp32) before the sums."""
    torch.manual_seed(0)
    x = torch.randn(sum(LENGTHS) + 5, 40, device=device)
    weights = torch.rand(x.shape[0], device=device)
    got = segment_sum(x, torch.tensor(LENGTHS, device=device), row_weights=weights)
    expected = _reference((x * weights[:, None])[: sum(LENGTHS)], LENGTHS)
    torch.testing.assert_close(got, expected.float())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths",
    [
        [600, 0, 17, 256, 257, 1],  # at, below and above the piece size, and a multiple of it
        [(7 * i) % 53 for i in range(70)],  # more segments than the kernels' smallest vector
    ],
    ids=["around-the-piece-size", "70-segments"],
)
def test_segments_summed_in_pieces_on_cuda(lengths):
    """Inputs of more rows than a piece: each segment cut into pieces of at most the piece size
    (computed on the device, from the lengths there), with rows after the segments."""
    assert sum(lengths) > segment_sum_module._PIECE_ROWS
    torch.manual_seed(0)
    x = torch.randn(sum(lengths) + 40, 96, device="cuda")
    lengths_on_device = torch.tensor(lengths, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = segment_sum(x, lengths_on_device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = _reference(x[: sum(lengths)], lengths)
    torch.testing.assert_close(got, expected.float(), rtol=2e-5, atol=1e-4)
    for index, length in enumerate(lengths):
        if length == 0:
            assert not got[index].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_and_uneven_segments_on_cuda(dtype):
    """Segments of thousands of rows (summed in pieces, then the pieces), one of them most of
    the rows, with row weights and rows after the segments."""
    torch.manual_seed(0)
    lengths = [3000, 0, 17, 1200, 256]
    x = torch.randn(sum(lengths) + 100, 300, device="cuda", dtype=dtype)
    weights = torch.rand(x.shape[0], device="cuda")
    got = segment_sum(x, torch.tensor(lengths, device="cuda"), row_weights=weights)
    expected = _reference((x.double() * weights.double()[:, None])[: sum(lengths)], lengths)
    # fp32: sums of up to 3,000 products, accumulated in fp32.
    tolerance = dict(rtol=2e-5, atol=1e-3) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, expected.to(dtype), **tolerance)
