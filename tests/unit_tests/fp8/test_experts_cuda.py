"""The FP8 experts on CUDA: one `torch._scaled_mm` per expert, and the grouped kernels
(`torch._scaled_grouped_mm` and this package's Triton ones) compute what the plain-torch
reference computes from the same quantised operands (bf16 outputs), within the rounding of GEMMs
that accumulate in another order; experts without tokens and counts that are not multiples of
16 included. A wrong operand, layout, padding, offset or scale would be off by far more."""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch

from megatron.core.fp8 import expert_gemm_kernels
from megatron.core.fp8 import experts as fp8_experts
from megatron.core.fp8.experts import ExpertGemm, ExpertGemms, Fp8ExpertSlots
from megatron.core.fp8.grouped_gemm import grouped_kernel_available
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.scaling import DelayedScalingState
from megatron.core.tensor_parallel.grad_accumulation import register_main_grad
from megatron.core.transformer.moe import experts as moe_experts
from megatron.core.transformer.moe.token_dispatcher import DispatchSizing
from tests.unit_tests.fp8 import test_experts
from tests.unit_tests.fp8.test_moe_model import _config, _gpt
from tests.unit_tests.model_builders import make_token_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs an FP8 GPU (compute capability 8.9 or newer)",
    ),
]

BF16 = torch.bfloat16
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


def _on_cuda(weight, x, grad):
    weight = torch.nn.Parameter(weight.detach().cuda())
    return weight, x.detach().cuda().requires_grad_(), grad.cuda()


def _assert_near(actual: torch.Tensor, reference: torch.Tensor) -> None:
    reference = reference.to(actual.dtype)
    atol = 2e-2 * reference.abs().max().item()
    torch.testing.assert_close(actual.cpu(), reference, rtol=2e-2, atol=atol)


@pytest.mark.skipif(not HOPPER, reason="torch._scaled_grouped_mm runs on compute capability 9-10")
def test_the_grouped_kernel_runs_here():
    """The build has `torch._scaled_grouped_mm` for Hopper: the experts use it."""
    assert grouped_kernel_available(torch.device("cuda"))


@pytest.mark.parametrize("kernels", ["per_expert", "triton", "scaled_grouped_mm"])
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_cuda_fp8_experts_compute_the_reference(fmt, kind, kernels, monkeypatch):
    """One GEMM per expert; the Triton grouped GEMMs, which a GroupedMLP uses on Hopper; and
    PyTorch's grouped GEMM where it applies, which it uses without Triton."""
    if kernels == "scaled_grouped_mm":
        monkeypatch.setattr(expert_gemm_kernels, "kernels_available", lambda device: False)
    weight, x, grad = test_experts._case()
    expected = test_experts._reference(test_experts._slots(fmt, kind), weight, x, grad)
    weight, x, grad = _on_cuda(weight, x, grad)
    slots = test_experts._slots(fmt, kind)  # a delayed state moves to the GPU at its first cast
    grouped = kernels != "per_expert"
    if grouped and HOPPER:
        gemms = ExpertGemms.where_possible(slots.recipe, x.device, x.dtype)
        if kernels == "triton":
            assert gemms == ExpertGemms(*[ExpertGemm.TRITON] * 3)
        else:
            scaled = ExpertGemm.SCALED_GROUPED_MM
            backward = scaled if fmt == "e4m3" else ExpertGemm.PER_EXPERT
            assert gemms == ExpertGemms(scaled, backward, backward)
    y, dx, dw = test_experts._run(slots, weight, x, grad, grouped=grouped)
    for actual, reference in zip((y, dx, dw), expected):
        _assert_near(actual, reference)
    assert not dw[1].any()  # the expert without tokens


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_cuda_fp8_expert_gradients_fuse_into_main_grad(fmt, dtype, overwrite):
    """Written over an engine's main_grad, the expert without tokens zeroed, or added to, the
    expert without tokens keeping its gradient (the grouped kernels on Hopper)."""
    weight, x, grad = test_experts._case()
    expected = test_experts._reference(test_experts._slots(fmt, "tensorwise"), weight, x, grad)
    weight, x, grad = _on_cuda(weight, x, grad)
    engine = test_experts._Engine(weight, dtype, overwrite=overwrite)
    # Old gradients of the new one's magnitude, or NaNs where they are written over.
    old = float("nan") if overwrite else expected[2].abs().max().item() / 2
    engine.main_grad = torch.full(weight.shape, old, dtype=dtype, device="cuda")
    register_main_grad(weight, engine.main_grad_of)
    _, _, dw = test_experts._run(
        test_experts._slots(fmt, "tensorwise"), weight, x, grad, grouped=True
    )
    assert dw is None
    _assert_near(engine.main_grad, expected[2] + (0.0 if overwrite else old))
    kept = torch.zeros(weight.shape[1:]) if overwrite else torch.full(weight.shape[1:], old)
    assert torch.equal(engine.main_grad[1].cpu(), kept.to(dtype)), "the expert without tokens"


@pytest.mark.skipif(not HOPPER, reason="the Triton grouped GEMMs run on compute capability 9+")
@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_cuda_fp8_experts_take_counts_on_the_device_without_a_host_sync(fmt, kind):
    """Counts in a device tensor: forward and backward synchronise nothing with the host (CUDA's
    sync debug mode raises at any synchronising call), and give the host counts' outputs and
    gradients bit for bit."""
    weight, x, grad = _on_cuda(*test_experts._case())
    counts = torch.tensor(test_experts.COUNTS, device="cuda")
    host = test_experts._run(test_experts._slots(fmt, kind), weight, x, grad, grouped=True)
    slots = test_experts._slots(fmt, kind)
    test_experts._run(slots, weight, x, grad, grouped=True, counts=counts)  # Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        device = test_experts._run(slots, weight, x, grad, grouped=True, counts=counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(host, device):
        assert torch.equal(a, b)


def _captured(slots, weight, x, grad, counts) -> list[torch.Tensor]:
    """The output and gradients of `slots`' experts from a captured forward and backward,
    replayed once."""
    # Leaves first used in the capture: autograd ties a leaf's gradient to the stream of its
    # first use, and an eager run used the caller's on the uncaptured one.
    x, weight = x.detach().requires_grad_(), torch.nn.Parameter(weight.detach())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = slots.experts_linear(x, weight, counts, grouped=True)
        dx, dw = torch.autograd.grad(y, (x, weight), grad)
    graph.replay()
    torch.cuda.synchronize()
    return [y, dx, dw]


@pytest.mark.skipif(not HOPPER, reason="the Triton grouped GEMMs run on compute capability 9+")
def test_a_cuda_graph_captures_grouped_fp8_experts_or_names_those_it_cannot_hold(monkeypatch):
    """Experts whose GEMMs run the Triton kernels are captured with their counts on the device:
    the replay gives the eager results bit for bit. Experts large enough to run one GEMM per
    expert (any here: the threshold set to 0), which read the counts on the host, make the
    capture fail, naming them; those of a model trained in graphs (`graphed`) run the Triton
    kernels at any size, eager and captured."""
    weight, x, grad = _on_cuda(*test_experts._case())
    counts = torch.tensor(test_experts.COUNTS, device="cuda")
    slots = test_experts._slots("hybrid", "delayed")
    eager = [t.clone() for t in test_experts._run(slots, weight, x, grad, True, counts)]
    for got, want in zip(_captured(slots, weight, x, grad, counts), eager):
        assert torch.equal(got, want)
    monkeypatch.setattr(fp8_experts, "PER_EXPERT_FROM_FLOPS", 0.0)
    message = "read their token counts on the host, which a CUDA graph cannot hold"
    with pytest.raises(RuntimeError, match=message):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            slots.experts_linear(x, weight, counts, grouped=True)
    graphed = test_experts._slots("hybrid", "delayed", graphed=True)
    graphed_eager = test_experts._run(graphed, weight, x, grad, True, counts)
    for got, want in zip(graphed_eager, eager):
        assert torch.equal(got, want)
    for got, want in zip(_captured(graphed, weight, x, grad, counts), eager):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_cuda_fp8_experts_cast_in_one_launch_per_pass(fmt):
    """64 experts' rows are cast by one kernel launch in forward and one in backward (delayed
    scaling), not one per expert; the weights' FP8 copies, made at the first step, are kept."""
    experts, width = 64, 64
    recipe = Fp8Recipe(fmt, "delayed")
    state = DelayedScalingState(recipe, group=None)
    slots = Fp8ExpertSlots(
        recipe, state, num_experts=experts, first_expert=0, num_local_experts=experts
    )
    weight = torch.nn.Parameter(torch.randn(experts, width, width, device="cuda", dtype=BF16))
    counts = [0, 5, 17, 32] * (experts // 4)
    x = torch.randn(sum(counts), width, device="cuda", dtype=BF16, requires_grad=True)

    def step() -> None:
        slots.experts_linear(x, weight, counts, grouped=True).sum().backward()

    step()  # the weights' FP8 copies, and Triton's compilation
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step()
        torch.cuda.synchronize()
    launches = collections.Counter(event.name for event in profile.events())
    assert launches["_expert_cast_kernel"] == 2, launches
    assert launches["_cast_kernel"] == 0, launches


def _train_on_one_batch(grouped: bool, device: str, steps: int = 4):
    """A tiny bf16 MoE GPT in FP8 (e4m3, current scaling) trained `steps` Adam steps on one
    batch: (its losses, its gradients of the first step by parameter name)."""
    model = _gpt(_config("e4m3", "tensorwise", moe_grouped_gemm=grouped)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens, labels = (t.to(device) for t in make_token_batches(1, 3, seed=5)[0])
    losses, first_grads = [], None
    for _ in range(steps):
        loss = model(tokens, labels=labels).float().mean()
        loss.backward()
        if first_grads is None:
            params = model.named_parameters()
            first_grads = {n: p.grad.float().clone() for n, p in params if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, first_grads


@pytest.mark.skipif(not HOPPER, reason="torch._scaled_grouped_mm runs on compute capability 9-10")
def test_cuda_fp8_moe_gpt_trains_alike_grouped_and_per_expert():
    """A tiny bf16 MoE GPT in FP8 with every expert GEMM grouped (e4m3) and the same with one
    GEMM per expert, from the same weights on the same batch.

    The first step's gradients (identical weights and routing) agree within 10% of each
    parameter's gradient norm: the two kernels sum in different orders, so a bf16 output can
    round one way or the other, and re-quantised to e4m3 further on such a value can move by a
    whole e4m3 step (2^-3): a few elements, each a small part of a norm (on the CPU, every
    expert output moved by up to one bf16 ulp changes no gradient by over 3.5% of its norm).
    A wrong scale of one expert, or its rows multiplied by another expert's weight, moves the
    experts' or the router's gradients by a third of their norm or more.

    Both runs memorise the batch (the loss falls by over 10% in 4 steps, by about a quarter on
    the CPU). Their losses agree within 1%: Adam's first steps amplify gradient noise (an
    update of the sign of a near-zero gradient), so the losses are a coarse check only; the
    gradients are the fine one. Current scaling (not delayed): a delayed recipe starts from
    the scale 1, with which the first step's FP8 gradients underflow to zero."""
    (losses, grads), (grouped_losses, grouped_grads) = (
        _train_on_one_batch(grouped, "cuda") for grouped in (False, True)
    )
    for run in (losses, grouped_losses):
        assert run[-1] < 0.9 * run[0], (losses, grouped_losses)
    for a, b in zip(losses, grouped_losses):
        assert abs(a - b) < 1e-2 * abs(a), (losses, grouped_losses)
    assert grads.keys() == grouped_grads.keys()
    for name, grad in grads.items():
        error = (grouped_grads[name] - grad).norm().item()
        assert error <= 0.1 * grad.norm().item(), (name, error, grad.norm().item())


@pytest.mark.skipif(not HOPPER, reason="the Triton grouped GEMMs run on compute capability 9+")
def test_cuda_grouped_fp8_moe_reads_no_counts_on_the_host(monkeypatch):
    """Where the grouped FP8 kernels run, a grouped FP8 MoE layer on one rank sizes its dispatch
    from the shapes: its forward and backward synchronise nothing with the host (CUDA's sync
    debug mode raises at any synchronising call), and it trains as the layer that reads the
    counts on the host does, bit for bit."""
    config = _config("hybrid", "delayed", moe_grouped_gemm=True)
    device = _gpt(config).cuda()
    assert device.decoder.layers[1].mlp.token_dispatcher.sizing is DispatchSizing.FIXED
    monkeypatch.setattr(moe_experts, "grouped_fp8_takes_device_counts", lambda: False)
    host = _gpt(config).cuda()
    assert host.decoder.layers[1].mlp.token_dispatcher.sizing is DispatchSizing.HOST
    batches = [tuple(t.cuda() for t in batch) for batch in make_token_batches(3, 3, seed=5)]
    losses = []
    for model in (host, device):
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses.append([])
        for tokens, labels in batches:
            loss = model(tokens, labels=labels).float().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[-1].append(loss.detach())
    assert torch.equal(torch.stack(losses[0]), torch.stack(losses[1]))
    tokens, labels = batches[0]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        device(tokens, labels=labels).float().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not HOPPER, reason="the Triton grouped GEMMs run on compute capability 9+")
def test_cuda_fp8_moe_experts_that_need_host_counts_read_them_once_per_layer(monkeypatch):
    """A FIXED-sized layer whose experts run one GEMM per expert (any size counts as large
    here) reads the counts on the host once per forward for both projections, not once per
    projection, and none in backward; and it trains as the layer sized on the host does, bit
    for bit (losses and every gradient)."""
    config = _config(
        "hybrid", "delayed", moe_grouped_gemm=True, num_layers=4, moe_layer_freq=[0, 1, 1, 1]
    )
    device = _gpt(config).cuda()
    dispatchers = [layer.mlp.token_dispatcher for layer in device.decoder.layers[1:]]
    assert [d.sizing for d in dispatchers] == [DispatchSizing.FIXED] * 3
    monkeypatch.setattr(moe_experts, "grouped_fp8_takes_device_counts", lambda: False)
    host = _gpt(config).cuda()
    monkeypatch.setattr(fp8_experts, "PER_EXPERT_FROM_FLOPS", 0.0)
    on_host, original = [], fp8_experts.DeviceExpertRows.on_host

    def recorded(rows):
        on_host.append(rows)
        return original(rows)

    monkeypatch.setattr(fp8_experts.DeviceExpertRows, "on_host", recorded)
    tokens, labels = (t.cuda() for t in make_token_batches(1, 3, seed=5)[0])
    losses, syncs = [], []
    for model in (host, device):
        with _synchronizations() as forward:
            loss = model(tokens, labels=labels).float().mean()
        with _synchronizations() as backward:
            loss.backward()
        losses.append(loss.detach())
        syncs.append((len(forward), len(backward)))
    assert torch.equal(*losses)
    assert syncs[1] == (len(dispatchers), 0)  # one read per MoE layer's forward
    assert on_host == []  # the projections got host counts from the layer
    for (name, a), b in zip(host.named_parameters(), device.parameters()):
        assert (a.grad is None) == (b.grad is None) and (
            a.grad is None or torch.equal(a.grad, b.grad)
        ), name


@contextlib.contextmanager
def _synchronizations() -> Iterator[list[warnings.WarningMessage]]:
    """The host synchronisations CUDA calls make inside the block, one warning each."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found: list[warnings.WarningMessage] = []
            yield found
    finally:
        torch.cuda.set_sync_debug_mode("default")
    found.extend(w for w in caught if "synchronizing CUDA operation" in str(w.message))
