"""Communication overlap: prefetching, delayed release under a bound, reduce-scatters on their
own stream, the separate all-gather group, `fsdp_all_gather_in_start_param_sync`, CUDA-graph
capture and NCCL symmetric memory.

The CPU tests check the schedule (what is gathered when, what is held, that results do not
depend on it); the `gpu` tests check on 2 GPUs, with the profiler, that collectives run on side
streams while GEMMs run, and count them, and (on one GPU or two) that what a reduce-scatter on
its stream read is freed once the compute stream has waited for it.
"""

from __future__ import annotations

import contextlib
import gc
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp import (
    FullyShardedDataParallel,
    OverlapPolicy,
    fully_shard,
    fully_shard_optimizer,
    microbatch,
    symmetric_memory,
)
from megatron.core.distributed.fsdp.roots import parameter_groups
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.distributed.fsdp.engine_spies import spy_on_engine
from tests.unit_tests.distributed.fsdp.fsdp_training import LR, full_state, local_adamw
from tests.unit_tests.distributed.fsdp.kernel_trace import (
    compute_stream,
    kernels_of,
    num_overlapping,
)
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    device_batch,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)

NUM_LAYERS = 4
_needs_2_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on the GPU machine)"
)


def _sharded_gpt(policy: OverlapPolicy, strategy: str = "optim_grads_params"):
    model = build_tiny_gpt(tiny_gpt_config(num_layers=NUM_LAYERS))
    for layer in model.decoder.layers:
        fully_shard(layer, sharding_strategy=strategy, overlap_policy=policy)
    return fully_shard(model, sharding_strategy=strategy, overlap_policy=policy)


def _held_layers(model) -> int:
    """Layers whose compute weights are allocated now."""
    return sum(
        group.holds_unsharded for layer in model.decoder.layers for group in layer.fsdp_unit.groups
    )


# Schedule (CPU and GPU).


def _held_and_gathered(max_units: int) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _sharded_gpt(OverlapPolicy(max_unsharded_units=max_units))
    optimizer = local_adamw(model, LR)
    held, held_in_embedding_backward = [], []
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda *unused: held.append(_held_layers(model)))

    def before_embedding_backward(grad: torch.Tensor) -> None:
        held_in_embedding_backward.append(_held_layers(model))

    def hook_embedding_output(module, args, output: torch.Tensor) -> None:
        output.register_hook(before_embedding_backward)

    model.embedding.register_forward_hook(hook_embedding_output)
    gathers_per_step, held_after_forward = [], []
    with spy_on_engine() as calls:
        for tokens, labels in make_token_batches(2, 4):
            tokens = shard_batch(tokens, rank, world_size)
            labels = shard_batch(labels, rank, world_size)
            before = calls.count("gather")
            loss = model(tokens, labels=labels).mean()
            held_after_forward.append(_held_layers(model))
            loss.backward()
            gathers_per_step.append(calls.count("gather") - before)
            optimizer.step()
    return dict(
        held=held,
        gathers=gathers_per_step,
        held_after_forward=held_after_forward,
        held_in_embedding_backward=held_in_embedding_backward,
        held_after=_held_layers(model),
    )


@pytest.mark.parametrize("max_units", [1, 2, 3])
def test_whole_weights_held_up_to_the_bound_and_reused_by_backward(max_units):
    for r in run_distributed(_held_and_gathered, 2, max_units):
        # Released layers stay until gathering another needs the room: exactly the bound.
        assert max(r["held"]) == max_units
        # Whatever the bound, only the last layer (backward's first) outlives the forward, and
        # the first layer (backward's last) is freed once its backward is done.
        assert r["held_after_forward"] == [1, 1]
        assert r["held_in_embedding_backward"] == [0, 0]
        assert r["held_after"] == 0, "compute weights outlived backward"
        # Root + every layer in forward; backward reuses the last layer (the only one kept
        # when the forward ends) and gathers the others again.
        expected = 1 + NUM_LAYERS + NUM_LAYERS - 1
        assert r["gathers"] == [expected, expected]


_POLICIES = {
    "default": OverlapPolicy(),
    "no_prefetch": OverlapPolicy(prefetch=False),
    "no_overlap": OverlapPolicy(prefetch=False, overlap_grad_reduce=False),
    "one_unit": OverlapPolicy(max_unsharded_units=1),
    "all_units": OverlapPolicy(max_unsharded_units=NUM_LAYERS),
}


def _train_with_policy(policy_name: str, strategy: str) -> dict:
    return _train(_POLICIES[policy_name], strategy)


def _train(policy: OverlapPolicy, strategy: str) -> dict:
    """3 steps of 2 microbatches: the losses, the final weights, and where each unit's whole
    weights live (the data pointer of its first group's unsharded buffer, root first)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _sharded_gpt(policy, strategy)
    optimizer = local_adamw(model, LR)
    losses = []
    for tokens, labels in make_token_batches(3, 8):
        tokens = shard_batch(tokens, rank, world_size).chunk(2)
        labels = shard_batch(labels, rank, world_size).chunk(2)
        for i in range(2):
            with microbatch(model, is_first=i == 0, is_last=i == 1):
                loss = model(tokens[i], labels=labels[i]).mean() / 2
                loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    units = [model, *model.decoder.layers]
    places = [unit.fsdp_unit.groups[0].weights.unsharded.data.data_ptr() for unit in units]
    return dict(losses=torch.stack(losses), state=full_state(model), places=places)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_overlap_settings_leave_results_bitwise_unchanged(strategy):
    reference = run_distributed(_train_with_policy, 2, "no_overlap", strategy)
    for name in _POLICIES:
        for r, ref in zip(run_distributed(_train_with_policy, 2, name, strategy), reference):
            torch.testing.assert_close(r["losses"], ref["losses"], rtol=0, atol=0, msg=name)
            for key, value in ref["state"].items():
                torch.testing.assert_close(r["state"][key], value, rtol=0, atol=0, msg=key)


def test_overlap_policy_rejects_a_zero_bound():
    with pytest.raises(ValueError, match="max_unsharded_units"):
        OverlapPolicy(max_unsharded_units=0)


def _first_forward_with_a_layer_policy(root_policy: OverlapPolicy | None) -> str:
    model = build_tiny_gpt(tiny_gpt_config(num_layers=2))
    for layer in model.decoder.layers:
        fully_shard(layer, overlap_policy=OverlapPolicy(max_unsharded_units=1))
    fully_shard(model, overlap_policy=root_policy)
    tokens, labels = device_batch(2)
    try:
        model(tokens, labels=labels)
    except ValueError as error:
        return str(error)
    return "ran"


def test_a_layer_policy_other_than_the_roots_is_refused():
    # One schedule governs a root's units: a different one below it would be silently ignored.
    message = run_distributed(_first_forward_with_a_layer_policy, 1, None)[0]
    assert "TransformerLayer" in message and "Pass the same OverlapPolicy" in message
    # Repeated on the root, it is the root's.
    same = OverlapPolicy(max_unsharded_units=1)
    assert run_distributed(_first_forward_with_a_layer_policy, 1, same)[0] == "ran"


# Ordering gathers after writes to the main weights.


def _orders_and_gathers() -> dict:
    """What a unit used on its own issues (`order` of the all-gather stream after the compute
    stream, `gather`) after a backward, after an optimizer step, and after a load."""
    model = _sharded_gpt(OverlapPolicy())
    optimizer = local_adamw(model, LR)
    tokens, labels = device_batch(4)
    model(tokens, labels=labels).mean().backward()
    first, second = model.decoder.layers[1], model.decoder.layers[2]
    seen = {}
    with spy_on_engine() as calls:
        for moment, change in [
            ("after_backward", None),
            ("after_step", optimizer.step),
            ("after_load", lambda: model.load_state_dict(model.state_dict())),
        ]:
            if change is not None:
                change()
            calls.log.clear()
            first.unshard()
            second.unshard()
            seen[moment] = [event for event in calls.log if event in ("order", "gather")]
            first.reshard()
            second.reshard()
    return seen


def test_gathers_started_outside_a_pass_follow_the_latest_writes():
    # A gather started outside a forward (a unit used on its own, after a backward, a step or
    # a load) follows the compute stream's queued work, which may have written the main
    # weights; inside a forward the root's start orders them all.
    expected = ["order", "gather", "order", "gather"]
    for seen in run_distributed(_orders_and_gathers, 2):
        assert seen == dict(after_backward=expected, after_step=expected, after_load=expected)


# start_param_sync.


def _adapter(ddp_kwargs: dict, model=None, pg_collection=None) -> FullyShardedDataParallel:
    model = model if model is not None else build_tiny_gpt()
    kwargs = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    kwargs.update(ddp_kwargs)
    config = DistributedDataParallelConfig(**kwargs)
    return FullyShardedDataParallel(model.config, config, model, pg_collection=pg_collection)


def _gathers_in_start_param_sync(in_start: bool) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fsdp = _adapter({"fsdp_all_gather_in_start_param_sync": in_start})
    optimizer = local_adamw(fsdp, LR)
    in_sync, per_step, losses = [], [], []
    with spy_on_engine() as calls:
        for tokens, labels in make_token_batches(2, 4):
            tokens = shard_batch(tokens, rank, world_size)
            labels = shard_batch(labels, rank, world_size)
            start = calls.count("gather")
            fsdp.start_param_sync()
            in_sync.append(calls.count("gather") - start)
            fsdp.zero_grad_buffer()
            loss = fsdp(tokens, labels=labels).mean()
            loss.backward()
            fsdp.finish_grad_sync()
            optimizer.step()
            per_step.append(calls.count("gather") - start)
            losses.append(loss.detach())
    return dict(in_sync=in_sync, per_step=per_step, losses=torch.stack(losses))


def test_start_param_sync_issues_the_first_all_gather_only_when_asked():
    eager = run_distributed(_gathers_in_start_param_sync, 2, True)
    lazy = run_distributed(_gathers_in_start_param_sync, 2, False)
    for r_eager, r_lazy in zip(eager, lazy):
        assert r_eager["in_sync"] == [1, 1]  # the root's one group
        assert r_lazy["in_sync"] == [0, 0]
        # The forward then uses the gathered root instead of gathering it again.
        assert r_eager["per_step"] == r_lazy["per_step"]
        torch.testing.assert_close(r_eager["losses"], r_lazy["losses"], rtol=0, atol=0)


def _symm_mem_on_cpu() -> str:
    with pytest.raises(ValueError, match="use_symm_mem") as error:
        _adapter({"use_symm_mem": True})
    return str(error.value)


# Symmetric-memory windows. On CPU, plain memory stands in for them (filled with 0xFF bytes, NaN
# in floating point, so a read of weights never gathered shows), which runs the placement and the
# slot discipline under gloo; the GPU test below runs NCCL's symmetric kernels.


@contextlib.contextmanager
def _plain_windows():
    def window(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        return torch.full((nbytes,), 255, dtype=torch.uint8, device=device)

    with (
        mock.patch.object(symmetric_memory, "_window", window),
        mock.patch.object(symmetric_memory, "check_symm_mem_support"),
    ):
        yield


def _plain_losses() -> torch.Tensor:
    """`_train`'s steps in one process without Megatron-FSDP, each on the whole batch (what the
    ranks' microbatches average to): the loss of each step."""
    model = build_tiny_gpt(tiny_gpt_config(num_layers=NUM_LAYERS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens, labels in make_token_batches(3, 8):
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _train_in_windows(policy: OverlapPolicy, strategy: str) -> dict:
    with _plain_windows():
        return _train(policy, strategy)


@pytest.mark.parametrize(
    "strategy, policy, layer_slots",
    [
        # ZeRO-3: the 4 layers share max_unsharded_units + 1 slots, in module order.
        ("optim_grads_params", OverlapPolicy(max_unsharded_units=1, use_symm_mem=True), "abab"),
        ("optim_grads_params", OverlapPolicy(use_symm_mem=True), "abca"),
        ("optim_grads_params", OverlapPolicy(prefetch=False, use_symm_mem=True), "abca"),
        # Kept across microbatches, every unit may hold its weights at once.
        (
            "optim_grads_params",
            OverlapPolicy(use_symm_mem=True, keep_unsharded_params=True),
            "abcd",
        ),
        # ZeRO-2: compute weights persist, each in a place of its own.
        ("optim_grads", OverlapPolicy(max_unsharded_units=1, use_symm_mem=True), "abcd"),
    ],
)
def test_weights_in_symmetric_windows_train_bitwise_as_without(strategy, policy, layer_slots):
    reference = run_distributed(_train_with_policy, 2, "no_overlap", strategy)
    windows = run_distributed(_train_in_windows, 2, policy, strategy)
    # Each step's loss over the whole batch: the ranks' mean of their two microbatches' halves.
    losses = sum(r["losses"].view(-1, 2).sum(dim=1) for r in windows) / 2
    torch.testing.assert_close(losses, _plain_losses())
    for r, ref in zip(windows, reference):
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=0, atol=0)
        for key, value in ref["state"].items():
            torch.testing.assert_close(r["state"][key], value, rtol=0, atol=0, msg=key)
        root, *layers = r["places"]
        # Layers with one letter share their place; no layer shares the root's.
        assert [layers.index(place) for place in layers] == [
            layer_slots.index(slot) for slot in layer_slots
        ]
        assert root not in layers


class _Step(torch.nn.Module):
    """A linear layer and tanh, then `then` (another step, run inside this one) if given."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, then: torch.nn.Module | None = None) -> torch.Tensor:
        x = torch.tanh(self.linear(x))
        return x if then is None else then(x)


class _Flow(torch.nn.Module):
    """A linear layer, then `num_steps` steps, run in the order each forward is given: (i, j)
    runs step i and, inside it, step j (None: none)."""

    def __init__(self, num_steps: int = 4):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.steps = torch.nn.ModuleList(_Step() for _ in range(num_steps))

    def forward(self, x: torch.Tensor, flow: list[tuple[int, int | None]]) -> torch.Tensor:
        x = torch.tanh(self.linear(x))
        for i, j in flow:
            x = self.steps[i](x, None if j is None else self.steps[j])
        return x.pow(2).mean()


class _Parent(torch.nn.Module):
    """A linear layer, then a `_Flow` body: with the body a unit, it is in use while all 4
    steps run."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.body = _Flow()

    def forward(self, x: torch.Tensor, flow: list[tuple[int, int | None]]) -> torch.Tensor:
        return self.body(torch.tanh(self.linear(x)), flow)


def _in_order(num_steps: int) -> list[tuple[int, None]]:
    return [(i, None) for i in range(num_steps)]


def _flow_model(parent: bool, flows: list) -> torch.nn.Module:
    """A `_Flow` of the steps `flows` run (a `_Parent` of 4 steps if `parent`), seeded."""
    torch.manual_seed(0)
    num_steps = 1 + max(max(i, j or 0) for flow in flows for i, j in flow)
    return _Parent() if parent else _Flow(num_steps)


def _flows_in_windows(parent: bool, flows: list, max_units: int, use_symm_mem: bool) -> dict:
    """Trains 2 ranks' `_Flow` of the steps `flows` run (4 steps under a `_Parent` whose body
    is a unit, if `parent`), each step a unit, one SGD step per flow: the losses and where each
    unit's compute weights live, or the error raised."""
    model = _flow_model(parent, flows)
    flow_module = model.body if parent else model
    policy = OverlapPolicy(max_unsharded_units=max_units, use_symm_mem=use_symm_mem)
    for step in flow_module.steps:
        fully_shard(step, overlap_policy=policy)
    if parent:
        fully_shard(model.body, overlap_policy=policy)
    fully_shard(model, overlap_policy=policy)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    with _plain_windows():  # the context (and its windows) is built with the optimizer
        optimizer = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
        try:
            losses = _train_flows(model, optimizer, x, flows)
        except RuntimeError as error:
            return dict(error=str(error))
    places = {
        name: module.fsdp_unit.groups[0].weights.unsharded.data.data_ptr()
        for name, module in model.named_modules()
        if hasattr(module, "fsdp_unit") and module is not model
    }
    return dict(losses=losses, places=places)


def _train_flows(model, optimizer, x: torch.Tensor, flows: list) -> torch.Tensor:
    """One optimizer step per flow; the losses."""
    losses = []
    for flow in flows:
        loss = model(x, flow)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _plain_flow_losses(parent: bool, flows: list) -> torch.Tensor:
    """`_flows_in_windows`'s training in one process without Megatron-FSDP, on the inputs of
    both ranks together."""
    model = _flow_model(parent, flows)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.cat([torch.randn(2, 8, generator=torch.Generator().manual_seed(r)) for r in (0, 1)])
    return _train_flows(model, optimizer, x, flows)


_OUT_OF_ORDER = [(0, None), (4, None), (2, None), (3, None), (1, None)]


@pytest.mark.parametrize(
    "parent, flows, max_units, step_slots",
    [
        # A unit in use while its 4 child units run (more than the 2 slots of
        # max_unsharded_units=1) has a place of its own; its children share the slots.
        (True, [_in_order(4)] * 3, 1, "abab"),
        # The second forward runs the steps out of the first's order: the prefetch that
        # followed step 0 the first time (step 1) is never used, and step 4, in its slot,
        # takes the slot.
        (False, [_in_order(5), _OUT_OF_ORDER, _in_order(5)], 2, "abcab"),
    ],
)
def test_windows_follow_units_nested_or_run_out_of_order(parent, flows, max_units, step_slots):
    windows = run_distributed(_flows_in_windows, 2, parent, flows, max_units, True)
    default = run_distributed(_flows_in_windows, 2, parent, flows, max_units, False)
    # Plain PyTorch on both ranks' inputs at once: its loss is the ranks' mean.
    torch.testing.assert_close(
        (windows[0]["losses"] + windows[1]["losses"]) / 2, _plain_flow_losses(parent, flows)
    )
    for r, ref in zip(windows, default):
        assert "error" not in r, r.get("error")
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=0, atol=0)
        names = sorted(name for name in r["places"] if "steps." in name)
        steps = [r["places"][name] for name in names]
        assert [steps.index(p) for p in steps] == [step_slots.index(c) for c in step_slots]
        if parent:
            assert r["places"]["body"] not in steps


def test_units_of_one_window_slot_in_use_at_once_are_refused_by_name():
    # Step 0 runs step 2, not its submodule, inside it: with max_unsharded_units=1 (2 slots)
    # both are in slot 0 and in use at once, so one would overwrite the other's weights.
    flows = [[(0, 2), (1, None), (3, None)]]
    for r in run_distributed(_flows_in_windows, 2, False, flows, 1, True):
        message = r.get("error", "")
        assert "use_symm_mem" in message and "max_unsharded_units" in message, r
        assert "steps.2" in message and "steps.0" in message, message
    # With 3 slots step 2 has one of its own, and training runs.
    for r in run_distributed(_flows_in_windows, 2, False, flows, 2, True):
        assert "error" not in r, r.get("error")


def test_use_symm_mem_without_cuda_names_the_flag():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: symmetric memory may work here")
    message = run_distributed(_symm_mem_on_cpu, 2)[0]
    assert "CUDA" in message and "use_symm_mem=False" in message


# GPU: the profiler's view of overlap, memory, CUDA graphs, symmetric memory.


def _gpu_model(hidden: int = 2048, num_layers: int = NUM_LAYERS, seq: int = 2048):
    config = tiny_gpt_config(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=hidden // 128,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    return build_tiny_gpt(config, vocab_size=8192, max_sequence_length=seq)


def _gpu_batch(seq: int = 2048, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(0, 8192, (batch, seq + 1), generator=generator).cuda()
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _train_step(fsdp, optimizer, tokens, labels) -> torch.Tensor:
    fsdp.start_param_sync()
    fsdp.zero_grad_buffer()
    loss = fsdp(tokens, labels=labels).mean()
    loss.backward()
    fsdp.finish_grad_sync()
    optimizer.step()
    return loss.detach()


@contextlib.contextmanager
def _deterministic_attention():
    """Math attention: the flash kernel's backward accumulates with atomics, so two runs of
    the same step can differ in the last bits, which would hide what a comparison tests."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


@contextlib.contextmanager
def _mpu_groups(create_all_gather_group: bool):
    parallel_state.initialize_model_parallel(create_all_gather_group=create_all_gather_group)
    try:
        yield ProcessGroupCollection.use_mpu_process_groups()
    finally:
        parallel_state.destroy_model_parallel()


# About 50 ms of GPU time at H100/H200 clocks: longer than the host takes to queue a pass.
_HOST_LEAD_CYCLES = 100_000_000


@_deterministic_attention()
def _overlap_counts(create_all_gather_group: bool) -> dict:
    with _mpu_groups(create_all_gather_group) as pgs:
        fsdp = _adapter(
            {"overlap_param_gather": True, "overlap_grad_reduce": True},
            model=_gpu_model(seq=4096),
            pg_collection=pgs,
        )
        optimizer = local_adamw(fsdp, LR)
        # Enough work per layer (long sequences, math attention) that the GPU, not the host,
        # sets the pace: a prefetch can only overlap kernels the host has already queued.
        tokens, labels = _gpu_batch(seq=4096)
        losses = [_train_step(fsdp, optimizer, tokens, labels) for _ in range(2)]
        fsdp.start_param_sync()
        fsdp.zero_grad_buffer()
        out = {}

        # In training the host runs ahead of the GPU: when a pass is issued the compute stream
        # still has earlier work queued, so each collective is queued before the GEMMs it
        # should overlap run. The profiler starts on an idle GPU instead, where a collective
        # can finish before the host has queued the next GEMM; a sleep kernel restores the
        # lead (as PyTorch's FSDP2 overlap tests do), so the counts measure the schedule, not
        # the host's speed.
        def forward():
            torch.cuda._sleep(_HOST_LEAD_CYCLES)
            out["loss"] = fsdp(tokens, labels=labels).mean()

        def backward():
            torch.cuda._sleep(_HOST_LEAD_CYCLES)
            out["loss"].backward()

        forward, backward = kernels_of(forward), kernels_of(backward)
        fsdp.finish_grad_sync()
        optimizer.step()
        losses.append(out["loss"].detach())
        stream = compute_stream(forward + backward)
        gathers_fwd = [k for k in forward if k.is_all_gather]
        gathers_bwd = [k for k in backward if k.is_all_gather]
        scatters = [k for k in backward if k.is_reduce_scatter]
        return dict(
            gathers_fwd=len(gathers_fwd),
            gathers_fwd_overlapped=num_overlapping(forward, gathers_fwd),
            gathers_bwd=len(gathers_bwd),
            gathers_bwd_overlapped=num_overlapping(backward, gathers_bwd),
            scatters=len(scatters),
            scatters_overlapped=num_overlapping(backward, scatters),
            nccl_on_compute_stream=sum(
                k.stream == stream for k in gathers_fwd + gathers_bwd + scatters
            ),
            gather_while_scatter=sum(any(g.overlaps(s) for s in scatters) for g in gathers_bwd),
            losses=torch.stack(losses),
        )


@pytest.mark.gpu
@_needs_2_gpus
def test_forward_all_gathers_overlap_gemms():
    for r in run_distributed(_overlap_counts, 2, True):
        # The root (the final norm) was gathered in start_param_sync. The embedding, each
        # layer and the output layer are gathered while the unit before them computes: all
        # under a GEMM but the embedding's (issued where the root's forward starts) and the
        # first layer's (under the embedding's lookup).
        assert r["gathers_fwd"] == NUM_LAYERS + 2, r
        assert r["gathers_fwd_overlapped"] >= NUM_LAYERS, r


@pytest.mark.gpu
@_needs_2_gpus
def test_backward_collectives_overlap_gemms_on_side_streams():
    for r in run_distributed(_overlap_counts, 2, True):
        # The output layer, kept when the forward ends, is reused; every layer and the
        # embedding are prefetched during the backward of the unit after them. The
        # reduce-scatter of every layer but the first runs under a later layer's GEMMs; the
        # output layer's runs under the final norm's backward (no GEMM; it can end there), the
        # first layer's under the embedding's, and the embedding's and the root's (their inputs
        # need no gradient) at the end.
        assert r["gathers_bwd"] == NUM_LAYERS + 1, r
        assert r["gathers_bwd_overlapped"] >= NUM_LAYERS + 1, r
        assert r["scatters"] == NUM_LAYERS + 3, r
        assert r["scatters_overlapped"] >= NUM_LAYERS - 1, r
        assert r["nccl_on_compute_stream"] == 0, r


@pytest.mark.gpu
@_needs_2_gpus
def test_separate_all_gather_group_runs_all_gather_and_reduce_scatter_concurrently():
    separate = run_distributed(_overlap_counts, 2, True)
    shared = run_distributed(_overlap_counts, 2, False)
    for r_separate, r_shared in zip(separate, shared):
        assert r_separate["gather_while_scatter"] >= 1
        # One communicator runs its collectives one after another: the control.
        assert r_shared["gather_while_scatter"] == 0
        torch.testing.assert_close(r_separate["losses"], r_shared["losses"], rtol=0, atol=0)


@_deterministic_attention()
def _gpu_losses(ddp_kwargs: dict, num_microbatches: int = 2) -> torch.Tensor:
    fsdp = _adapter(ddp_kwargs, model=_gpu_model(hidden=1024, seq=1024))
    optimizer = local_adamw(fsdp, LR)
    tokens, labels = _gpu_batch(seq=1024, batch=2 * num_microbatches)
    tokens, labels = tokens.chunk(num_microbatches), labels.chunk(num_microbatches)
    losses = []
    for _ in range(3):
        fsdp.start_param_sync()
        fsdp.zero_grad_buffer()
        for i in range(num_microbatches):
            last = i == num_microbatches - 1
            with contextlib.nullcontext() if last else fsdp.no_sync():
                loss = fsdp(tokens[i], labels=labels[i]).mean() / num_microbatches
                loss.backward()
            losses.append(loss.detach())
        fsdp.finish_grad_sync()
        optimizer.step()
    return torch.stack(losses)


@pytest.mark.gpu
@_needs_2_gpus
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_overlap_on_and_off_give_bitwise_equal_losses_on_gpu(strategy):
    off = dict(data_parallel_sharding_strategy=strategy, fsdp_all_gather_in_start_param_sync=False)
    on = dict(off, overlap_param_gather=True, overlap_grad_reduce=True)
    on["fsdp_all_gather_in_start_param_sync"] = True
    overlapped, serial = run_distributed(_gpu_losses, 2, on), run_distributed(_gpu_losses, 2, off)
    for r_on, r_off in zip(overlapped, serial):
        torch.testing.assert_close(r_on, r_off, rtol=0, atol=0)


def _gather_kernels() -> dict:
    fsdp = _adapter({}, model=_gpu_model(hidden=512, num_layers=2, seq=256))
    layer = fsdp.module.decoder.layers[0]
    layer.unshard()  # compiles the cast
    layer.reshard()
    torch.cuda.synchronize()
    kernels = kernels_of(layer.unshard)
    weights = [group.weights for group in layer.fsdp_unit.groups]
    exact = all(
        torch.equal(compute, main.to(compute.dtype))
        for w in weights
        for compute, main in zip(w.unsharded_params, w.local_main_weights)
    )
    return dict(kernels=[k.name for k in kernels], groups=len(weights), exact=exact)


@pytest.mark.gpu
def test_a_gather_casts_its_shard_in_one_kernel_per_group():
    """One rank: no collective, so a layer's gather is its cast alone, one launch per
    parameter group (`SegmentCopy`), with the bytes of the main weights cast by `to`."""
    (result,) = run_distributed(_gather_kernels, 1)
    assert len(result["kernels"]) == result["groups"], result
    assert all("segment_copy" in name for name in result["kernels"]), result
    assert result["exact"]


def _forward_memory() -> dict:
    tokens, labels = _gpu_batch(seq=1024)
    plain = _gpu_model(hidden=1024, seq=1024)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    plain(tokens, labels=labels).mean()
    activations = torch.cuda.max_memory_allocated() - base
    del plain
    gc.collect()  # the plain model's reference cycles, so the baseline holds none of it
    before_model = torch.cuda.memory_allocated()

    fsdp = _adapter(
        {"overlap_param_gather": True, "overlap_grad_reduce": True},
        model=_gpu_model(hidden=1024, seq=1024),
    )
    optimizer = local_adamw(fsdp, LR)
    _train_step(fsdp, optimizer, tokens, labels)  # optimizer state exists from here on
    fsdp.start_param_sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fsdp(tokens, labels=labels).mean()
    peak = torch.cuda.max_memory_allocated() - base
    groups = parameter_groups(fsdp.module)
    unsharded = [g.weights.unsharded for g in groups]
    whole = [b.layout.numel * b.data.element_size() for b in unsharded]
    root_bytes = sum(whole[: len(fsdp.module.fsdp_unit.groups)])
    loss.backward()
    del loss, fsdp, optimizer, groups
    return dict(
        activations=activations,
        peak=peak,
        root=root_bytes,
        largest_unit=max(whole),
        leftover=torch.cuda.memory_allocated() - before_model,
    )


@pytest.mark.gpu
@_needs_2_gpus
def test_forward_memory_is_bounded_and_freed_with_the_model():
    bound = OverlapPolicy().max_unsharded_units
    # The model has more layers than the bound lets live at once (plus one unit's worth of
    # all-gather transients), so the limit below is tighter than holding every layer's weights.
    assert NUM_LAYERS > bound + 1
    for r in run_distributed(_forward_memory, 2):
        # Activations and temporaries (those of the unsharded model), plus compute weights of
        # the root and of at most `bound` layers, plus at most one unit of all-gather transients
        # (the cast shard gathered from; with symmetric memory, the window being unpacked).
        limit = r["activations"] + r["root"] + (bound + 1) * r["largest_unit"]
        assert r["peak"] <= limit, r
        assert r["leftover"] == 0, "the model's GPU memory outlived it"


def _memory_held_after_backward() -> dict:
    tokens, labels = _gpu_batch(seq=512)
    # A plain model's pass first, so that lazily made state (cuBLAS workspaces) is in the
    # baseline below.
    plain = _gpu_model(hidden=512, seq=512)
    plain(tokens, labels=labels).mean().backward()
    del plain
    gc.collect()
    fsdp = _adapter(
        {"overlap_param_gather": True, "overlap_grad_reduce": True, "grad_reduce_in_fp32": True},
        model=_gpu_model(hidden=512, seq=512),
    )
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fsdp(tokens, labels=labels).mean().backward()
    fsdp.finish_grad_sync()
    torch.cuda.synchronize()
    grads = [group.grads for group in parameter_groups(fsdp.module)]
    layer = fsdp.module.decoder.layers[0].fsdp_unit.groups[0]
    return dict(
        held=torch.cuda.memory_allocated() - before,
        shards=sum(g.main_grad.data.untyped_storage().nbytes() for g in grads),
        # What one layer's bf16 gradients take cast to fp32 for their reduce-scatter.
        layer_cast=4 * layer.weights.layout.numel,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gradients_cast_for_a_reduce_scatter_are_freed_once_it_has_run():
    # Reduced on their own stream, the cast gradients live until the compute stream waits for
    # that stream; after backward the reduced gradient shards remain (and small lazily made
    # state), nothing as large as one layer's cast gradients.
    for r in run_distributed(_memory_held_after_backward, min(torch.cuda.device_count(), 2)):
        assert r["shards"] <= r["held"] < r["shards"] + r["layer_cast"], r


def _graph_step_losses() -> dict:
    tokens, labels = _gpu_batch(seq=512)
    ddp_kwargs = {
        "overlap_param_gather": True,
        "overlap_grad_reduce": True,
        "fsdp_all_gather_in_start_param_sync": False,
    }

    def build():
        fsdp = _adapter(ddp_kwargs, model=_gpu_model(hidden=512, num_layers=2, seq=512))
        adam = torch.optim.AdamW(fsdp.parameters(), lr=LR, capturable=True, foreach=True)
        return fsdp, fully_shard_optimizer(adam, fsdp)

    eager_model, eager_optimizer = build()
    eager = [_train_step(eager_model, eager_optimizer, tokens, labels) for _ in range(6)]

    fsdp, optimizer = build()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warmup = [_train_step(fsdp, optimizer, tokens, labels).clone() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _train_step(fsdp, optimizer, tokens, labels)
    replayed = []
    for _ in range(3):
        graph.replay()
        replayed.append(static_loss.clone())
    return dict(eager=torch.stack(eager), graphed=torch.stack(warmup + replayed))


@pytest.mark.gpu
@_needs_2_gpus
def test_whole_training_step_captures_in_a_cuda_graph():
    for r in run_distributed(_graph_step_losses, 2):
        torch.testing.assert_close(r["graphed"], r["eager"])
        assert not torch.equal(r["graphed"][3], r["graphed"][5]), "replays did not train"


@_deterministic_attention()
def _symm_mem_run(use_symm_mem: bool) -> dict:
    fsdp = _adapter(
        {
            "overlap_param_gather": True,
            "overlap_grad_reduce": True,
            "grad_reduce_in_fp32": True,
            "use_symm_mem": use_symm_mem,
        },
        model=_gpu_model(hidden=1024, seq=1024),
    )
    optimizer = local_adamw(fsdp, LR)
    tokens, labels = _gpu_batch(seq=1024)
    losses = [_train_step(fsdp, optimizer, tokens, labels) for _ in range(3)]
    out = {}
    step = lambda: out.setdefault("loss", _train_step(fsdp, optimizer, tokens, labels))  # noqa: E731
    kernels = kernels_of(step)
    losses.append(out["loss"])
    nccl = sorted({k.name for k in kernels if k.is_all_gather or k.is_reduce_scatter})
    return dict(losses=torch.stack(losses), nccl_kernels=nccl)


@pytest.mark.gpu
@_needs_2_gpus
def test_symmetric_memory_matches_default_and_gathers_with_symmetric_kernels():
    symmetric = run_distributed(_symm_mem_run, 2, True)
    default = run_distributed(_symm_mem_run, 2, False)
    for r_symm, r_default in zip(symmetric, default):
        # 2 ranks: SUM then halve equals NCCL's AVG exactly (halving is exact in fp32).
        torch.testing.assert_close(r_symm["losses"], r_default["losses"], rtol=0, atol=0)
        symk = [name.lower().replace("_", "") for name in r_symm["nccl_kernels"]]
        symk = [name for name in symk if "symk" in name]
        # The weights are gathered in their windows by the symmetric kernel; gradients are
        # reduce-scattered by the default kernels (the symmetric one is no faster for them).
        assert any("allgather" in name for name in symk), r_symm["nccl_kernels"]
        assert not any("reducescatter" in name for name in symk), r_symm["nccl_kernels"]
        assert not any("symk" in name.lower() for name in r_default["nccl_kernels"])
