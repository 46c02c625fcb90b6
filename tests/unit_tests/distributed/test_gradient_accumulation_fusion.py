"""Gradient-accumulation fusion under the DDP engine and Megatron-FSDP's whole gradient sums:
the same gradients and torch `.grad` semantics as without it, off the training loop's happy path
too (`torch.autograd.grad`, recompute, autocast, `torch.func`, penalties, tied weights)."""

from __future__ import annotations

import contextlib
import gc
from unittest import mock

import pytest
import torch
from torch.distributed.tensor import DTensor

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel import grad_accumulation
from megatron.core.tensor_parallel.grad_accumulation import (
    FusionTarget,
    _may_fuse,
    linear,
    register_main_grad,
)
from tests.unit_tests.distributed.test_distributed_data_parallel import (
    _train_ddp,
    _train_single_process,
)
from tests.unit_tests.distributed_harness import run_distributed, select_backend
from tests.unit_tests.model_builders import build_tiny_gpt, device_batch, tiny_gpt_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tiny_gpt(fusion: bool, dtype: torch.dtype, scenario: str):
    """The tiny GPT in `dtype`, fusing or not; its weights tied but in the "untied" scenario,
    each layer recomputed in the "recompute" one."""
    recompute = {}
    if scenario == "recompute":
        recompute = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    config = tiny_gpt_config(
        gradient_accumulation_fusion=fusion,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **recompute,
    )
    return build_tiny_gpt(config, share_embeddings_and_output_weights=scenario != "untied")


def _wrapped(
    fusion: bool, dtype: torch.dtype, scenario: str, **ddp_fields
) -> DistributedDataParallel:
    model = _tiny_gpt(fusion, dtype, scenario)
    config = model.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, **ddp_fields)
    return DistributedDataParallel(config, ddp_config, model)


def _backward(ddp: DistributedDataParallel, seed: int, penalty: bool = False) -> tuple[str, bool]:
    """One backward; the name of the fc1 output's autograd node (which linear ran) and whether
    autograd produced a gradient for fc1's weight (a hook on it fired)."""
    tokens, labels = device_batch(4, seed)
    fc1 = ddp.module.decoder.layers[0].mlp.linear_fc1
    nodes, grads = [], []
    forward = fc1.register_forward_hook(lambda m, i, out: nodes.append(type(out[0].grad_fn)))
    hook = fc1.weight.register_hook(lambda grad: grads.append(grad is not None))
    loss = ddp(tokens, labels=labels).float().mean()
    forward.remove()
    if penalty:  # a second use of a fused weight in the same graph
        loss = loss + fc1.weight.float().square().sum()
    loss.backward()
    hook.remove()
    return nodes[0].__name__, any(grads)


def _scenario(fusion: bool, scenario: str, dtype: torch.dtype) -> tuple[dict, dict, set]:
    """(main_grads, .grads, what `_backward` saw) after `scenario` (test docstring)."""
    resumed = scenario in ("dropped", "kept")
    ddp = _wrapped(
        fusion,
        dtype,
        scenario,
        # Overlapped buckets refuse a second synchronised backward without zero_grad_buffer().
        overlap_grad_reduce=not resumed,
        bucket_size=2000,
        use_distributed_optimizer=scenario == "distopt",
    )
    nodes = set()
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        nodes.add(_backward(ddp, seed=1))
    nodes.add(_backward(ddp, seed=2, penalty=scenario == "penalty"))
    ddp.finish_grad_sync()
    if resumed:
        # A torch optimizer steps, then the step's gradients are dropped (or kept), and a
        # backward runs without `zero_grad_buffer()`.
        optimizer = torch.optim.SGD(ddp.module.parameters(), lr=0.1)
        optimizer.step()
        if scenario == "dropped":
            optimizer.zero_grad(set_to_none=True)
        nodes.add(_backward(ddp, seed=3))
        ddp.finish_grad_sync()
    params = dict(ddp.module.named_parameters())
    main_grads = {name: p.main_grad.clone() for name, p in params.items()}
    grads = {name: p.grad.clone() for name, p in params.items() if p.grad is not None}
    return main_grads, grads, nodes


def _fused_and_plain(scenario: str, dtype: torch.dtype) -> tuple:
    return _scenario(True, scenario, dtype), _scenario(False, scenario, dtype)


FUSED = "_LinearIntoMainGradBackward"
# What the fused model's backward passes show for fc1 (its weight untied): its weight gets no
# gradient from autograd, but for a penalty term, or where a kept `.grad` turns fusion off.
FUSED_BACKWARDS = {
    "microbatches": {(FUSED, False)},
    "recompute": {(FUSED, False)},
    "penalty": {(FUSED, False), (FUSED, True)},
    "distopt": {(FUSED, False)},
    "dropped": {(FUSED, False)},
    "kept": {(FUSED, False), (FUSED, True)},
}


@pytest.mark.parametrize("scenario", list(FUSED_BACKWARDS))
def test_fused_gradients_equal_unfused_fp32(scenario):
    """Two microbatches with tied embeddings (overlapped buckets); "recompute" checkpoints every
    layer; "penalty" adds a term on a fused weight; "distopt" reduce-scatters for the
    distributed optimizer; "dropped" and "kept" (not overlapped) run a further backward after a
    torch optimizer's step, with its `.grad` dropped by `zero_grad()` (the next backward starts
    afresh) or kept (it accumulates)."""
    for fused, plain in run_distributed(_fused_and_plain, 2, scenario, torch.float32):
        (fused_main, fused_grads, fused_seen), (plain_main, plain_grads, plain_seen) = fused, plain
        assert fused_seen == FUSED_BACKWARDS[scenario]
        assert all(name != FUSED and autograd_grad for name, autograd_grad in plain_seen)
        assert fused_main.keys() == plain_main.keys() and fused_grads.keys() == plain_grads.keys()
        for name in plain_main:
            torch.testing.assert_close(fused_main[name], plain_main[name], msg=name)
        for name in plain_grads:
            torch.testing.assert_close(fused_grads[name], plain_grads[name], msg=name)
        assert any(g.abs().sum() > 0 for g in fused_main.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU arithmetic (the CUDA test is below)")
def test_fused_bf16_gradients_in_fp32_main_grads_on_cpu():
    """bf16 weights, fp32 `main_grad`: on CPU the fused path forms the same bf16 products and
    adds them in fp32, so the sums are bitwise equal (untied: autograd would sum a tied
    weight's two bf16 gradients in bf16 first, where fusion adds them in fp32)."""
    for fused, plain in run_distributed(_fused_and_plain, 2, "untied", torch.bfloat16):
        fused_main, plain_main = fused[0], plain[0]
        for name in plain_main:
            assert torch.equal(fused_main[name], plain_main[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_weight_grad_accumulates_in_fp32(dtype, overwrite):
    """On CUDA the product is accumulated into the fp32 `main_grad` by the GEMM, unrounded: it
    equals the fp32 product of the same (exactly representable) inputs added in fp32, or,
    overwriting, the product alone, whatever the target held (NaN here)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(96, 64, device="cuda", dtype=dtype))
    if overwrite:
        main_grad = torch.full((96, 64), torch.nan, device="cuda")
    else:
        main_grad = torch.randn(96, 64, device="cuda")
    expected = torch.zeros_like(main_grad) if overwrite else main_grad.clone()
    owner = _MainGrads({weight: main_grad}, overwrite)
    register_main_grad(weight, owner.of)
    x = torch.randn(4, 33, 64, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(4, 33, 96, device="cuda", dtype=dtype)
    linear(x, weight).backward(g)
    expected += g.reshape(-1, 96).float().t() @ x.detach().reshape(-1, 64).float()
    assert weight.grad is None
    torch.testing.assert_close(main_grad, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(x.grad, (g @ weight.detach()).to(dtype))


@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_an_overwritten_target_is_not_read(main_dtype):
    """`FusionTarget(overwrite=True)` on CPU: the weight gradient replaces the target's
    contents (NaN here, as uninitialised memory may be), bitwise as autograd computes it (a
    bf16 target through `addmm_(beta=0)`, an fp32 one through a copy; the CUDA kernels are
    checked on a GPU above)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(24, 16, dtype=torch.bfloat16))
    main_grad = torch.full((24, 16), torch.nan, dtype=main_dtype)
    owner = _MainGrads({weight: main_grad}, overwrite=True)
    register_main_grad(weight, owner.of)
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    g = torch.randn(3, 5, 24, dtype=torch.bfloat16)
    linear(x, weight).backward(g)
    assert weight.grad is None
    plain = torch.nn.Parameter(weight.detach().clone())
    torch.nn.functional.linear(x, plain).backward(g)
    assert torch.equal(main_grad, plain.grad.to(main_dtype))


def _watch(fc1: torch.nn.Module) -> tuple[list[list[bool]], list[str]]:
    """Records, per forward of `fc1`, whether autograd produced a gradient for its weight (a
    list per backward, filled by a hook on the whole weight, which exists only inside the
    pass) and the name of its output's autograd node."""
    autograd_grads, nodes = [], []

    def watch(module, args, output) -> None:
        seen = []
        autograd_grads.append(seen)
        module.weight.register_hook(lambda grad: seen.append(grad is not None))
        nodes.append(type(output[0].grad_fn).__name__)

    fc1.register_forward_hook(watch)
    return autograd_grads, nodes


def _fsdp_microbatches(
    fusion: bool,
    strategy: str,
    keep: bool,
    main_grads_dtype: torch.dtype | None = None,
) -> tuple[dict, list, list]:
    """Megatron-FSDP with `accumulate_unsharded_grads`, three microbatches: the global
    gradients the optimizer sees, per backward whether autograd produced a gradient for fc1's
    (whole) weight, and the autograd node of fc1's output per forward."""
    from megatron.core.distributed.fsdp import FullyShardedDataParallel

    config = tiny_gpt_config(gradient_accumulation_fusion=fusion)
    model = build_tiny_gpt(config, share_embeddings_and_output_weights=True)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        grad_reduce_in_fp32=main_grads_dtype is None,
        megatron_fsdp_main_grads_dtype=main_grads_dtype,
        megatron_fsdp_accumulate_unsharded_grads=True,
        megatron_fsdp_keep_unsharded_params=keep,
    )
    fsdp = FullyShardedDataParallel(config, ddp_config, model)
    autograd_grads, nodes = _watch(model.decoder.layers[0].mlp.linear_fc1)
    fsdp.zero_grad_buffer()
    for i in range(3):
        tokens, labels = device_batch(4, i)
        with fsdp.no_sync() if i < 2 else contextlib.nullcontext():
            fsdp(tokens, labels=labels).float().mean().backward()
    fsdp.finish_grad_sync()
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        for name, p in model.named_parameters()
    }
    return grads, [any(seen) for seen in autograd_grads], nodes


@pytest.mark.parametrize(
    "strategy, keep",
    [("optim_grads_params", False), ("optim_grads_params", True), ("optim_grads", False)],
)
def test_fsdp_fuses_into_the_deferred_sums(strategy, keep):
    """From the second microbatch on, the whole sums exist and fc1's weight gets no gradient
    from autograd; the gradients equal the unfused run's and plain PyTorch's (every rank sees
    the same microbatches, so their average is one process's sum over them)."""
    model = build_tiny_gpt(tiny_gpt_config(), share_embeddings_and_output_weights=True)
    for i in range(3):
        tokens, labels = device_batch(4, i)
        model(tokens, labels=labels).float().mean().backward()
    reference = {name: p.grad for name, p in model.named_parameters()}
    for fused, plain in zip(
        run_distributed(_fsdp_microbatches, 2, True, strategy, keep),
        run_distributed(_fsdp_microbatches, 2, False, strategy, keep),
    ):
        assert fused[0].keys() == reference.keys()
        for name, grad in reference.items():
            torch.testing.assert_close(fused[0][name], grad, msg=name)
        assert fused[1] == [True, False, False] and plain[1] == [True, True, True]
        # No sums yet in the first microbatch: plain F.linear, without the fusing function.
        assert fused[2][0] != FUSED and fused[2][1:] == [FUSED, FUSED]
        assert fused[0].keys() == plain[0].keys()
        for name in plain[0]:
            torch.testing.assert_close(fused[0][name], plain[0][name], msg=name)
        assert any(g.abs().sum() > 0 for g in fused[0].values())


def test_fsdp_sums_a_gemm_cannot_write_stay_unfused():
    """bf16 sums for an fp32 model: no GEMM writes them (CUDA's addmm takes fp32 outputs or
    the inputs' dtype), so autograd keeps every gradient; the result equals the unfused run."""
    args = ("optim_grads_params", False, torch.bfloat16)
    fused = run_distributed(_fsdp_microbatches, 2, True, *args)
    plain = run_distributed(_fsdp_microbatches, 2, False, *args)
    for (fused_grads, fused_seen, _), (plain_grads, _, _) in zip(fused, plain):
        assert fused_seen == [True, True, True]
        for name in plain_grads:
            assert torch.equal(fused_grads[name], plain_grads[name]), name


def _fsdp_sends(
    fusion: bool, strategy: str, dtype: torch.dtype, reduce_in_fp32: bool, scenario: str
) -> dict:
    """Megatron-FSDP without whole sums (gradients reduce-scattered at every backward), tied
    weights, the backward passes of `scenario` (`SEND_SCENARIOS`); returns the global
    gradients ("grads"), per backward whether autograd produced a gradient for fc1's (whole)
    weight ("seen"), the autograd node of fc1's output per forward ("nodes"), whether a weight
    of the root may fuse ("root_fuses"), and whether a send buffer was left written after
    `finish_grad_sync()` ("leaked"), and how many reduce-scatters the passes after the failed
    one issued ("reduce_scatters")."""
    from megatron.core.distributed.fsdp import FullyShardedDataParallel, fully_shard_optimizer
    from megatron.core.distributed.fsdp.collectives import Collectives
    from megatron.core.distributed.fsdp.roots import parameter_groups

    model = _tiny_gpt(fusion, dtype, scenario)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        grad_reduce_in_fp32=reduce_in_fp32,
        overlap_grad_reduce=True,
    )
    fsdp = FullyShardedDataParallel(model.config, ddp_config, model)
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    autograd_grads, nodes = _watch(fc1)
    penalties = _penalize(fc1) if scenario == "penalty" else []

    def loss_of(seed: int) -> torch.Tensor:
        tokens, labels = device_batch(4, seed)
        return fsdp(tokens, labels=labels).float().mean() + sum(penalties)

    def fail_once() -> None:
        """A backward that raises in layer 0's backward after its fc2 wrote its gradient into
        the send buffer (layer 1's was reduced already)."""

        def fail(module, args, output) -> None:
            output[0].register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("boom")))

        handle = fc1.register_forward_hook(fail)
        with pytest.raises(RuntimeError, match="boom"):
            loss_of(9).backward()
        handle.remove()

    fsdp.zero_grad_buffer()
    after_failure = None
    if scenario.startswith("consumed"):
        # A step consumed by a connected optimizer (lr 0: the weights stay): the next
        # backward replaces its gradients, with no `zero_grad_buffer()` between.
        optimizer = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.0), model)
        loss_of(5).backward()
        fsdp.finish_grad_sync()
        optimizer.step()
    if scenario == "consumed_then_failed":
        # The consumed gradients stay in `.grad` after a failed backward, as without fusion.
        fail_once()
        fsdp.finish_grad_sync()
        after_failure = {name: _global_grad(p) for name, p in model.named_parameters()}
    if scenario.startswith("failed"):
        # The next backward must not see the failed one's send buffer, after
        # `zero_grad_buffer()` or after a new forward alone (which keeps layer 1's reduction).
        fail_once()
        if scenario == "failed":
            fsdp.zero_grad_buffer()
    reduce_scatter_tensors = Collectives.reduce_scatter_tensors
    reduce_scatters = [0]

    def count(*args, **kwargs):
        reduce_scatters[0] += 1
        return reduce_scatter_tensors(*args, **kwargs)

    with mock.patch.object(Collectives, "reduce_scatter_tensors", count):
        if scenario == "twice":
            loss = loss_of(0)
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            seeds = SEND_SCENARIOS.get(scenario, [0])
            for i, seed in enumerate(seeds):
                with fsdp.no_sync() if i < len(seeds) - 1 else contextlib.nullcontext():
                    loss_of(seed).backward()
        fsdp.finish_grad_sync()
    groups = [group.grads for group in parameter_groups(model) if group.grads is not None]
    root = [p for group in model.fsdp_unit.groups for p in group.weights.unsharded_params]
    return {
        "grads": {name: _global_grad(p) for name, p in model.named_parameters()},
        "after_failure": after_failure,
        "seen": [any(s) for s in autograd_grads],
        "nodes": nodes,
        "root_fuses": any(map(_may_fuse, root)),
        "leaked": any(g.send_buffer is not None and g.send_buffer.holds_written for g in groups),
        "reduce_scatters": reduce_scatters[0],
    }


TIED = "embedding.word_embeddings.weight"


def _global_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """`param.grad` whole (a copy), or None."""
    grad = param.grad
    if grad is None:
        return None
    return grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()


def _penalize(fc1: torch.nn.Module) -> list[torch.Tensor]:
    """A penalty on fc1's weight, taken before fc1 runs: its gradient reaches the weight's
    `.grad` after fc1's own backward wrote into the send buffer (a second use of a fused
    weight, summed there). Returns the list the penalty of the latest forward is put in."""
    penalties = []

    def penalize(module, args) -> None:
        penalties[:] = [module.weight.float().square().sum() * 1e-2]

    fc1.register_forward_pre_hook(penalize)
    return penalties


# The backward passes each `_fsdp_sends` scenario runs, as seeds of `device_batch` ("failed"
# runs one more before them that raises; "failed_then_forward" keeps what that one reduced,
# which plain PyTorch's failed backward does not match, so it is compared with the unfused run
# only, as is "consumed_then_failed", a failed backward after a step; "consumed" runs a step
# first, whose gradients the backward replaces).
SEND_SCENARIOS = {"one": [0], "microbatches": [0, 1, 2], "twice": [0, 0], "failed": [0]}
SEND_SCENARIOS["recompute"] = SEND_SCENARIOS["penalty"] = SEND_SCENARIOS["one"]
SEND_SCENARIOS["consumed"] = SEND_SCENARIOS["one"]


@pytest.mark.parametrize(
    "strategy, dtype, reduce_in_fp32, scenario, world_size",
    [
        ("optim_grads_params", torch.float32, True, "one", 2),
        ("optim_grads_params", torch.float32, True, "one", 3),  # padded chunks
        ("optim_grads_params", torch.bfloat16, True, "microbatches", 2),
        ("optim_grads_params", torch.bfloat16, False, "microbatches", 2),  # bf16 send buffer
        ("optim_grads", torch.float32, True, "microbatches", 2),
        ("optim_grads_params", torch.float32, True, "twice", 2),
        ("optim_grads_params", torch.float32, True, "failed", 2),
        ("optim_grads_params", torch.float32, True, "failed_then_forward", 2),
        ("optim_grads_params", torch.float32, True, "recompute", 2),
        ("optim_grads_params", torch.float32, True, "penalty", 2),
        # One rank: the reduce-scatter would only copy; a backward that starts the step's
        # gradients writes them into the optimizer's memory, later ones add through the buffer.
        ("optim_grads_params", torch.float32, True, "one", 1),
        ("optim_grads_params", torch.bfloat16, True, "microbatches", 1),
        ("optim_grads_params", torch.bfloat16, False, "microbatches", 1),  # bf16 main_grad
        ("optim_grads", torch.float32, True, "microbatches", 1),
        ("optim_grads_params", torch.float32, True, "twice", 1),
        ("optim_grads_params", torch.float32, True, "failed", 1),
        ("optim_grads_params", torch.float32, True, "failed_then_forward", 1),
        ("optim_grads_params", torch.float32, True, "recompute", 1),
        ("optim_grads_params", torch.float32, True, "penalty", 1),
        ("optim_grads_params", torch.float32, True, "consumed", 1),
        ("optim_grads_params", torch.float32, True, "consumed_then_failed", 1),
        ("optim_grads_params", torch.float32, True, "consumed_then_failed", 2),
    ],
)
def test_fsdp_writes_weight_gradients_into_the_reduce_scatter_input(
    strategy, dtype, reduce_in_fp32, scenario, world_size
):
    """Gradients reduce-scattered at every backward: fc1's weight never gets a gradient from
    autograd (its GEMM writes it into the send buffer), the root's linears do not fuse (it
    reduces at the end of backward), and no written buffer outlives the step. The gradients
    equal the unfused run's and plain PyTorch's (`_fsdp_fused_and_plain`)."""
    fused_ranks, plain_ranks = _fsdp_fused_and_plain(
        strategy, dtype, reduce_in_fp32, scenario, world_size
    )
    for fused, plain in zip(fused_ranks, plain_ranks):
        # The penalty's gradient reaches fc1's weight through autograd.
        assert any(fused["seen"]) == (scenario == "penalty") and all(plain["seen"])
        assert set(fused["nodes"]) == {FUSED} and FUSED not in plain["nodes"]
        assert not fused["root_fuses"] and not fused["leaked"]
        # Over one rank only the backward passes after a step's first reduction reduce (add
        # through the send buffer): those of further microbatches, a second backward, and
        # layer 1's after a failed pass that reduced it and was not zeroed.
        # Gradients consumed by the optimizer stay in `.grad` until the reduction that
        # replaces them: fused gradients go through the send buffer then.
        later = ("microbatches", "twice", "failed_then_forward", "consumed_then_failed")
        fused_later = (*later, "consumed")
        assert (fused["reduce_scatters"] > 0) == (world_size > 1 or scenario in fused_later)
        assert (plain["reduce_scatters"] > 0) == (world_size > 1 or scenario in later)


@pytest.mark.parametrize(
    "strategy, dtype, reduce_in_fp32, scenario, world_size",
    [
        ("no_shard", torch.float32, True, "one", 2),
        ("no_shard", torch.bfloat16, True, "microbatches", 2),
        ("no_shard", torch.bfloat16, False, "microbatches", 2),  # bf16 main_grad
        ("no_shard", torch.float32, True, "twice", 2),
        ("no_shard", torch.float32, True, "failed", 2),
        ("no_shard", torch.float32, True, "failed_then_forward", 2),
        ("no_shard", torch.float32, True, "recompute", 2),
        ("no_shard", torch.float32, True, "penalty", 2),
        ("no_shard", torch.float32, True, "consumed", 2),
        ("no_shard", torch.float32, True, "consumed_then_failed", 2),
        ("no_shard", torch.float32, True, "microbatches", 1),
        ("optim", torch.float32, True, "microbatches", 1),
    ],
)
def test_fsdp_writes_whole_weight_gradients_into_main_grad(
    strategy, dtype, reduce_in_fp32, scenario, world_size
):
    """Gradients kept whole in their own layout (`no_shard`; ZeRO-1 over one rank): linear
    layers, the root's too, write their weight gradients into `main_grad`, the step's first
    backward over it and later ones added to it, as Megatron-LM's engines do. fc1's weight
    gets a gradient from autograd only where a reduction has yet to replace the gradients held
    (after a step, before the next backward's reduction) or from the penalty. The gradients
    equal the unfused run's and plain PyTorch's (`_fsdp_fused_and_plain`): bitwise on CPU but
    where a GEMM adds its product to the gradients of an earlier backward (one rounding where
    the unfused run rounds the product, then the sum) or to bf16 ones."""
    adds = scenario in ("microbatches", "failed_then_forward") or not reduce_in_fp32
    fused_ranks, plain_ranks = _fsdp_fused_and_plain(
        strategy, dtype, reduce_in_fp32, scenario, world_size, bitwise=not adds
    )
    for fused, plain in zip(fused_ranks, plain_ranks):
        # A second backward after the first finalised ("twice") adds to READY gradients.
        autograd_sees = scenario in ("penalty", "twice", "consumed", "consumed_then_failed")
        assert any(fused["seen"]) == autograd_sees and all(plain["seen"])
        assert set(fused["nodes"]) == {FUSED} and FUSED not in plain["nodes"]
        assert fused["root_fuses"] and not fused["leaked"]
        assert fused["reduce_scatters"] == plain["reduce_scatters"] == 0


def _fsdp_fused_and_plain(
    strategy: str,
    dtype: torch.dtype,
    reduce_in_fp32: bool,
    scenario: str,
    world_size: int,
    *,
    bitwise: bool = True,
) -> tuple[list[dict], list[dict]]:
    """`_fsdp_sends` fused and unfused on `world_size` ranks, after checking that their
    gradients agree with each other (bitwise on CPU, where the fused path forms the same
    products, unless `bitwise` is False; on GPU fusion accumulates bf16 products in fp32, which
    the unfused run rounds first) and with plain PyTorch's (every rank sees the same batches, so
    their average is one process's sum), and that the consumed gradients a failed backward
    leaves agree."""
    args = (strategy, dtype, reduce_in_fp32, scenario)
    fused_ranks = run_distributed(_fsdp_sends, world_size, True, *args)
    plain_ranks = run_distributed(_fsdp_sends, world_size, False, *args)
    expected = None
    if scenario in SEND_SCENARIOS:
        reference = build_tiny_gpt(
            tiny_gpt_config(params_dtype=dtype, bf16=dtype == torch.bfloat16),
            share_embeddings_and_output_weights=True,
        )
        fc1 = reference.decoder.layers[0].mlp.linear_fc1
        penalties = _penalize(fc1) if scenario == "penalty" else []
        for seed in SEND_SCENARIOS[scenario]:
            tokens, labels = device_batch(4, seed)
            (reference(tokens, labels=labels).float().mean() + sum(penalties)).backward()
        expected = {name: p.grad.float() for name, p in reference.named_parameters()}
    on_cpu = select_backend(world_size) == "gloo"
    tolerance = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for fused, plain in zip(fused_ranks, plain_ranks):
        grads = fused["grads"]
        assert grads.keys() == plain["grads"].keys()
        for name, grad in grads.items():
            # Autograd sums the tied weight's two bf16 gradients in bf16, fusion in fp32.
            if bitwise and on_cpu and (dtype == torch.float32 or name != TIED):
                assert torch.equal(grad, plain["grads"][name]), name
            else:
                torch.testing.assert_close(grad, plain["grads"][name], msg=name, **tolerance)
            if expected is not None:
                torch.testing.assert_close(grad.float(), expected[name], msg=name, **tolerance)
        assert any(g.abs().sum() > 0 for g in grads.values())
        if scenario == "consumed_then_failed":
            after = fused["after_failure"]
            assert after.keys() == plain["after_failure"].keys()
            for name, grad in after.items():
                assert grad is not None and torch.equal(grad, plain["after_failure"][name]), name
    return fused_ranks, plain_ranks


def _registered_linear() -> tuple[torch.nn.Parameter, torch.Tensor, _MainGrads]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.float64))
    main_grad = torch.zeros(6, 5, dtype=torch.float64)
    owner = _MainGrads({weight: main_grad})
    register_main_grad(weight, owner.of)
    return weight, main_grad, owner


def test_autograd_grad_and_backward_inputs_leave_main_grad_alone():
    """Only a backward that accumulates into the weight fuses: `torch.autograd.grad` returns
    the weight's gradient when asked for it, and neither it nor `backward(inputs=...)` without
    the weight writes `main_grad`; recomputation (non-reentrant checkpoint) fuses once."""
    weight, main_grad, owner = _registered_linear()
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)

    def loss_of(x):
        return linear(x, weight).square().sum()

    expected_w, expected_x = torch.autograd.grad(x.matmul(weight.t()).square().sum(), (weight, x))
    (grad_x,) = torch.autograd.grad(loss_of(x), x)
    grad_w, grad_x2 = torch.autograd.grad(loss_of(x), (weight, x))
    loss_of(x).backward(inputs=[x])
    assert torch.count_nonzero(main_grad) == 0 and weight.grad is None
    torch.testing.assert_close(grad_w, expected_w)
    for grad in (grad_x, grad_x2, x.grad):
        torch.testing.assert_close(grad, expected_x)
    torch.utils.checkpoint.checkpoint(loss_of, x, use_reentrant=False).backward()
    loss_of(x).backward()
    assert weight.grad is None
    torch.testing.assert_close(main_grad, 2 * expected_w)
    del owner


def test_backward_with_create_graph_fuses_once_differentiable():
    """`backward(create_graph=True)` through a fused linear: its weight's gradient goes into
    `main_grad`, its input's (and bias's) equal `F.linear`'s and differentiating them again
    raises, as the fused layer is differentiable once."""
    weight, main_grad, owner = _registered_linear()
    bias = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(
        torch.nn.functional.linear(x, weight, bias).square().sum(), (weight, x, bias)
    )
    linear(x, weight, bias).square().sum().backward(create_graph=True)
    assert weight.grad is None
    for grad, want in zip((main_grad, x.grad, bias.grad), expected):
        torch.testing.assert_close(grad, want)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        x.grad.sum().backward()
    del owner


def test_autocast_and_torch_func_use_plain_linear():
    """Under `torch.autocast` (bf16 operands for an fp32 weight) and `torch.func.grad`, the
    registered weight trains through `F.linear`: gradients as without registration, and
    `main_grad` untouched."""
    weight, main_grad, owner = _registered_linear()
    weight.data = weight.data.float()
    main_grad = owner.main_grads[weight] = main_grad.float()
    x = torch.randn(3, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear(x, weight).float().square().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (expected,) = torch.autograd.grad(
            torch.nn.functional.linear(x, weight).float().square().sum(), weight
        )
    torch.testing.assert_close(weight.grad, expected)
    weight.grad = None
    grad_x = torch.func.grad(lambda x: linear(x, weight).square().sum())(x)
    torch.testing.assert_close(grad_x, 2 * (x @ weight.detach().t()) @ weight.detach())
    assert torch.count_nonzero(main_grad) == 0


class _MainGrads:
    def __init__(self, main_grads: dict, overwrite: bool = False):
        self.main_grads = main_grads
        self.overwrite = overwrite

    def of(self, param: torch.nn.Parameter) -> FusionTarget:
        return FusionTarget(self.main_grads[param], self.overwrite)


class _Targets:
    def __init__(self):
        self.main_grad = torch.zeros(3, 2)

    def main_grad_of(self, param: torch.nn.Parameter) -> FusionTarget:
        return FusionTarget(self.main_grad)


def test_the_registry_forgets_a_freed_weight():
    """Entries are keyed by id: a weight's entry leaves with it, so a new tensor (which may
    reuse a freed weight's id) is never fused."""
    engine = _Targets()
    registered = len(grad_accumulation._targets)
    weights = [torch.nn.Parameter(torch.ones(3, 2)) for _ in range(8)]
    for weight in weights:
        register_main_grad(weight, engine.main_grad_of)
    assert all(_may_fuse(weight) for weight in weights)
    register_main_grad(weights[0], engine.main_grad_of)  # again: one entry, still fused
    assert len(grad_accumulation._targets) == registered + 8 and _may_fuse(weights[0])
    del weight, weights
    assert len(grad_accumulation._targets) == registered
    assert not any(_may_fuse(torch.nn.Parameter(torch.ones(3, 2))) for _ in range(64))


def _after_engine_deleted() -> tuple[bool, bool]:
    """A deleted engine's weights train as plain parameters: `.grad` set by autograd."""
    ddp = _wrapped(True, torch.float32, "microbatches")
    model = ddp.module
    del ddp
    gc.collect()
    tokens, labels = device_batch(4, 1)
    weight = model.decoder.layers[0].mlp.linear_fc1.weight
    stale = weight.main_grad.clone()
    model(tokens, labels=labels).mean().backward()
    return weight.grad is not None and weight.grad.abs().sum().item() > 0, torch.equal(
        weight.main_grad, stale
    )


def test_deleted_engine_leaves_plain_gradients():
    assert run_distributed(_after_engine_deleted, 2) == [(True, True), (True, True)]


@pytest.mark.parametrize(
    "ddp_kwargs, num_microbatches",
    [
        pytest.param({"overlap_grad_reduce": True, "bucket_size": 2000}, 3, id="overlap-3mb"),
        pytest.param({"average_in_collective": True}, 2, id="average-in-collective-2mb"),
    ],
)
def test_training_with_fusion_matches_single_process(ddp_kwargs, num_microbatches):
    """Three AdamW steps on two ranks, fused, equal one process training the whole batch."""
    model_kwargs = {
        "config": tiny_gpt_config(gradient_accumulation_fusion=True),
        "share_embeddings_and_output_weights": True,
    }
    results = run_distributed(_train_ddp, 2, ddp_kwargs, num_microbatches, model_kwargs)
    expected = _train_single_process(model_kwargs)
    initial = build_tiny_gpt(**model_kwargs).state_dict()
    assert any(not torch.equal(initial[n], expected[n]) for n in expected), "training did nothing"
    for rank_state in results:
        for name in expected:
            torch.testing.assert_close(rank_state[name], expected[name], msg=name)
