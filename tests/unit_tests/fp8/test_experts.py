"""The FP8 experts' three GEMMs against a plain-torch reference that quantises each expert's
input, output gradient and weight with the same scales (cast and dequantise, multiply in fp32),
for each format and recipe, one GEMM per expert and grouped; token counts with empty experts and
counts that are not multiples of 16; the delayed-scaling slots of each global expert; weight
gradients fused into an engine's `main_grad`.

The grouped kernels have no CPU implementation: the grouped paths run here against stand-ins.
PyTorch's (`torch._scaled_grouped_mm`) checks its operands with PyTorch's own shape and layout
checks (its meta kernel) and computes each group as the kernel does (row-wise scales), leaving
what the kernel does not write (an empty group of the weight gradient) as NaN. The Triton ones
(`expert_gemm_kernels`, checked against a reference on GPUs in `test_expert_gemm_kernels.py`)
read each expert's rows from the table the kernels read, and leave the rows they do not write as
NaN."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8 import expert_gemm_kernels, experts, grouped_gemm
from megatron.core.fp8.experts import (
    ExpertGemm,
    ExpertGemms,
    Fp8ExpertSlots,
    describe_expert_gemms,
)
from megatron.core.fp8.grouped_gemm import DeviceExpertRows, ExpertRows, fp8_grouped_mm
from megatron.core.fp8.grouped_quantize import quantize_experts
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.scaling import DelayedScalingState
from megatron.core.fp8.weights import Fp8ExpertWeights, Fp8Weight, fp8_weight_of
from megatron.core.tensor_parallel.grad_accumulation import FusionTarget, register_main_grad
from tests.unit_tests.fp8.reference import E4M3, current_scale, dq, exact_cpu_scaled_mm, mm, q

BF16 = torch.bfloat16
EXPERTS, FIRST, LOCAL = 6, 2, 4
"""Global experts, this rank's first, this rank's count (as at EP 3 of 6 experts, rank 1)."""
COUNTS = [5, 0, 17, 3]
"""Tokens per local expert: an empty expert, and counts that are not multiples of 16."""
IN, OUT = 32, 48


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, **kwargs):
    """`torch._scaled_grouped_mm` on CPU: PyTorch's checks of the operands (the meta kernel),
    then each group dequantised with its row-wise scales and multiplied in fp32."""
    torch._scaled_grouped_mm(
        _meta(a), _meta(b), _meta(scale_a), _meta(scale_b), offs=_meta(offs), out_dtype=out_dtype
    )
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # rows grouped
        out = torch.empty(a.shape[0], b.shape[2], dtype=out_dtype)
        for group, (start, end) in enumerate(zip(starts, ends)):
            rows = dq(a[start:end], scale_a[start:end, None])
            out[start:end] = (rows @ dq(b[group], scale_b[group][None, :])).to(out_dtype)
        return out
    n, k = a.shape[0], b.shape[1]
    out = torch.full((len(ends), n, k), float("nan"), dtype=out_dtype)  # empty groups: unwritten
    for group, (start, end) in enumerate(zip(starts, ends)):
        if end > start:
            left = dq(a[:, start:end], scale_a[group * n : (group + 1) * n, None])
            right = dq(b[start:end], scale_b[group * k : (group + 1) * k][None, :])
            out[group] = (left @ right).to(out_dtype)
    return out


@pytest.fixture
def grouped_kernel(monkeypatch):
    """The grouped path on CPU, through `emulated_scaled_grouped_mm`."""
    monkeypatch.setattr(grouped_gemm, "_scaled_grouped_mm", emulated_scaled_grouped_mm)
    monkeypatch.setattr(grouped_gemm, "grouped_kernel_available", lambda device: True)


def _expert_blocks(table: torch.Tensor, groups: int, tiles: int | None = None):
    """Each expert's (first padded row, padded rows) as the Triton kernels read them from
    `ExpertRows.gemm_table`, whose tiles of 128 rows are checked against `tiles` (the grid's:
    at least theirs, as `DeviceExpertRows`' upper bound; the programs past them exit)."""
    _, _, firsts, _, padded, tile_starts = table.view(6, groups).tolist()
    if tiles is not None:
        counts = [-(-count // expert_gemm_kernels.TILE_ROWS) for count in padded]
        assert tile_starts == [sum(counts[:index]) for index in range(groups)]
        assert tiles >= sum(counts)
    return [(first * 16, count) for first, count in zip(firsts, padded)]


def emulated_grouped_mm(
    a, a_scale_invs, b, b_scale_invs, table, tiles, *, out_dtype, real_rows=None, **kwargs
):
    """`expert_gemm_kernels.grouped_mm` on CPU: each expert's dequantised rows times its
    dequantised weight in fp32 (its real rows alone, back to back, given `real_rows`)."""
    groups = b.shape[0]
    out_rows = a.shape[0] if real_rows is None else real_rows
    out = torch.full((out_rows, b.shape[2]), float("nan"), dtype=out_dtype)
    real_starts, real_counts = table[: 2 * groups].long().view(2, groups)
    for expert, (first, count) in enumerate(_expert_blocks(table, groups, tiles)):
        rows = slice(first, first + count)
        product = mm(dq(a[rows], a_scale_invs[expert]), dq(b[expert], b_scale_invs[expert]))
        if real_rows is None:
            out[rows] = product.to(out_dtype)
        else:
            start, count = int(real_starts[expert]), int(real_counts[expert])
            out[start : start + count] = product[:count].to(out_dtype)
    return out


def emulated_grouped_wgrad_into(out, a, a_scale_invs, b, b_scale_invs, table, *, accumulate):
    """`expert_gemm_kernels.grouped_wgrad_into` on CPU: each expert's sum in fp32, added to
    its gradient in fp32 (`accumulate`) and rounded once."""
    for expert, (first, count) in enumerate(_expert_blocks(table, out.shape[0])):
        rows = slice(first, first + count)
        product = mm(dq(a[:, rows], a_scale_invs[expert]), dq(b[rows], b_scale_invs[expert]))
        if accumulate:
            product = out[expert].float() + product if count else out[expert]
        out[expert] = product.to(out.dtype)


@pytest.fixture
def triton_kernels(monkeypatch) -> list[str]:
    """The Triton grouped GEMMs on CPU, through the emulations above: the names of the kernels
    called, in order."""
    calls = []

    def recording(kernel):
        def call(*args, **kwargs):
            calls.append(kernel.__name__)
            return kernel(*args, **kwargs)

        return call

    monkeypatch.setattr(expert_gemm_kernels, "kernels_available", lambda device: True)
    monkeypatch.setattr(expert_gemm_kernels, "grouped_mm", recording(emulated_grouped_mm))
    monkeypatch.setattr(
        expert_gemm_kernels, "grouped_wgrad_into", recording(emulated_grouped_wgrad_into)
    )
    return calls


def _slots(fmt: str, kind: str, wgrad: bool = True, graphed: bool = False) -> Fp8ExpertSlots:
    """The settings of local experts FIRST.. of EXPERTS; under delayed scaling the slots of
    global expert g scaled 2 + g (inputs) and 2**10 * (g + 1) (output gradients)."""
    recipe = Fp8Recipe(fmt, kind, wgrad=wgrad)
    experts = dict(
        num_experts=EXPERTS, first_expert=FIRST, num_local_experts=LOCAL, graphed=graphed
    )
    if kind == "tensorwise":
        return Fp8ExpertSlots(recipe, **experts)
    state = DelayedScalingState(recipe, group=None)
    slots = Fp8ExpertSlots(recipe, state, **experts)
    state.load_scaling_tensors(
        {
            "amax_history_fwd": torch.zeros(1, EXPERTS),
            "scale_fwd": 2.0 + torch.arange(EXPERTS, dtype=torch.float32),
            "amax_history_bwd": torch.zeros(1, EXPERTS),
            "scale_bwd": 2.0**10 * (1 + torch.arange(EXPERTS, dtype=torch.float32)),
        }
    )
    return slots


def _case(seed: int = 0):
    """bf16 stacked weights [LOCAL, OUT, IN], input [sum(COUNTS), IN], output gradient."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(LOCAL, OUT, IN, generator=generator)
    weight = torch.nn.Parameter(
        (weight * torch.tensor([1.0, 3.0, 0.1, 10.0])[:, None, None]).to(BF16)
    )
    rows = sum(COUNTS)
    x = (torch.randn(rows, IN, generator=generator) * 2).to(BF16).requires_grad_()
    grad = (torch.randn(rows, OUT, generator=generator) * 1e-3).to(BF16)
    return weight, x, grad


def _reference(slots: Fp8ExpertSlots, weight, x, grad):
    """(y, dx, dw) of every expert with its scales, in the plain-torch arithmetic; dw in fp32."""
    bwd = slots.recipe.backward_dtype
    ys, dxs, dws = [], [], []
    for index, (x_e, g_e) in enumerate(zip(x.detach().split(COUNTS), grad.split(COUNTS))):
        expert = FIRST + index
        if not x_e.numel():
            ys.append(x_e.new_empty(0, OUT))
            dxs.append(x_e.new_empty(0, IN))
            dws.append(torch.zeros(OUT, IN))
            continue
        if slots.state is None:
            sx, sg = current_scale(x_e, E4M3), current_scale(g_e, bwd)
        else:
            sx, sg = torch.tensor(2.0 + expert), torch.tensor(2.0**10 * (expert + 1))
        sw = current_scale(weight[index], E4M3)
        wd = dq(q(weight[index], sw, E4M3), sw.reciprocal())
        xd = dq(q(x_e, sx, E4M3), sx.reciprocal())
        gd = dq(q(g_e, sg, bwd), sg.reciprocal())
        ys.append((xd @ wd.t()).to(BF16))
        dxs.append((gd @ wd).to(BF16))
        dws.append(gd.t() @ xd)
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def _run(slots, weight, x, grad, grouped: bool, counts: list[int] | torch.Tensor = COUNTS):
    x.grad = weight.grad = None
    y = slots.experts_linear(x, weight, counts, grouped=grouped)
    y.backward(grad)
    return y, x.grad, weight.grad


@exact_cpu_scaled_mm
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_three_gemms_of_each_expert_equal_the_reference(fmt, kind):
    slots = _slots(fmt, kind)
    weight, x, grad = _case()
    y, dx, dw = _run(slots, weight, x, grad, grouped=False)
    expected_y, expected_dx, expected_dw = _reference(slots, weight, x, grad)
    assert torch.equal(y, expected_y)
    assert torch.equal(dx, expected_dx)
    assert torch.equal(dw, expected_dw.to(BF16))
    assert not dw[1].any()  # the expert without tokens
    if kind == "delayed":  # this pass's amaxes, in the slots of this rank's global experts
        state = slots.state.scaling_tensors()
        for name, tensor in (("amax_history_fwd", x.detach()), ("amax_history_bwd", grad)):
            expected = torch.zeros(EXPERTS)
            for index, part in enumerate(tensor.split(COUNTS)):
                if part.numel():
                    expected[FIRST + index] = part.abs().max().float()
            assert torch.equal(state[name][0], expected), name


@exact_cpu_scaled_mm
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_grouped_gemms_equal_one_gemm_per_expert(fmt, kind, grouped_kernel):
    """Through the grouped kernel where it applies (every GEMM under e4m3, the forward under
    hybrid): the same outputs and gradients as the per-expert loop, bit for bit."""
    slots = _slots(fmt, kind)
    weight, x, grad = _case()
    gemms = ExpertGemms.where_possible(slots.recipe, x.device, x.dtype)
    scaled = ExpertGemm.SCALED_GROUPED_MM
    backward = scaled if fmt == "e4m3" else ExpertGemm.PER_EXPERT
    assert gemms == ExpertGemms(fprop=scaled, dgrad=backward, wgrad=backward)
    loop = _run(slots, weight, x, grad, grouped=False)
    grouped = _run(_slots(fmt, kind), weight, x, grad, grouped=True)
    for a, b in zip(loop, grouped):
        assert torch.equal(a, b)


def test_grouped_path_calls_the_kernel(grouped_kernel, monkeypatch):
    """Under e4m3 each of the three GEMMs goes through one grouped call; its per-group sizes are
    the padded counts."""
    calls = []

    def recording(a, b, scale_a, scale_b, offs=None, **kwargs):
        calls.append((b.dim(), offs.tolist()))
        return emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, **kwargs)

    monkeypatch.setattr(grouped_gemm, "_scaled_grouped_mm", recording)
    weight, x, grad = _case()
    _run(_slots("e4m3", "tensorwise"), weight, x, grad, grouped=True)
    assert calls == [(3, [16, 16, 48, 64])] * 2 + [(2, [16, 16, 48, 64])]


@exact_cpu_scaled_mm
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_triton_gemms_equal_one_gemm_per_expert(fmt, kind, grouped_kernel, triton_kernels):
    """Where the Triton kernels run, they run every GEMM, PyTorch's grouped GEMM none: the
    outputs and gradients of the per-expert loop, bit for bit, and its fp32 main_grads, written
    over or added to."""
    weight, x, grad = _case()
    gemms = ExpertGemms.where_possible(_slots(fmt, kind).recipe, x.device, x.dtype)
    triton = ExpertGemm.TRITON
    assert gemms == ExpertGemms(fprop=triton, dgrad=triton, wgrad=triton)
    loop = _run(_slots(fmt, kind), weight, x, grad, grouped=False)
    assert triton_kernels == []
    grouped = _run(_slots(fmt, kind), weight, x, grad, grouped=True)
    assert triton_kernels == ["emulated_grouped_mm"] * 2 + ["emulated_grouped_wgrad_into"]
    for a, b in zip(loop, grouped):
        assert torch.equal(a, b)
    for overwrite in (True, False):
        main_grads = []
        for grouped in (False, True):
            engine = _Engine(weight, torch.float32, overwrite)
            register_main_grad(weight, engine.main_grad_of)
            _run(_slots(fmt, kind), weight, x, grad, grouped=grouped)
            main_grads.append(engine.main_grad)
        assert torch.equal(*main_grads)
        assert torch.equal(main_grads[1][1], torch.full((OUT, IN), 0.0 if overwrite else 0.5))


@exact_cpu_scaled_mm
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_counts_on_the_device_give_the_host_counts_results(
    fmt, kind, grouped_kernel, triton_kernels, monkeypatch
):
    """Counts in a tensor (`DeviceExpertRows`): the Triton GEMMs read the table made from
    them, over grids sized by upper bounds, and the outputs and gradients are the plain-torch
    reference's, and the fp32 main_grads (written over or added to) those of the counts on the
    host, bit for bit. Where a GEMM splits the rows per expert (no grouping), the counts are
    read on the host."""
    weight, x, grad = _case()
    tiles = []

    def grouped_mm(*args, **kwargs):
        tiles.append(args[5])
        return emulated_grouped_mm(*args, **kwargs)

    monkeypatch.setattr(expert_gemm_kernels, "grouped_mm", grouped_mm)
    on_device = torch.tensor(COUNTS)
    host = _run(_slots(fmt, kind), weight, x, grad, grouped=True)
    device = _run(_slots(fmt, kind), weight, x, grad, grouped=True, counts=on_device)
    for a, b in zip(host, device):
        assert torch.equal(a, b)
    expected_y, expected_dx, expected_dw = _reference(_slots(fmt, kind), weight, x, grad)
    assert torch.equal(device[0], expected_y) and torch.equal(device[1], expected_dx)
    assert torch.equal(device[2], expected_dw.to(BF16))
    bound = DeviceExpertRows(on_device, sum(COUNTS)).gemm_tiles
    assert tiles == [ExpertRows(COUNTS).gemm_tiles] * 2 + [bound] * 2 and bound > tiles[0]
    per_expert = _run(_slots(fmt, kind), weight, x, grad, grouped=False, counts=on_device)
    for a, b in zip(host, per_expert):
        assert torch.equal(a, b)
    none = torch.zeros(LOCAL, dtype=torch.int64)  # no token at all: zero gradients
    empty = x[:0].detach().requires_grad_()
    y, dx, dw = _run(_slots(fmt, kind), weight, empty, grad[:0], grouped=True, counts=none)
    assert y.shape == (0, OUT) and dx.shape == (0, IN) and not dw.any()
    for overwrite in (True, False):
        main_grads = []
        for counts in (COUNTS, on_device):
            engine = _Engine(weight, torch.float32, overwrite)
            register_main_grad(weight, engine.main_grad_of)
            _run(_slots(fmt, kind), weight, x, grad, grouped=True, counts=counts)
            main_grads.append(engine.main_grad)
        assert torch.equal(*main_grads)


@exact_cpu_scaled_mm
@pytest.mark.parametrize("large", [False, True], ids=["triton", "one-gemm-per-expert"])
def test_device_counts_of_an_input_with_padding_rows_give_the_real_rows_results(
    large, grouped_kernel, triton_kernels, monkeypatch
):
    """Counts on the device that sum to less than the input's rows (a WORST_CASE dispatch's
    padding after them): the real rows' outputs and input gradients, and the weight gradient,
    are those of the unpadded input bit for bit, whether the Triton GEMMs read the table (the
    padding's never read, its outputs unspecified) or, for experts large enough to run one GEMM
    per expert, the counts are read on the host and the padding rows dropped (zeros out)."""
    if large:
        monkeypatch.setattr(experts, "PER_EXPERT_FROM_FLOPS", 0.0)
    weight, x, grad = _case()
    real, padding = sum(COUNTS), 7

    def noise(width: int) -> torch.Tensor:
        # Finite and large: a padding row read by the amax (current scaling) would change the
        # last expert's scale, so its real rows' results; the NaN row would spread if multiplied.
        rows = torch.full((padding, width), 3e4, dtype=BF16)
        rows[0] = float("nan")
        return rows

    padded_x = torch.cat([x.detach(), noise(IN)]).requires_grad_()
    padded_grad = torch.cat([grad, noise(OUT)])
    slots = _slots("hybrid", "tensorwise")
    expected_y, expected_dx, expected_dw = _reference(slots, weight, x, grad)
    y, dx, dw = _run(slots, weight, padded_x, padded_grad, True, torch.tensor(COUNTS))
    assert y.shape == (real + padding, OUT) and dx.shape == (real + padding, IN)
    assert torch.equal(y[:real], expected_y) and torch.equal(dx[:real], expected_dx)
    assert torch.equal(dw, expected_dw.to(BF16))
    triton = ["emulated_grouped_mm"] * 2 + ["emulated_grouped_wgrad_into"]
    assert triton_kernels == ([] if large else triton)
    if large:
        assert not y[real:].any() and not dx[real:].any()


@pytest.mark.parametrize("grouped", [False, True])
def test_each_pass_quantises_all_experts_rows_at_once(grouped, grouped_kernel, monkeypatch):
    """One `quantize_experts` call per pass (the input in forward, the output gradient in
    backward), whatever the number of experts: their host work does not grow with it."""
    calls = []

    def recording(x, rows, dtype, **kwargs):
        calls.append((list(rows.counts), dtype, kwargs["transpose"]))
        return quantize_experts(x, rows, dtype, **kwargs)

    monkeypatch.setattr(experts, "quantize_experts", recording)
    weight, x, grad = _case()
    _run(_slots("hybrid", "delayed"), weight, x, grad, grouped=grouped)
    assert calls == [(COUNTS, E4M3, True), (COUNTS, torch.float8_e5m2, True)]


class _Engine:
    """Stands for a data-parallel engine that keeps main gradients of `dtype`."""

    def __init__(self, weight: torch.nn.Parameter, dtype: torch.dtype, overwrite: bool):
        self.main_grad = torch.full(weight.shape, 0.5, dtype=dtype)
        self.overwrite = overwrite

    def main_grad_of(self, param: torch.nn.Parameter) -> FusionTarget:
        return FusionTarget(self.main_grad, self.overwrite)


@exact_cpu_scaled_mm
@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("grouped", [False, True])
def test_weight_gradient_is_fused_into_main_grad(overwrite, grouped, grouped_kernel):
    """Into an fp32 main_grad (one GEMM per expert, unrounded): written over, the expert without
    tokens zeroed, or added to; into a bf16 one through the grouped kernel under e4m3."""
    weight, x, grad = _case()
    for dtype in (torch.float32, BF16):
        engine = _Engine(weight, dtype, overwrite)
        register_main_grad(weight, engine.main_grad_of)
        slots = _slots("e4m3", "tensorwise")
        _, _, dw = _run(slots, weight, x, grad, grouped=grouped)
        _, _, expected = _reference(slots, weight, x, grad)
        assert dw is None
        expected = expected.to(dtype)
        assert torch.equal(engine.main_grad, expected if overwrite else expected + 0.5)


def test_no_fp8_wgrad_computes_each_experts_weight_gradient_in_high_precision():
    weight, x, grad = _case()
    _, _, dw = _run(_slots("hybrid", "delayed", wgrad=False), weight, x, grad, grouped=False)
    expected = [g.t() @ x_e for g, x_e in zip(grad.split(COUNTS), x.detach().split(COUNTS))]
    assert torch.equal(dw, torch.stack(expected))


def test_no_tokens_at_all_still_gives_every_expert_a_zero_gradient():
    """A rank whose experts got no token: an empty output, and zero weight gradients (its
    engine's reductions still run)."""
    slots = _slots("hybrid", "tensorwise")
    weight, _, _ = _case()
    x = torch.zeros(0, IN, dtype=BF16, requires_grad=True)
    y = slots.experts_linear(x, weight, [0] * LOCAL, grouped=False)
    assert y.shape == (0, OUT)
    y.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_expert_weights_are_scaled_per_expert_and_cached():
    weight, _, _ = _case()
    copy = fp8_weight_of(weight)
    assert isinstance(copy, Fp8ExpertWeights) and fp8_weight_of(weight) is copy
    for index in range(LOCAL):
        scale = current_scale(weight[index], E4M3)
        assert torch.equal(
            copy[index].tensor.data.view(torch.uint8),
            q(weight[index], scale, E4M3).view(torch.uint8),
        )
        assert torch.equal(copy[index].tensor.scale_inv, scale.reciprocal().reshape(1))
        assert copy[index].tensor.scale_inv.data_ptr() % 16 == 0, "cuBLASLt's alignment"
    assert torch.equal(copy.scale_invs(), torch.cat([e.tensor.scale_inv for e in copy.experts]))
    dgrad = copy.grouped_dgrad_operand()
    assert dgrad.shape == (LOCAL, OUT, IN) and dgrad.stride()[1:] == (1, OUT)
    assert torch.equal(dgrad.float(), copy.data.float())
    for index, transposed in enumerate(copy.transposes()):  # one copy, held by every expert
        assert copy[index].dgrad_operand().data.data_ptr() == transposed.data_ptr()
    with torch.no_grad():
        weight.mul_(2)
    assert fp8_weight_of(weight) is not copy


@exact_cpu_scaled_mm
def test_per_expert_input_gradients_transpose_the_weights_once(monkeypatch):
    """`hybrid`'s input gradient runs one GEMM per expert, each multiplying by its expert's
    transposed weight: all of them are made at once, none by an expert alone."""

    def refused(self):
        raise AssertionError("an expert's weight was transposed alone")

    monkeypatch.setattr(Fp8Weight, "_transpose", refused)
    slots = _slots("hybrid", "tensorwise")
    weight, x, grad = _case()
    _, dx, _ = _run(slots, weight, x, grad, grouped=False)
    assert torch.equal(dx, _reference(slots, weight, x, grad)[1])


def test_expert_weights_need_output_features_in_multiples_of_16():
    with pytest.raises(ValueError, match="24 output features must be a multiple of 16"):
        Fp8ExpertWeights.quantized(torch.randn(2, 24, 32, dtype=BF16))


def test_the_grouped_gemm_refuses_what_the_kernel_refuses():
    rows = ExpertRows([16])
    a = torch.zeros(16, 32, dtype=E4M3)
    b = torch.zeros(1, 48, 32, dtype=E4M3).transpose(1, 2)
    ones = torch.ones(1)
    with pytest.raises(ValueError, match="E4M3 operands only"):
        fp8_grouped_mm(a.to(torch.float8_e5m2), ones, b, ones, rows)
    with pytest.raises(ValueError, match="column-major"):
        fp8_grouped_mm(a, ones, b.contiguous(), ones, rows)
    with pytest.raises(ValueError, match=r"expected \[32, 32\] \(the padded rows"):
        fp8_grouped_mm(a, ones, b, ones, ExpertRows([17]))


def test_slots_of_delayed_scaling_are_one_per_global_expert():
    """Every rank makes the slots of all experts (the state's shape does not depend on the
    expert-parallel size) and uses those of its own."""
    recipe = Fp8Recipe("hybrid", "delayed")
    state = DelayedScalingState(recipe, group=None)
    fc1 = Fp8ExpertSlots(recipe, state, num_experts=4, first_expert=2, num_local_experts=2)
    fc2 = Fp8ExpertSlots(recipe, state, num_experts=4, first_expert=2, num_local_experts=2)
    assert (list(fc1.input_slots), list(fc1.grad_slots)) == ([2, 3], [2, 3])
    assert (list(fc2.input_slots), list(fc2.grad_slots)) == ([6, 7], [6, 7])
    with pytest.raises(ValueError, match="not among the 4 experts"):
        Fp8ExpertSlots(recipe, state, num_experts=4, first_expert=3, num_local_experts=2)


def test_experts_with_large_gemms_run_one_gemm_per_expert(
    grouped_kernel, triton_kernels, monkeypatch
):
    """From `PER_EXPERT_FROM_FLOPS` per expert's GEMM on average, every GEMM runs one
    `torch._scaled_mm` per expert: neither grouped kernel is called."""
    recipe = Fp8Recipe("e4m3", "tensorwise")
    cpu = torch.device("cpu")
    limit = experts.PER_EXPERT_FROM_FLOPS
    triton = ExpertGemm.TRITON
    assert ExpertGemms.where_possible(recipe, cpu, BF16, limit / 2) == ExpertGemms(*[triton] * 3)
    assert ExpertGemms.where_possible(recipe, cpu, BF16, limit) == ExpertGemms()
    weight, x, grad = _case()
    flops = 2 * sum(COUNTS) * OUT * IN / LOCAL
    monkeypatch.setattr(experts, "PER_EXPERT_FROM_FLOPS", flops)
    monkeypatch.setattr(grouped_gemm, "_scaled_grouped_mm", None)  # called: a TypeError
    _run(_slots("e4m3", "tensorwise"), weight, x, grad, grouped=True)
    assert triton_kernels == []
    monkeypatch.setattr(experts, "PER_EXPERT_FROM_FLOPS", flops * 1.01)
    _run(_slots("e4m3", "tensorwise"), weight, x, grad, grouped=True)
    assert len(triton_kernels) == 3


@exact_cpu_scaled_mm
def test_graphed_experts_run_the_grouped_kernels_at_any_size(
    grouped_kernel, triton_kernels, monkeypatch
):
    """Experts of a model trained in CUDA graphs (`graphed`) run the Triton kernels, which take
    the counts on the device, however large their GEMMs: eager warm-up iterations run what the
    graph holds, and give the per-expert GEMMs' results bit for bit."""
    weight, x, grad = _case()
    monkeypatch.setattr(experts, "PER_EXPERT_FROM_FLOPS", 0.0)
    per_expert = _run(_slots("e4m3", "tensorwise"), weight, x, grad, grouped=True)
    assert triton_kernels == []
    slots = _slots("e4m3", "tensorwise", graphed=True)
    assert slots.expert_gemms(x, weight, x.shape[0], grouped=True).read_rows_on_device
    graphed = _run(slots, weight, x, grad, grouped=True)
    assert len(triton_kernels) == 3
    for got, want in zip(graphed, per_expert):
        assert torch.equal(got, want)
    expected_y, expected_dx, expected_dw = _reference(slots, weight, x, grad)
    assert torch.equal(graphed[0], expected_y) and torch.equal(graphed[1], expected_dx)
    assert torch.equal(graphed[2], expected_dw.to(BF16))


def test_a_capture_that_meets_host_counts_says_why(grouped_kernel, triton_kernels, monkeypatch):
    """Counts on the device that a GEMM must read on the host, while a graph captures: the error
    names the reason, and the fix for it; graphed experts of any size read nothing there."""
    weight, x, grad = _case()
    counts = torch.tensor(COUNTS)
    monkeypatch.setattr(experts, "cuda_graph_capturing", lambda: True)
    monkeypatch.setattr(experts, "PER_EXPERT_FROM_FLOPS", 0.0)
    cases = [
        (_slots("e4m3", "tensorwise"), False, "not a GroupedMLP"),
        (_slots("e4m3", "tensorwise", wgrad=False), True, "drop --no-fp8-wgrad"),
        (_slots("e4m3", "tensorwise"), True, r"cuda_graph_impl='full_iteration'"),
    ]
    for slots, grouped, why in cases:
        with pytest.raises(RuntimeError, match=f"cannot hold: .*{why}"):
            slots.experts_linear(x, weight, counts, grouped=grouped)
    graphed = _slots("e4m3", "tensorwise", graphed=True)
    y, dx, dw = _run(graphed, weight, x, grad, grouped=True, counts=counts)  # no host read
    expected_y, expected_dx, expected_dw = _reference(graphed, weight, x, grad)
    assert torch.equal(y, expected_y) and torch.equal(dx, expected_dx)
    assert torch.equal(dw, expected_dw.to(BF16))
    monkeypatch.setattr(expert_gemm_kernels, "kernels_available", lambda device: False)
    with pytest.raises(RuntimeError, match="cannot hold: the Triton grouped kernels"):
        graphed.experts_linear(x, weight, counts, grouped=True)


@pytest.mark.parametrize("triton", [False, True])
def test_the_log_says_how_each_gemm_runs(monkeypatch, triton):
    monkeypatch.setattr(grouped_gemm, "grouped_kernel_available", lambda device: True)
    monkeypatch.setattr(expert_gemm_kernels, "kernels_available", lambda device: triton)
    cuda = torch.device("cuda")
    hybrid, e4m3 = Fp8Recipe("hybrid", "delayed"), Fp8Recipe("e4m3", "tensorwise")
    prefix = "the routed experts' FP8 GEMMs run"
    loop = "one torch._scaled_mm per expert"
    large = f"; experts whose GEMMs average 40 GFLOP or more: {loop}"
    if triton:
        gemm = "a Triton grouped GEMM"
        every = f"{prefix}: forward {gemm}, input gradient {gemm}, weight gradient {gemm}{large}"
        for recipe, dtype in ((hybrid, BF16), (e4m3, BF16), (e4m3, torch.float16)):
            assert describe_expert_gemms(recipe, True, cuda, dtype) == every
        graphed = every.replace(large, ", for experts of any size (CUDA graphs)")
        assert describe_expert_gemms(hybrid, True, cuda, BF16, graphed=True) == graphed
    else:
        assert describe_expert_gemms(hybrid, True, cuda, BF16) == (
            f"{prefix}: forward torch._scaled_grouped_mm, input gradient {loop}, weight "
            f"gradient {loop}{large}"
        )
        assert describe_expert_gemms(e4m3, True, cuda, BF16) == (
            f"{prefix}: forward torch._scaled_grouped_mm, input gradient "
            "torch._scaled_grouped_mm, weight gradient torch._scaled_grouped_mm (into fp32 "
            f"main_grads {loop}){large}"
        )
        assert describe_expert_gemms(e4m3, True, cuda, torch.float16) == (
            f"{prefix} {loop} (no grouped FP8 GEMM for float16 inputs on this cuda device)"
        )
    no_fp8_wgrad = describe_expert_gemms(
        Fp8Recipe("e4m3", "tensorwise", wgrad=False), True, cuda, BF16
    )
    assert "weight gradient one high-precision GEMM per expert (no FP8 weight gradient)" in (
        no_fp8_wgrad
    )
    assert describe_expert_gemms(e4m3, False, cuda, BF16) == (
        f"{prefix} one torch._scaled_mm per expert"
    )
