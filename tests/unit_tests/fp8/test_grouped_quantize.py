"""`quantize_experts` against each expert's rows quantised alone in plain torch (Transformer
Engine's rules written out: `fp8(clamp(x * scale))`, current scaling's `max / amax` with NaNs
skipped): the bytes in the padded layout (zero rows between experts), the transposed bytes, scale
inverses and recorded absolute maxima, for each format and recipe, with empty experts, counts
that are not multiples of 16 and non-finite values; and `ExpertRows`' device-side maps. (The CUDA
kernel against the CPU path: `test_kernels.py`.)"""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.grouped_gemm import DeviceExpertRows, ExpertRows
from megatron.core.fp8.grouped_quantize import quantize_experts
from tests.unit_tests.fp8.reference import E4M3, E5M2, current_scale, q

COUNTS = [5, 0, 17, 3, 0, 32]
COLS = 48


def _input(counts: list[int], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), COLS, generator=generator)
    x *= 10.0 ** torch.randint(-2, 3, (sum(counts), 1), generator=generator)
    x[3, 4], x[7, 0] = float("nan"), float("inf")  # expert 0's and expert 2's
    return x.to(torch.bfloat16)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_each_expert_is_quantised_as_alone(dtype, delayed):
    rows = ExpertRows(COUNTS)
    x = _input(COUNTS)
    groups = len(COUNTS)
    scales = 2.0 ** torch.arange(-2.0, groups - 2.0) if delayed else None
    records = torch.full((groups,), 0.25)
    cast = quantize_experts(x, rows, dtype, scales=scales, amax_out=records, transpose=True)
    assert cast.data.shape == (rows.padded_rows, COLS) and rows.padded_rows == 16 * 6
    assert cast.transposed.shape == (COLS, rows.padded_rows)
    assert cast.scale_invs.stride() == (4,)  # 16 bytes apart: cuBLASLt's alignment
    expected_records = torch.full((groups,), 0.25)
    blocks = cast.per_expert(cast.data, 0)
    columns = cast.per_expert(cast.transposed, 1)
    for index, part in enumerate(rows.split(x)):
        if part.shape[0] == 0:
            assert blocks[index] is None and columns[index] is None
            assert cast.scale_invs[index] == 1.0
            continue
        no_nan = torch.where(part.isnan(), 0.0, part)  # the amax skips NaNs (TE's fmaxf)
        scale = current_scale(no_nan, dtype) if scales is None else scales[index]
        expected_records[index] = max(expected_records[index], no_nan.float().abs().amax())
        expected = _bytes(q(part, scale, dtype))
        count = part.shape[0]
        block = _bytes(blocks[index].data)
        assert block.shape[0] == rows.padded_counts[index]
        assert torch.equal(block[:count], expected)
        assert not block[count:].any(), "the padding rows are zero bytes"
        column = _bytes(columns[index].data)
        assert torch.equal(column[:, :count], expected.t()) and not column[:, count:].any()
        assert torch.equal(blocks[index].scale_inv, scale.reciprocal().reshape(1))
        assert blocks[index].scale_inv.data_ptr() % 16 == 0, "cuBLASLt reads aligned scales"
    assert torch.equal(records, expected_records)
    assert records[1] == records[4] == 0.25, "an expert without rows records nothing"


def test_each_experts_scale_lies_16_bytes_apart_even_after_a_packing_copy():
    """cuBLASLt reads each per-expert GEMM's scale from a 16-byte aligned address; a saved-tensor
    hook that copies the scales (offloading) packs them 4 bytes apart."""
    rows = ExpertRows(COUNTS)
    cast = quantize_experts(_input(COUNTS), rows, E4M3, transpose=True)
    packed = cast._replace(scale_invs=cast.scale_invs.clone())
    assert packed.scale_invs.stride() == (1,)
    for grouped in (cast, packed):
        parts = [part for part in grouped.per_expert(grouped.data, 0) if part is not None]
        assert all(part.scale_inv.data_ptr() % 16 == 0 for part in parts)
        assert torch.equal(
            torch.cat([part.scale_inv for part in parts]), cast.scale_invs[[0, 2, 3, 5]]
        )


def test_only_the_copies_asked_for_are_made_and_rows_must_match():
    rows = ExpertRows(COUNTS)
    x = _input(COUNTS)
    assert quantize_experts(x, rows, E4M3).transposed is None
    with pytest.raises(ValueError, match=r"one element per expert \(\[6\]\)"):
        quantize_experts(x, rows, E4M3, scales=torch.ones(5))
    with pytest.raises(ValueError, match="x has 57 rows, the experts. counts sum to 58"):
        quantize_experts(x, ExpertRows([*COUNTS[:-1], 33]), E4M3)


def test_no_rows_at_all_make_empty_copies():
    rows = ExpertRows([0, 0])
    cast = quantize_experts(torch.empty(0, COLS), rows, E4M3, transpose=True)
    assert cast.data.shape == (0, COLS) and cast.transposed.shape == (COLS, 0)
    assert cast.scale_invs.tolist() == [1.0, 1.0]


def test_expert_rows_maps_agree_with_the_counts():
    rows = ExpertRows(COUNTS)
    starts, counts, tiles = rows.kernel_table(torch.device("cpu")).view(3, -1).tolist()
    assert (starts, counts) == (rows.starts, COUNTS)
    assert tiles == [start // 16 for start in rows.padded_starts] == [0, 1, 1, 3, 4, 4]
    padded = torch.arange(rows.padded_rows, dtype=torch.float32)[:, None].expand(-1, 2)
    real = torch.cat([padded[s : s + c] for s, c in zip(rows.padded_starts, COUNTS)])
    assert torch.equal(rows.unpad(padded), real)
    assert rows.unpad(padded) is not padded
    unpadded = ExpertRows([16, 0, 32])
    full = torch.zeros(48, 2)
    assert unpadded.unpad(full) is full, "nothing to drop: no copy"


def test_expert_rows_gemm_table_gives_each_experts_first_tile_of_128_rows():
    rows = ExpertRows([130, 0, 5, 256, 0, 257])  # padded: 144, 0, 16, 256, 0, 272
    table = rows.gemm_table(torch.device("cpu")).view(6, -1).tolist()
    assert table[:3] == rows.kernel_table(torch.device("cpu")).view(3, -1).tolist()
    assert table[3] == [144, 144, 160, 416, 416, 688]  # where each expert's padded rows end
    assert table[4] == [144, 0, 16, 256, 0, 272]
    assert table[5] == [0, 2, 2, 3, 5, 5]  # 2, 0, 1, 2, 0 and 3 tiles of up to 128 rows
    assert rows.gemm_tiles == 8


@pytest.mark.parametrize(
    "counts", [[130, 0, 5, 256, 0, 257], [0, 0, 16], [7], [0, 3, 0, 0]], ids=str
)
def test_device_expert_rows_bound_the_host_sizes(counts):
    """The sizes the host reads of counts in a tensor (`DeviceExpertRows`, counts never read)
    bound `ExpertRows`' from above; the table is `ExpertRows`' (on CPU read on the host; the
    GPU's kernel is `test_kernels.py`'s)."""
    host = ExpertRows(counts)
    device = DeviceExpertRows(torch.tensor(counts), sum(counts))
    assert device.rows == host.rows and len(device) == len(host)
    assert host.padded_rows <= device.padded_rows and device.padded_rows % 16 == 0
    assert host.gemm_tiles <= device.gemm_tiles
    assert device.on_host().counts == counts
    cpu = torch.device("cpu")
    assert torch.equal(device.kernel_table(cpu), host.kernel_table(cpu))


def test_device_expert_rows_refuse_other_counts():
    with pytest.raises(ValueError, match="one integer per expert"):
        DeviceExpertRows(torch.tensor([1.0, 2.0]), 3)
    rows = DeviceExpertRows(torch.tensor([1, 2]), 3)
    with pytest.raises(ValueError, match="the counts lie on cpu, the kernels run on meta"):
        rows.gemm_table(torch.device("meta"))


@pytest.mark.parametrize("delayed", [False, True])
def test_a_cast_with_device_rows_is_the_host_rows_cast(delayed):
    """Into buffers of the upper bound of padded rows: the real rows' bytes, scales and
    amaxes are those of the counts on the host; the rest are zeros."""
    x = torch.randn(sum(COUNTS), COLS, generator=torch.Generator().manual_seed(5)) * 3
    scales = torch.tensor([2.0, 3.0, 0.5, 8.0, 1.0, 4.0]) if delayed else None
    amaxes = [torch.zeros(len(COUNTS)) for _ in range(2)]
    host = quantize_experts(
        x, ExpertRows(COUNTS), E4M3, scales=scales, amax_out=amaxes[0], transpose=True
    )
    rows = DeviceExpertRows(torch.tensor(COUNTS), sum(COUNTS))
    device = quantize_experts(x, rows, E4M3, scales=scales, amax_out=amaxes[1], transpose=True)
    real = host.data.shape[0]
    assert device.data.shape == (rows.padded_rows, COLS) and device.rows is rows
    assert torch.equal(device.data[:real].view(torch.uint8), host.data.view(torch.uint8))
    assert not device.data[real:].view(torch.uint8).any()
    assert torch.equal(
        device.transposed[:, :real].view(torch.uint8), host.transposed.view(torch.uint8)
    )
    assert torch.equal(device.scale_invs, host.scale_invs)
    assert torch.equal(amaxes[0], amaxes[1])
