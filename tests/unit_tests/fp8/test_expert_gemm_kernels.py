"""The Triton grouped FP8 GEMMs of the experts (`expert_gemm_kernels`) against a plain-torch
reference: each expert's FP8 operands dequantised and multiplied in fp64, then rounded to the
output dtype. FP8 products are exact in fp32; the kernels differ from the reference by the
tensor cores' sums, which keep partial sums of up to 128 products in reduced precision before
promoting them into fp32 (within 2^-11 of the output's largest magnitude on an H200, and within
2^-10 under fast accumulation, which never promotes them: the tolerances are twice and four times
that), and in bf16 by one rounding on the other side of a bf16 boundary. A wrong expert, scale,
row or operand moves the output by far more. Also against one `torch._scaled_mm` per expert (the
path the kernels replace); experts without rows, counts that are not multiples of 16, E5M2 first
operands; weight gradients written over or added to strided fp32 and bf16 `main_grad`s. The
refusals run on any device."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8 import expert_gemm_kernels
from megatron.core.fp8.grouped_gemm import DeviceExpertRows, ExpertRows
from megatron.core.fp8.grouped_quantize import quantize_experts
from tests.unit_tests.fp8.reference import E4M3, E5M2

CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
needs_gpu = pytest.mark.skipif(
    not CUDA, reason="the Triton FP8 GEMMs need a GPU of compute capability 9.0 or later"
)

COUNT_CASES = {
    "few": [5, 0, 17, 3],
    "uneven": [0, 130, 1, 0, 260, 384],
    "many": None,  # 64 experts, random counts: the binary search over 64 tile starts
}


def _counts(name: str) -> list[int]:
    counts = COUNT_CASES[name]
    if counts is None:
        generator = torch.Generator().manual_seed(3)
        counts = torch.randint(0, 700, (64,), generator=generator).tolist()
        counts[7] = counts[40] = 0
    return counts


def _dequantised(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return data.double() * scale_inv.double()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32 if tensor.dtype == torch.float32 else torch.int16)


def _close(actual: torch.Tensor, expected: torch.Tensor, fast_accum: bool = False) -> None:
    """Within 2^-10 of the largest magnitude (2^-8 under fast accumulation), and one bf16 step
    of it more in bf16 (the two may round a sum on either side of a bf16 boundary)."""
    expected = expected.to(actual.dtype).double()
    relative = 2.0**-8 if fast_accum else 2.0**-10
    if actual.dtype != torch.float32:
        relative += 2.0**-7
    atol = relative * expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=atol)


def _operands(counts: list[int], first_dtype: torch.dtype, k: int, n: int, seed: int = 0):
    """The rows cast per expert (`[P, k]`), stacked `[G, k, n]` column-major weights of E4M3
    with one multiplier each."""
    generator = torch.Generator().manual_seed(seed)
    rows = ExpertRows(counts)
    x = torch.randn(rows.rows, k, generator=generator).cuda()
    cast = quantize_experts(x, rows, first_dtype)
    weights = (torch.randn(len(counts), n, k, generator=generator) * 20).to(E4M3).cuda()
    b_scales = (torch.rand(len(counts), generator=generator) + 0.5).cuda()
    return rows, cast, weights.transpose(1, 2), b_scales


@needs_gpu
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("first_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("counts", list(COUNT_CASES))
def test_grouped_mm_multiplies_each_experts_rows_by_its_weight(
    counts, first_dtype, out_dtype, fast_accum
):
    counts = _counts(counts)
    rows, cast, b, b_scales = _operands(counts, first_dtype, k=320, n=272)
    device = b.device
    out = expert_gemm_kernels.grouped_mm(
        cast.data,
        cast.scale_invs,
        b,
        b_scales,
        rows.gemm_table(device),
        rows.gemm_tiles,
        out_dtype=out_dtype,
        fast_accum=fast_accum,
    )
    assert out.shape == (rows.padded_rows, 272) and out.dtype == out_dtype
    for expert, (start, padded) in enumerate(zip(rows.padded_starts, rows.padded_counts)):
        if padded == 0:
            continue
        part = out[start : start + padded]
        a = _dequantised(cast.data[start : start + padded], cast.scale_invs[expert])
        _close(part, a @ _dequantised(b[expert], b_scales[expert]), fast_accum)
        assert not part[counts[expert] :].any(), "rows of padding give zero rows"
        if counts[expert] and out_dtype == torch.float32 and not fast_accum:
            single = torch._scaled_mm(
                cast.data[start : start + padded],
                b[expert],
                cast.scale_invs[expert].reshape(()),
                b_scales[expert].clone().reshape(()),  # cuBLASLt's 16-byte alignment
                out_dtype=torch.float32,
            )
            _close(part, single.double())


@needs_gpu
@pytest.mark.parametrize("counts", list(COUNT_CASES))
def test_grouped_mm_writes_the_real_rows_back_to_back(counts):
    """`real_rows`: each expert's rows of the product without its padding, where
    `ExpertRows.unpad` would put them, bit for bit; the weights' multipliers read with a stride
    (a column of 16-byte rows, as Megatron-FSDP keeps them)."""
    counts = _counts(counts)
    rows, cast, b, b_scales = _operands(counts, E4M3, k=320, n=272, seed=2)
    strided = torch.zeros(len(counts), 4, device=b.device)
    strided[:, 0] = b_scales
    args = (cast.data, cast.scale_invs, b, strided[:, 0], rows.gemm_table(b.device))
    padded = expert_gemm_kernels.grouped_mm(*args, rows.gemm_tiles, out_dtype=torch.bfloat16)
    real = expert_gemm_kernels.grouped_mm(
        *args, rows.gemm_tiles, out_dtype=torch.bfloat16, real_rows=rows.rows
    )
    assert real.shape == (rows.rows, 272)
    assert torch.equal(_bits(real), _bits(rows.unpad(padded)))
    contiguous = expert_gemm_kernels.grouped_mm(
        cast.data, cast.scale_invs, b, b_scales, args[-1], rows.gemm_tiles, out_dtype=torch.bfloat16
    )
    assert torch.equal(_bits(contiguous), _bits(padded))


@needs_gpu
@pytest.mark.parametrize("counts", list(COUNT_CASES) + ["last_empty"])
def test_grids_sized_by_device_rows_give_the_exact_grids_results(counts):
    """`DeviceExpertRows`: the cast and the GEMM over grids and buffers sized by upper bounds
    (the programs past the real tiles exit) give the exact grids' bytes, scales and products,
    bit for bit, an empty last expert included (its scale is left as it was)."""
    counts = [40, 3, 0] if counts == "last_empty" else _counts(counts)
    host = ExpertRows(counts)
    rows = DeviceExpertRows(torch.tensor(counts, device="cuda"), host.rows)
    x = torch.randn(host.rows, 320, generator=torch.Generator().manual_seed(4)).cuda()
    exact = quantize_experts(x, host, E4M3, transpose=True)
    bound = quantize_experts(x, rows, E4M3, transpose=True)
    real = host.padded_rows
    assert bound.data.shape[0] == rows.padded_rows >= real
    assert torch.equal(bound.data[:real].view(torch.uint8), exact.data.view(torch.uint8))
    assert torch.equal(
        bound.transposed[:, :real].view(torch.uint8), exact.transposed.view(torch.uint8)
    )
    assert torch.equal(bound.scale_invs, exact.scale_invs)
    _, _, b, b_scales = _operands(counts, E4M3, k=320, n=272)
    products = [
        expert_gemm_kernels.grouped_mm(
            cast.data,
            cast.scale_invs,
            b,
            b_scales,
            expert_rows.gemm_table(b.device),
            expert_rows.gemm_tiles,
            out_dtype=torch.bfloat16,
            real_rows=host.rows,
        )
        for cast, expert_rows in ((exact, host), (bound, rows))
    ]
    assert torch.equal(_bits(products[0]), _bits(products[1]))


@needs_gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("counts", list(COUNT_CASES))
def test_grouped_wgrad_sums_each_experts_rows_into_its_gradient(
    counts, grad_dtype, accumulate, out_dtype
):
    counts = _counts(counts)
    generator = torch.Generator().manual_seed(1)
    rows = ExpertRows(counts)
    groups, n, k = len(counts), 272, 320
    grads = quantize_experts(
        torch.randn(rows.rows, n, generator=generator).cuda() * 1e-3,
        rows,
        grad_dtype,
        transpose=True,
    )
    inputs = quantize_experts(
        torch.randn(rows.rows, k, generator=generator).cuda(), rows, E4M3, transpose=True
    )
    # A strided main_grad (each expert's gradient stored transposed), its old values of the
    # new ones' magnitude (a sum that missed the product would not pass), kept where nothing
    # is added: an expert without rows keeps even a -0.0.
    old = (torch.randn(groups, k, n, generator=generator) * 1e-2).to(out_dtype).cuda()
    old[:, 0, 0] = -0.0
    dest = old.clone().transpose(1, 2)
    expert_gemm_kernels.grouped_wgrad_into(
        dest,
        grads.transposed,
        grads.scale_invs,
        inputs.transposed.t(),
        inputs.scale_invs,
        rows.gemm_table(dest.device),
        accumulate=accumulate,
    )
    for expert, (start, padded) in enumerate(zip(rows.padded_starts, rows.padded_counts)):
        before = old[expert].t()
        if counts[expert] == 0:
            if accumulate:
                assert torch.equal(_bits(dest[expert]), _bits(before))
            else:
                assert not dest[expert].any()
            continue
        g = _dequantised(grads.transposed[:, start : start + padded], grads.scale_invs[expert])
        x = _dequantised(inputs.transposed[:, start : start + padded], inputs.scale_invs[expert])
        product = g @ x.t()
        if accumulate:
            _close(dest[expert], before.double() + product)
        else:
            _close(dest[expert], product)


@needs_gpu
def test_promotion_keeps_long_sums_in_fp32():
    """Without fast accumulation the partial sums join an fp32 accumulator every 128 products:
    a long sum of positive products (16384 of them) stays within fp32's rounding of the exact
    one; fast accumulation (the forward GEMMs') may not."""
    rows = ExpertRows([16])
    a = torch.full((16, 16384), 0.875, device="cuda").to(E4M3)
    a[:, ::3] = 1.125
    b = torch.full((1, 128, 16384), 1.25, device="cuda").to(E4M3).transpose(1, 2)
    ones = torch.ones(1, device="cuda")
    out = expert_gemm_kernels.grouped_mm(
        a, ones, b, ones, rows.gemm_table(a.device), rows.gemm_tiles, out_dtype=torch.float32
    )
    exact = a.double() @ b[0].double()
    relative = ((out.double() - exact).abs().max() / exact.abs().max()).item()
    assert relative <= 2.0**-20, relative


def test_the_kernels_refuse_what_they_do_not_multiply():
    rows = ExpertRows([16])
    table = rows.gemm_table(torch.device("cpu"))
    ones = torch.ones(1)
    a = torch.zeros(16, 32, dtype=E4M3)
    b = torch.zeros(1, 48, 32, dtype=E4M3).transpose(1, 2)
    with pytest.raises(ValueError, match="table has 6 entries for 2 experts"):
        expert_gemm_kernels.grouped_mm(
            a, ones, b.expand(2, -1, -1), ones, table, 1, out_dtype=torch.bfloat16
        )
    with pytest.raises(ValueError, match="takes FP8 operands"):
        expert_gemm_kernels.grouped_mm(a.float(), ones, b, ones, table, 1, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="writes bf16, fp16 or fp32"):
        expert_gemm_kernels.grouped_mm(a, ones, b, ones, table, 1, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="must share the contraction dimension"):
        expert_gemm_kernels.grouped_mm(a[:, :16], ones, b, ones, table, 1, out_dtype=torch.float32)
    out = torch.zeros(1, 48, 32)
    with pytest.raises(ValueError, match="does not make the experts' \\[48, 32\\] gradients"):
        expert_gemm_kernels.grouped_wgrad_into(
            out, torch.zeros(40, 16, dtype=E4M3), ones, a, ones, table, accumulate=False
        )
    with pytest.raises(ValueError, match="a must be row-major and b column-major"):
        expert_gemm_kernels.grouped_wgrad_into(
            out, torch.zeros(16, 48, dtype=E4M3).t(), ones, a, ones, table, accumulate=False
        )


def test_the_kernels_run_on_hopper_gpus_only():
    assert not expert_gemm_kernels.kernels_available(torch.device("cpu"))
    if CUDA:
        assert expert_gemm_kernels.kernels_available(torch.device("cuda"))
