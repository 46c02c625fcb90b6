"""A dropless MoE layer without host reads of its token counts.

At expert-parallel size 1 the layer with grouped GEMMs reads nothing on the host in forward and
backward: it runs under `FakeTensorMode`, which raises on any read of a tensor's values
(`.item()`, `.tolist()`, `nonzero`, ...), and on a GPU under `torch.cuda.set_sync_debug_mode`
("error"). With expert (and expert tensor) parallelism, `moe_pad_dispatch_to_worst_case` sizes
the exchanges without a host read too (checked on 4 gloo ranks by a mode that fails on every
host read). Both give, bit for bit in fp32, what the exchanges sized by the counts read on the
host give (`DispatchSizing.HOST`, the previous code path and still the default with expert
parallelism).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from megatron.core import parallel_state
from megatron.core.transformer.moe import experts as moe_experts
from megatron.core.transformer.moe.experts import ExpertGemm, GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.token_dispatcher import DispatchSizing
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.host_reads import no_host_reads
from tests.unit_tests.transformer.moe.moe_checks import (
    BATCH,
    HIDDEN,
    SEQ,
    WORLD,
    moe_config,
    moe_layer,
)

SWIGLU_SHARED = dict(  # SwiGLU experts, gated shared experts, every router loss, expert bias
    gated_linear_unit=True,
    activation_func=F.silu,
    add_bias_linear=False,
    moe_shared_expert_intermediate_size=16,
    moe_shared_expert_gate=True,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_aux_loss_coeff=1e-2,
    moe_z_loss_coeff=1e-3,
)
BIASES = dict(add_bias_linear=True, moe_router_pre_softmax=True)  # the experts' biases too
VARIANTS = {
    "alltoall-swiglu-shared": dict(moe_token_dispatcher_type="alltoall", **SWIGLU_SHARED),
    "allgather-biases": dict(moe_token_dispatcher_type="allgather", **BIASES),
    "alltoall-biases": dict(moe_token_dispatcher_type="alltoall", **BIASES),
}


def _data(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=generator).to(current_device(), dtype)


def _forward_backward(layer: MoELayer, seed: int) -> tuple[torch.Tensor, ...]:
    """The layer's output, then the gradients of its input and of every parameter."""
    x = _data(seed, layer.router.weight.dtype).requires_grad_()
    output, _ = layer(x)
    params = [param for param in layer.parameters() if param.requires_grad]
    target = _data(seed + 1, output.dtype)
    grads = torch.autograd.grad((output * target).sum(), [x, *params])
    return (output.detach(), *grads)


def _assert_bitwise(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]):
    assert len(actual) == len(expected)
    for index, (a, b) in enumerate(zip(actual, expected)):
        assert torch.equal(a, b), f"result {index} differs"


# --- expert-parallel size 1: nothing read on the host ---


def _fake_forward_backward(layer: MoELayer) -> None:
    """The layer's forward and backward on fake tensors: any read of a value raises."""
    destroy_moe_metrics_tracker()  # the routers record into it: fake tensors, dropped below
    # A scale an earlier training run left is a real tensor, which fake tensors do not mix
    # with: the default one (1) for this backward.
    loss_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    mode = FakeTensorMode()
    state = {
        name: mode.from_tensor(tensor)
        for name, tensor in itertools.chain(layer.named_parameters(), layer.named_buffers())
    }
    try:
        with mode:
            x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
            output, _ = torch.func.functional_call(layer, state, (x,))
            params = [t for n, t in state.items() if t.requires_grad]
            torch.autograd.grad((output.float() ** 2).sum(), [x, *params])
    finally:
        destroy_moe_metrics_tracker()
        MoEAuxLossAutoScaler.main_loss_backward_scale = loss_scale


@pytest.mark.parametrize("variant", VARIANTS)
def test_dropless_grouped_layer_reads_nothing_on_the_host_at_ep_1(variant):
    """In bf16, the dtype in which the grouped GEMM's meta function (which fake tensors run)
    is defined."""
    config = moe_config(
        **VARIANTS[variant], moe_grouped_gemm=True, params_dtype=torch.bfloat16, bf16=True
    )
    layer = moe_layer(config)
    assert layer.token_dispatcher.sizing is DispatchSizing.FIXED
    assert layer.experts.gemm is ExpertGemm.GROUPED
    _forward_backward(layer, seed=0)  # real tensors first: the same code runs
    _fake_forward_backward(layer)


def test_the_fake_tensor_check_sees_the_host_reads_that_remain():
    """The loop of GEMMs (no --moe-grouped-gemm) reads the counts on the host (so its exchange
    is sized there too), and so do exchanges sized on the host before grouped GEMMs: both raise
    under fake tensors."""
    config = moe_config(**VARIANTS["allgather-biases"], params_dtype=torch.bfloat16, bf16=True)
    layer = moe_layer(config)
    assert layer.experts.gemm is ExpertGemm.LOOP
    assert layer.token_dispatcher.sizing is DispatchSizing.HOST
    with pytest.raises(DataDependentOutputException):
        _fake_forward_backward(layer)
    grouped = moe_layer(moe_config(moe_grouped_gemm=True, params_dtype=torch.bfloat16, bf16=True))
    grouped.token_dispatcher = type(grouped.token_dispatcher)(
        grouped.config, None, sizing=DispatchSizing.HOST
    )
    with pytest.raises(DataDependentOutputException):
        _fake_forward_backward(grouped)


def _host_sized_twin(layer: MoELayer) -> MoELayer:
    """A copy of `layer` whose dispatcher sizes its exchanges by counts read on the host."""
    twin = copy.deepcopy(layer)
    twin.token_dispatcher = type(layer.token_dispatcher)(
        layer.config, None, sizing=DispatchSizing.HOST
    )
    return twin


@pytest.mark.parametrize("variant", VARIANTS)
def test_dropless_layer_is_bitwise_the_host_sized_one_at_ep_1(variant):
    layer = moe_layer(moe_config(**VARIANTS[variant], moe_grouped_gemm=True))
    assert layer.token_dispatcher.sizing is DispatchSizing.FIXED
    twin = _host_sized_twin(layer)
    assert twin.token_dispatcher.sizing is DispatchSizing.HOST
    for seed in (0, 5):
        _assert_bitwise(_forward_backward(layer, seed), _forward_backward(twin, seed))


def test_grouped_experts_without_the_kernel_run_masked_gemms_that_match_the_loop():
    """float64, which `torch._grouped_mm` does not take: the masked stand-in (no host read
    either), padding rows past the counts included."""
    config = moe_config(add_bias_linear=True, params_dtype=torch.float64)
    torch.manual_seed(7)
    loop, masked = SequentialMLP(4, config), GroupedMLP(4, config)
    masked.load_state_dict(loop.state_dict())
    counts = torch.tensor([3, 0, 5, 1])
    tokens = torch.randn(11, HIDDEN, dtype=torch.float64, requires_grad=True)  # 2 padding rows
    probs = torch.rand(11, dtype=torch.float64)
    outputs, grads = [], []
    for experts in (loop, masked):
        output = experts(tokens, counts, probs)[:9]
        grads.append(torch.autograd.grad(output.sum(), [tokens, *experts.parameters()]))
        outputs.append(output)
    torch.testing.assert_close(outputs[1], outputs[0])
    for masked_grad, loop_grad in zip(grads[1], grads[0]):
        torch.testing.assert_close(masked_grad, loop_grad)
    assert grads[1][0][9:].eq(0).all()  # the padding rows' gradient


# --- expert parallelism: the padded worst-case exchange ---


def _worst_case_matches_host() -> None:
    rank = dist.get_rank()
    for ep, etp in ((2, 1), (2, 2)):
        parallel_state.initialize_model_parallel(
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        )
        for name, variant in VARIANTS.items():
            fields = dict(variant, moe_grouped_gemm=True)
            host = moe_layer(moe_config(ep, etp, **fields))
            padded = moe_layer(moe_config(ep, etp, moe_pad_dispatch_to_worst_case=True, **fields))
            assert host.token_dispatcher.sizing is DispatchSizing.HOST
            assert padded.token_dispatcher.sizing is DispatchSizing.WORST_CASE
            for seed in (10 * rank, 10 * rank + 1):
                expected = _forward_backward(host, seed)
                with no_host_reads():
                    actual = _forward_backward(padded, seed)
                try:
                    _assert_bitwise(actual, expected)
                except AssertionError as error:
                    raise AssertionError(f"ep {ep} etp {etp} {name}") from error
        with pytest.raises(AssertionError, match="a host read"), no_host_reads():
            _forward_backward(host, 0)  # the check sees what HOST sizing reads
        parallel_state.destroy_model_parallel()


def test_worst_case_exchange_reads_nothing_on_the_host_and_equals_the_host_sized_one():
    """EP 2 and EP 2 x ETP 2 on 4 ranks, both dispatchers, grouped experts: outputs and every
    gradient bitwise equal to the exchange sized on the host."""
    run_distributed(_worst_case_matches_host, WORLD)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(moe_expert_capacity_factor=1.0), "pads dropless token exchanges, but"),
        (dict(moe_grouped_gemm=False), "the experts without moe_grouped_gemm read them"),
    ],
    ids=["capacity", "loop"],
)
def test_worst_case_padding_is_refused_where_it_spares_no_host_read(fields, message):
    with pytest.raises(ValueError, match=message):
        moe_config(**{"moe_pad_dispatch_to_worst_case": True, "moe_grouped_gemm": True, **fields})


def test_worst_case_padding_is_refused_for_fp8_experts_that_read_on_the_host(monkeypatch):
    """Grouped FP8 experts take the counts on the device only with FP8 weight gradients (the
    config refuses the padding without them), where their Triton kernels run: elsewhere (a CPU,
    a GPU older than Hopper) the layer is refused when it is built; without the padding it
    sizes its exchange on the host."""
    monkeypatch.setattr(moe_experts, "grouped_fp8_takes_device_counts", lambda: False)
    fields = dict(fp8="e4m3", fp8_recipe="tensorwise", bf16=True, params_dtype=torch.bfloat16)
    fields.update(moe_grouped_gemm=True)
    with pytest.raises(ValueError, match=r"in FP8 \(e4m3\) with fp8_wgrad=False read them"):
        moe_config(moe_pad_dispatch_to_worst_case=True, fp8_wgrad=False, **fields)
    config = moe_config(moe_pad_dispatch_to_worst_case=True, **fields)
    with pytest.raises(ValueError, match=r"the experts in FP8 \(e4m3\) read them on the host on"):
        moe_layer(config)
    assert moe_layer(moe_config(**fields)).token_dispatcher.sizing is DispatchSizing.HOST
    monkeypatch.setattr(moe_experts, "grouped_fp8_takes_device_counts", lambda: True)
    no_fp8_wgrad = moe_layer(moe_config(fp8_wgrad=False, **fields))
    assert no_fp8_wgrad.token_dispatcher.sizing is DispatchSizing.HOST


def test_experts_that_read_the_counts_on_the_host_have_their_exchange_sized_there():
    """Sizing without a host read would spare nothing: the loop of GEMMs reads the counts."""
    assert moe_layer(moe_config()).token_dispatcher.sizing is DispatchSizing.HOST
    assert (
        moe_layer(moe_config(moe_grouped_gemm=True)).token_dispatcher.sizing is DispatchSizing.FIXED
    )
    capacity = moe_config(moe_grouped_gemm=True, moe_expert_capacity_factor=1.0)
    assert moe_layer(capacity).token_dispatcher.sizing is DispatchSizing.HOST


# --- GPU: no device-to-host synchronisation ---


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs CUDA on Hopper or newer (the grouped kernel)")
@pytest.mark.parametrize("variant", VARIANTS)
def test_dropless_grouped_layer_makes_no_device_to_host_sync_on_cuda(variant):
    config = moe_config(
        **VARIANTS[variant], moe_grouped_gemm=True, params_dtype=torch.bfloat16, bf16=True
    )
    layer = moe_layer(config).cuda()
    host_sized = _host_sized_twin(layer)
    x = _data(0, torch.bfloat16).cuda()

    def step(model: MoELayer) -> None:
        output, _ = model(x.detach().requires_grad_())
        output.float().square().sum().backward()

    # What the training loop keeps on the GPU: the auxiliary losses' gradient scale, and the
    # metrics the routers record (left by CPU tests in this process, they would be copied).
    previous_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones((), device="cuda"))
    destroy_moe_metrics_tracker()
    try:
        step(layer)  # the first pass probes the kernel and allocates
        step(host_sized)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(layer)
            with pytest.raises(RuntimeError, match="synchroniz"):
                step(host_sized)  # the check sees the counts' copy to the host
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = previous_scale
        destroy_moe_metrics_tracker()
