"""The CUDA FP8 casts (`megatron.core.fp8.kernels`) give the reference quantiser's
(`quantize._quantize_reference`) bytes, scale inverse and recorded absolute maximum bit for bit:
`fp8(clamp(x * scale, -max, max))` with the product in fp32, the transposed copy zero-padded to
16 rows, current scaling's scale `max / amax` correctly rounded; and the CPU's results too. So
does the cast of an MoE layer's experts, each with its own scale, in one launch. The
delayed-scaling update's kernel leaves the history and scales its torch ops leave."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8 import grouped_quantize, kernels, quantize
from megatron.core.fp8.expert_gemm_kernels import TILE_ROWS
from megatron.core.fp8.grouped_gemm import ExpertRows
from megatron.core.fp8.grouped_quantize import quantize_experts
from megatron.core.fp8.scaling import update_delayed_scaling
from tests.unit_tests.fp8.reference import plain_amax

pytestmark = pytest.mark.gpu

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SHAPES = [(1, 16), (17, 48), (100, 4096), (1000, 1024), (4096, 1408)]


def _input(shape, dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    # A wide range of magnitudes: some products overflow the FP8 maximum and saturate.
    x = torch.randn(shape, device="cuda", generator=generator) * 10.0 ** torch.randint(
        -3, 4, shape, device="cuda", generator=generator
    )
    return x.to(dtype)


def _bytes(tensor):
    return None if tensor is None else tensor.view(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_cast_is_the_reference_bit_for_bit(fmt, shape, source, delayed):
    dtype = FORMATS[fmt]
    x = _input(shape, source, seed=shape[0] * shape[1])
    # A delayed scale and amax record are views into a state's vectors (0-d, offset).
    scale = torch.tensor([1.0, 3.7], device="cuda")[1] if delayed else None
    amax_kernel = torch.tensor([0.0, 0.5], device="cuda")[1]
    amax_reference = amax_kernel.clone()
    data, scale_inv, transposed = kernels.cast_to_fp8(x, dtype, scale, amax_kernel, transpose=True)
    expected = quantize._quantize_reference(x, dtype, scale, amax_reference, transpose=True)
    assert torch.equal(_bytes(data), _bytes(expected.data))
    assert torch.equal(scale_inv, expected.scale_inv)
    assert torch.equal(_bytes(transposed), _bytes(expected.transposed))
    assert torch.equal(amax_kernel, amax_reference)


def test_quantize_runs_the_kernels_on_cuda_and_the_reference_elsewhere():
    x = _input((40, 64), torch.bfloat16, seed=3)
    on_gpu = quantize.quantize(x, torch.float8_e5m2, transpose=True)
    on_cpu = quantize.quantize(x.cpu(), torch.float8_e5m2, transpose=True)
    assert torch.equal(_bytes(on_gpu.data).cpu(), _bytes(on_cpu.data))
    assert torch.equal(_bytes(on_gpu.transposed).cpu(), _bytes(on_cpu.transposed))
    assert torch.equal(on_gpu.scale_inv.cpu(), on_cpu.scale_inv)


def test_only_the_copies_asked_for_are_made():
    x = _input((33, 64), torch.bfloat16, seed=1)
    data, _, transposed = kernels.cast_to_fp8(
        x, torch.float8_e4m3fn, None, None, rowwise=False, transpose=True
    )
    assert data is None and transposed.shape == (64, 48)
    data, _, transposed = kernels.cast_to_fp8(x, torch.float8_e4m3fn, None, None)
    assert transposed is None and data.shape == (33, 64)


@pytest.mark.parametrize("amax", [0.0, float("inf")])
def test_current_scaling_of_a_zero_or_infinite_maximum_uses_scale_one(amax):
    x = torch.zeros(16, 32, device="cuda")
    x[3, 5] = amax
    _, scale_inv, _ = kernels.cast_to_fp8(x, torch.float8_e4m3fn, None, None)
    assert scale_inv.item() == 1.0


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_nans_stay_nan_and_the_maximum_skips_them_as_the_reference(delayed):
    x = _input((40, 64), torch.bfloat16, seed=5)
    x[0, 0], x[7, 3], x[20, 9] = float("nan"), float("inf"), float("-inf")
    scale = torch.tensor([3.0], device="cuda") if delayed else None
    amax_kernel, amax_reference = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    data, scale_inv, transposed = kernels.cast_to_fp8(
        x, torch.float8_e4m3fn, scale, amax_kernel, transpose=True
    )
    expected = quantize._quantize_reference(
        x, torch.float8_e4m3fn, scale, amax_reference, transpose=True
    )
    assert torch.equal(amax_kernel, amax_reference) and amax_kernel.item() == float("inf")
    assert torch.equal(scale_inv, expected.scale_inv)
    for actual, reference in ((data, expected.data), (transposed, expected.transposed)):
        nan = reference.float().isnan()
        assert torch.equal(actual.float().isnan(), nan) and nan.any()
        assert torch.equal(_bytes(actual)[~nan], _bytes(reference)[~nan])


def test_a_tensor_of_more_than_2_to_the_31_elements_is_cast_whole():
    """64-bit offsets: the last rows land where they belong (32-bit ones wrapped, faulting)."""
    rows, cols = 2**31 // 4096 + 64, 4096
    x = torch.ones(rows, cols, device="cuda", dtype=torch.bfloat16)
    x[-16:] = _input((16, cols), torch.bfloat16, seed=11)
    scale = torch.tensor([2.0], device="cuda")
    data, _, transposed = kernels.cast_to_fp8(x, torch.float8_e4m3fn, scale, None, transpose=True)
    tail = quantize._quantize_reference(x[-16:], torch.float8_e4m3fn, scale, None, True)
    assert torch.equal(_bytes(data[-16:]), _bytes(tail.data))
    assert torch.equal(_bytes(transposed[:, rows - 16 :]), _bytes(tail.transposed))
    one_times_two = torch.tensor(2.0).to(torch.float8_e4m3fn).view(torch.uint8).item()
    for row in (0, rows // 2, rows - 17):  # (a sample: CUB's reductions stop at 2**31)
        assert bool((_bytes(data[row]) == one_times_two).all())


def test_kernels_need_a_cuda_tensor_of_two_dimensions():
    assert kernels.kernels_available(torch.ones(4, 16, device="cuda"))
    assert not kernels.kernels_available(torch.ones(4, 16))
    assert not kernels.kernels_available(torch.ones(2, 4, 16, device="cuda"))


@pytest.mark.parametrize(
    "shape",
    [(1, 16), (17, 48), (100, 4096), (4096, 14336), (130, 70), (64, 1408, 2048), (3, 130, 70)],
    ids=str,
)
def test_transpose_is_torchs_transpose_bit_for_bit(shape):
    """Of a matrix, and of a stack of them (an MoE projection's expert weights)."""
    data = _input(shape, torch.float32, seed=7).to(torch.float8_e4m3fn)
    transposed = kernels.transpose_fp8(data)
    assert transposed.shape == (*shape[:-2], shape[-1], shape[-2]) and transposed.is_contiguous()
    assert torch.equal(_bytes(transposed), _bytes(data.transpose(-2, -1).contiguous()))


@pytest.mark.parametrize("rounding", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_cast_through_a_rounding_is_the_cast_of_the_rounded_copy(rounding):
    """The weights' cast from fp32 main weights: the bytes of `x.to(rounding)`'s cast, written
    into a given tensor; and the amax kernel's record is the reference's."""
    x = _input((300, 272), torch.float32, seed=11)
    x[0, :16] = 1.0625 + 2.0**-20  # an E4M3 tie once rounded to bf16 or fp16: to 1.0
    scale = torch.tensor([0.0, 1.0], device="cuda")[1:]
    out = torch.empty(300, 272, dtype=torch.float8_e4m3fn, device="cuda")
    cast = quantize.quantize(x, torch.float8_e4m3fn, scale=scale, rounding=rounding, out=out)
    expected = quantize._quantize_reference(x.to(rounding), torch.float8_e4m3fn, scale, None, False)
    assert cast.data is out
    assert torch.equal(_bytes(out), _bytes(expected.data))
    assert (out[0, :16].float() == (1.125 if rounding == torch.float32 else 1.0)).all()
    amax = torch.zeros(1, device="cuda")
    quantize.record_amax(x, amax)
    assert torch.equal(amax, quantize.amax_of(x).reshape(1))


@pytest.mark.parametrize("shape", [(1, 300, 272), (6, 16, 48), (64, 176, 128)], ids=str)
def test_the_amax_kernel_records_each_experts_maximum_into_its_slot(shape):
    """Stacked expert weights, one slot per expert (one launch), against the torch reference:
    a NaN skipped, an expert far smaller than the others, a slot already above its expert."""
    x = _input(shape, torch.float32, seed=13)
    x.view(-1)[5] = float("nan")
    x[-1] *= 2.0**-20
    slots = torch.zeros(shape[0], device="cuda")
    slots[0] = 1e6
    expected = slots.clone()
    assert kernels.amax_kernel_available(x, slots)
    quantize.record_amax(x, slots)
    for expert in range(shape[0]):
        expected[expert] = torch.maximum(expected[expert], plain_amax(x[expert]))
    assert torch.equal(slots, expected)


@pytest.mark.parametrize("rows", [1, 2, 5, 1024])
@pytest.mark.parametrize("cols", [1, 7, 300])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("scaled_max", [448.0, 57344.0 * 2.0**-2, 448.0 * 2.0**-7])
def test_scale_update_is_the_torch_update(rows, cols, algo, scaled_max):
    """The delayed-scaling update on the GPU (its kernel, `kernels.update_scales`) leaves the
    amax history and scales that its torch ops leave on the CPU, bit for bit: amaxes of zero
    (unused slots), NaN, infinity and subnormals (whose scales overflow to the largest fp32,
    or at a margin of 7 one does not: the kernel's division keeps subnormals) among random
    ones."""
    generator = torch.Generator().manual_seed(rows * 1000 + cols)
    history = torch.rand(rows, cols, generator=generator) * 10
    specials = torch.tensor([0.0, 0.0, float("nan"), float("inf"), 1e-44, 1.1e-38])
    picks = torch.randint(0, 3 * len(specials), (rows, cols), generator=generator)
    special = picks < len(specials)
    history[special] = specials[picks[special]]
    scale = torch.rand(cols, generator=generator) + 0.5
    expected_history, expected_scale = history.clone(), scale.clone()
    update_delayed_scaling(expected_history, expected_scale, scaled_max, algo)
    got_history, got_scale = history.cuda(), scale.cuda()
    assert kernels.updates_scales(got_history, got_scale)
    update_delayed_scaling(got_history, got_scale, scaled_max, algo)
    assert torch.equal(_bits(got_history), _bits(expected_history))
    assert torch.equal(_bits(got_scale), _bits(expected_scale))


def _bits(tensor):
    return tensor.cpu().view(torch.int32)


EXPERT_COUNTS = {
    "few": [5, 0, 17, 3, 0, 32],
    "64 experts": [0, 1, 15, 16, 17, 31, 33, 0] * 4 + [384] * 31 + [0],
    "one": [100],
}


@pytest.mark.parametrize("cols", [48, 1408, 2048 + 16])
@pytest.mark.parametrize("counts", EXPERT_COUNTS.values(), ids=EXPERT_COUNTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_experts_cast_is_the_reference_bit_for_bit(cols, counts, fmt, delayed):
    """`kernels.cast_experts_to_fp8` (one launch for all experts) gives the bytes, transposed
    bytes, scale inverses and records of `quantize` on each expert's rows (the reference loop of
    `grouped_quantize`), non-finite values included."""
    dtype, groups = FORMATS[fmt], len(counts)
    rows = ExpertRows(counts)
    x = _input((rows.rows, cols), torch.bfloat16, seed=groups * cols)
    x[0, 3], x[-1, 1] = float("nan"), float("inf")
    scales = torch.rand(groups, device="cuda") * 4 + 0.5 if delayed else None
    records = {name: torch.full((groups,), 0.5, device="cuda") for name in ("kernel", "loop")}
    assert kernels.kernels_available(x)
    cast = quantize_experts(
        x, rows, dtype, scales=scales, amax_out=records["kernel"], transpose=True
    )
    loop = grouped_quantize._quantize_experts_reference(
        x, rows, dtype, scales, records["loop"], True, torch.ones(groups, device="cuda")
    )
    for actual, reference in ((cast.data, loop.data), (cast.transposed, loop.transposed)):
        nan = reference.float().isnan()
        assert torch.equal(actual.float().isnan(), nan)
        assert torch.equal(_bytes(actual)[~nan], _bytes(reference)[~nan])
    assert torch.equal(cast.scale_invs, loop.scale_invs)
    assert torch.equal(records["kernel"], records["loop"])
    on_cpu = quantize_experts(x.cpu(), rows, dtype, scales=None if scales is None else scales.cpu())
    nan = on_cpu.data.float().isnan()
    assert torch.equal(_bytes(cast.data).cpu()[~nan], _bytes(on_cpu.data)[~nan])


@pytest.mark.parametrize("groups", [1, 4, 64, 300])
def test_the_rows_table_kernel_makes_the_host_table(groups):
    """`DeviceExpertRows`' table in one launch from counts on the GPU (int64, as a routing
    map's sums, and int32): `ExpertRows`' entry for entry, experts without rows included."""
    counts = torch.randint(0, 700, (groups,), generator=torch.Generator().manual_seed(groups))
    counts[::5] = 0
    expected = ExpertRows(counts.tolist()).gemm_table(torch.device("cpu"))
    for dtype in (torch.int64, torch.int32):
        table = kernels.expert_rows_table(counts.to("cuda", dtype), TILE_ROWS)
        assert torch.equal(table.cpu(), expected)
