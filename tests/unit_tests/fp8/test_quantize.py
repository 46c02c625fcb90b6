"""The reference quantisers against their formulas: scales from amaxes (Transformer Engine's
rules for 0, inf and NaN), saturation at the FP8 range, the recorded amax, and the zero-padded
transposed copy."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.quantize import (
    FLT_MAX,
    compute_scale,
    quantize,
    record_amax,
    transpose_padded,
)
from tests.unit_tests.fp8.reference import E4M3, E5M2, current_scale, plain_amax, q


@pytest.mark.parametrize("dtype, max_value", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_scale_from_amax_follows_transformer_engines_rules(dtype, max_value):
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-45, 448.0])
    scale = compute_scale(amax, max_value)
    expected = torch.tensor(
        [max_value / 2.0, 1.0, 1.0, 1.0, FLT_MAX, max_value / 448.0], dtype=torch.float32
    )
    assert torch.equal(scale, expected)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_current_scaling_casts_with_the_tensors_own_amax(dtype, source):
    x = (torch.randn(37, 48) * 3).to(source)
    x[5, 7] = -1e-9  # a tiny value: a subnormal or zero after scaling
    out = quantize(x, dtype)
    scale = current_scale(x, dtype)
    assert out.data.dtype == dtype and out.transposed is None
    assert torch.equal(out.data.view(torch.uint8), q(x, scale, dtype).view(torch.uint8))
    assert torch.equal(out.scale_inv, scale.reciprocal())
    # The largest magnitude maps to the format's largest value.
    assert out.data.float().abs().max() == torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_given_scale_saturates_at_the_formats_range(dtype):
    """Delayed scaling casts with an old scale: values beyond the range clamp to +-max (the
    E4M3 cast alone would give NaN on CUDA torch 2.11), NaN stays NaN."""
    limit = torch.finfo(dtype).max
    x = torch.tensor([[1.0, -1.0, 1e6, -1e6, float("inf"), float("nan")] + [0.0] * 10])
    out = quantize(x, dtype, scale=torch.tensor([4.0]))
    values = out.data.float()[0]
    assert values[:4].tolist() == [4.0, -4.0, limit, -limit]
    assert values[4] == limit and torch.isnan(values[5])


def test_the_amax_is_maxed_into_the_record():
    record = torch.tensor([3.0])
    quantize(torch.tensor([[1.0, -2.5]]), E4M3, scale=torch.ones(1), amax_out=record)
    assert record.item() == 3.0
    quantize(torch.tensor([[1.0, -7.5]]), E4M3, scale=torch.ones(1), amax_out=record)
    assert record.item() == 7.5


def test_an_amax_per_segment_is_maxed_into_each_slot():
    """Stacked expert weights `[k, out, in]` into `k` slots: each expert's `max |w|` (NaNs
    skipped) max-ed into its own slot."""
    weights = torch.randn(3, 16, 8)
    weights[1, 2, 3] = float("nan")
    weights[2] *= 1e-3
    slots = torch.tensor([0.0, 1e3, 0.5])
    record_amax(weights, slots)
    plain = [plain_amax(w) for w in weights]
    expected = [plain[0], torch.tensor(1e3), torch.clamp(plain[2], min=0.5)]
    assert torch.equal(slots, torch.stack(expected))
    with pytest.raises(ValueError, match="384 elements do not split into 5 equal segments"):
        record_amax(weights, torch.zeros(5))


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_the_transposed_copy_is_padded_with_zero_columns(rows):
    x = torch.randn(rows, 32)
    out = quantize(x, E5M2, transpose=True)
    padded = -(-rows // 16) * 16
    assert out.transposed.shape == (32, padded) and out.transposed.is_contiguous()
    assert torch.equal(out.transposed[:, :rows].view(torch.uint8), out.data.t().view(torch.uint8))
    assert not out.transposed[:, rows:].view(torch.uint8).any()
    again = transpose_padded(out.data)
    assert torch.equal(again.view(torch.uint8), out.transposed.view(torch.uint8))


def test_a_cast_through_a_rounding_into_a_given_tensor():
    """CPU: `rounding` casts the rounded copy, `out` receives the bytes. 1.0625 + 2**-20 casts
    to E4M3's 1.125 directly, but rounds to bf16's 1.0625 first, an E4M3 tie that goes to
    1.0 (even)."""
    x = torch.full((16, 16), 1.0625 + 2.0**-20)
    scale = torch.ones(1)
    out = torch.empty(16, 16, dtype=torch.float8_e4m3fn)
    cast = quantize(x, torch.float8_e4m3fn, scale=scale, rounding=torch.bfloat16, out=out)
    assert cast.data is out
    assert (out.float() == 1.0).all()
    assert (quantize(x, torch.float8_e4m3fn, scale=scale).data.float() == 1.125).all()
