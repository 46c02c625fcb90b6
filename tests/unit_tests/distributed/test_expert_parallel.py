"""Expert parallelism in the data-parallel engines: at any EP size and under every engine and
sharding strategy, an MoE model trains exactly as on one process (losses, gradient norms,
global weights), its expert collectives run on the expert groups with the right scaling, its
expert DTensors are the global `[num_experts, ...]` tensors, and meta-device initialisation
creates only each rank's experts. 4 gloo ranks."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.fsdp import local_main_weights
from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.optimizer import get_megatron_optimizer
from tests.unit_tests.distributed.moe_toy import StackedLinear, build_toy_moe
from tests.unit_tests.distributed.moe_training import (
    NUM_EXPERTS,
    Engine,
    default_builder,
    engine_run,
    global_batches,
    init_groups,
    optimizer_config,
    reference_run,
    wrap,
)
from tests.unit_tests.distributed_harness import run_distributed

WORLD = 4

ENGINES = {
    "ddp": Engine("ddp"),
    "ddp_distopt": Engine("ddp", distributed_optimizer=True),
    "no_shard": Engine("fsdp", "no_shard"),
    "optim": Engine("fsdp", "optim"),
    "optim_grads": Engine("fsdp", "optim_grads"),
    "optim_grads_params": Engine("fsdp", "optim_grads_params"),
    "hsdp": Engine("fsdp", "optim_grads_params", replicas=2),
    "hfsdp": Engine("fsdp", "optim_grads_params", outer_strategy="optim", replicas=2),
}


def _compare_with_reference(
    engine: Engine, ep_sizes: tuple[int, ...], num_experts: int = NUM_EXPERTS
) -> None:
    batches = global_batches(WORLD, num_experts=num_experts)
    builder = functools.partial(default_builder, num_experts=num_experts)
    expected = reference_run(builder, batches)
    for ep in ep_sizes:
        actual = engine_run(builder, engine, ep, batches)
        parallel_state.destroy_model_parallel()
        actual.assert_matches(expected, f"EP={ep}")


@pytest.mark.parametrize(
    "name, ep_sizes",
    [
        ("ddp", (1, 2, 4)),
        ("ddp_distopt", (2, 4)),
        ("no_shard", (2,)),
        ("optim", (4,)),
        ("optim_grads", (2,)),
        ("optim_grads_params", (1, 2, 4)),
        ("hsdp", (2,)),
        ("hfsdp", (2,)),
    ],
)
def test_engines_match_single_process_at_every_ep_size(name, ep_sizes):
    run_distributed(_compare_with_reference, WORLD, ENGINES[name], ep_sizes)


@pytest.mark.parametrize("name", ["ddp_distopt", "optim_grads_params", "hfsdp"])
def test_uneven_expert_shards(name):
    # 6 experts at EP=2: 3 per rank, chunked 2 + 1 over the 2 expert data-parallel ranks
    # (nested uneven Shard(0)); at EP=1, 6 over 4 ranks: 2, 2, 2, 0.
    run_distributed(_compare_with_reference, WORLD, ENGINES[name], (1, 2), 6)


def _record_collectives() -> tuple[list[tuple[str, object, int | None]], contextlib.ExitStack]:
    """Wraps the Collectives methods: each call appends (method, group, divisor)."""
    calls: list[tuple[str, object, int | None]] = []
    stack = contextlib.ExitStack()
    for method in ("all_gather_tensors", "reduce_scatter_tensors", "reduce_scatter", "all_reduce"):
        original = getattr(Collectives, method)

        def spy(self, *args, _method=method, _original=original, **kwargs):
            group = args[1] if _method == "all_reduce" else args[2]
            calls.append((_method, group, kwargs.get("divisor")))
            return _original(self, *args, **kwargs)

        stack.enter_context(mock.patch.object(Collectives, method, spy))
    return calls, stack


def _expert_collectives(strategy: str) -> tuple[int, int, int]:
    init_groups(ep=2)
    expt_dp = parallel_state.get_expert_data_parallel_group()
    expt_dp_ag = parallel_state.get_expert_data_parallel_group(
        partial_expert_data_parallel=True, independent_all_gather=True
    )
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    model = wrap(
        default_builder(parallel_state.get_expert_model_parallel_group()), Engine("fsdp", strategy)
    )
    inputs, labels, route = (part[:2] for part in global_batches(WORLD, steps=1)[0])
    calls, spying = _record_collectives()
    optimizer = get_megatron_optimizer(optimizer_config(), model)
    with spying:
        model(inputs, labels, route).mean().backward()
        model.finish_grad_sync()
        optimizer.step()
        model(inputs, labels, route)  # ZeRO-1 gathers the stepped weights before it
    gathers = [group for method, group, _ in calls if method == "all_gather_tensors"]
    reductions = [(group, div) for method, group, div in calls if method != "all_gather_tensors"]
    # Experts gather on their own communicator, never on the main expert group.
    assert expt_dp not in gathers
    # Every reduction is over the dense group (divided by its size) or over expt_dp (divided
    # by the dp x cp size: EP times the group's, as if the experts were replicated).
    for group, divisor in reductions:
        assert group in (dp_cp, expt_dp), group
        assert divisor == WORLD
    expert_reductions = sum(group is expt_dp for group, _ in reductions)
    return gathers.count(expt_dp_ag), expert_reductions, len(reductions)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_expert_collectives_run_on_the_expert_groups(strategy):
    results = run_distributed(_expert_collectives, WORLD, strategy)
    for expert_gathers, expert_reductions, reductions in results:
        assert expert_gathers >= 1
        assert 0 < expert_reductions < reductions


def _global_experts_and_meta_init(ep: int) -> None:
    init_groups(ep)
    ep_group = parallel_state.get_expert_model_parallel_group()
    eager = build_toy_moe(None, num_experts=NUM_EXPERTS).state_dict()
    created: list[torch.Size] = []
    reset = StackedLinear.reset_parameters

    def recording_reset(self):
        created.append(self.weight.shape)
        return reset(self)

    with mock.patch.object(StackedLinear, "reset_parameters", recording_reset):
        model = wrap(default_builder(ep_group, device="meta"), Engine("fsdp", "optim_grads_params"))
    # Each rank materialised its own experts only, one module at a time.
    assert created and all(shape[0] == NUM_EXPERTS // ep for shape in created)
    state = model.state_dict()
    for name, value in eager.items():
        dtensor = state[name]
        assert dtensor.shape == value.shape, name
        torch.testing.assert_close(dtensor.full_tensor(), value, rtol=0, atol=0, msg=name)
    expert = "layers.0.mlp.experts.linear_fc1.weight"
    local = local_main_weights(model.module)[dict(model.module.named_parameters())[expert]]
    assert local.numel() * dist.get_world_size() == eager[expert].numel()


@pytest.mark.parametrize("ep", [2, 4])
def test_meta_init_and_global_expert_dtensors(ep):
    run_distributed(_global_experts_and_meta_init, WORLD, ep)
