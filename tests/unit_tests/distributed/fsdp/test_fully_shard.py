"""Megatron-FSDP behaviours beyond parity: sharded memory, once-per-step weight sync, tied and
frozen parameters, meta-device initialisation, unwrapped parents, and errors on bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from megatron.core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES
from megatron.core.distributed.fsdp import (
    FSDPDistributedIndex,
    FsdpModule,
    fully_shard,
    fully_shard_optimizer,
    local_main_weights,
    microbatch,
)
from megatron.core.distributed.fsdp.roots import fsdp_contexts, fsdp_roots, parameter_groups
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from tests.unit_tests.distributed.fsdp.engine_spies import spy_on_engine
from tests.unit_tests.distributed.fsdp.fsdp_training import (
    UnevenNet,
    build_model,
    full_state,
    make_batches,
    train_fsdp,
    train_reference,
    unit_modules,
)
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    SEQ_LENGTH,
    VOCAB_SIZE,
    device_batch,
    shard_batch,
    tiny_gpt_config,
)


def _shard_model(model: torch.nn.Module, strategy: str = "optim_grads_params", **kwargs):
    for unit in unit_modules(model):
        fully_shard(unit, sharding_strategy=strategy, **kwargs)
    return fully_shard(model, sharding_strategy=strategy, **kwargs)


def _one_step(model, optimizer, bf16=False):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, labels = make_batches("uneven")[0]
    inputs, labels = shard_batch(inputs, rank, world_size), shard_batch(labels, rank, world_size)
    model(inputs, labels=labels).mean().backward()
    optimizer.step()


# Sharded state.


def _sharded_bytes(strategy: str) -> dict:
    model = _shard_model(build_model("uneven", False), strategy)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    _one_step(model, optimizer)
    groups = parameter_groups(model)
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, DTensor)]
    return {
        "main_weights": sum(p.to_local().numel() for g in groups for p in g.main_weights),
        "optimizer_state": sum(t.to_local().numel() for t in states),
        "main_grad": sum(g.grads.main_grad.data.numel() for g in groups),
        # Compute-dtype weights held between steps (ZeRO-3 gathers from the main weights).
        "model_weights_held": sum(
            g.weights.unsharded.data.numel() for g in groups if g.holds_unsharded
        ),
        "grads_held": all(g.holds_grads for g in groups),
        "grads_held_after_zero_grad": _grads_held_after_zero_grad(model, optimizer, groups),
    }


def _grads_held_after_zero_grad(model, optimizer, groups) -> bool:
    optimizer.zero_grad()  # set_to_none: the next forward frees what nothing can reach
    inputs, labels = make_batches("uneven")[0]
    with torch.no_grad():
        model(inputs, labels=labels)
    return any(g.holds_grads for g in groups)


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_each_rank_holds_its_share_of_state(strategy):
    world_size = 4
    results = run_distributed(_sharded_bytes, world_size, strategy)
    shapes = [p.shape for p in UnevenNet().parameters()]
    total = sum(math.prod(s) for s in shapes)
    # Each tensor is padded to whole chunks of ceil(rows / N) rows.
    padded_share = sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in shapes)
    sharded = strategy != "no_shard"
    main_weights = [r["main_weights"] for r in results]
    if sharded:
        assert sum(main_weights) == total, main_weights
        assert max(main_weights) <= padded_share < total
    else:
        assert main_weights == [total] * world_size
    # AdamW keeps two states per weight, sharded like the weights.
    assert sum(r["optimizer_state"] for r in results) == 2 * total * (1 if sharded else 4)
    for r in results:
        if strategy in ("optim_grads", "optim_grads_params"):
            assert r["main_grad"] == padded_share
        else:
            assert r["main_grad"] >= total
        if strategy == "optim_grads_params":
            assert r["model_weights_held"] == 0, "compute weights outlived the step"
        else:
            assert r["model_weights_held"] >= total
        assert r["grads_held"] and not r["grads_held_after_zero_grad"]


def _grads_held_stepping_local_shards(strategy: str) -> tuple[bool, bool]:
    model = _shard_model(build_model("uneven", False), strategy)
    optimizer = torch.optim.AdamW(local_main_weights(model).values(), lr=1e-3)
    optimizer = fully_shard_optimizer(optimizer, model)
    _one_step(model, optimizer)
    groups = parameter_groups(model)
    held_after_step = all(g.holds_grads for g in groups)
    return held_after_step, _grads_held_after_zero_grad(model, optimizer, groups)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_zero_grad_of_an_optimizer_over_local_shards_frees_gradients(strategy):
    for held_after_step, held_after_zero_grad in run_distributed(
        _grads_held_stepping_local_shards, 2, strategy
    ):
        assert held_after_step and not held_after_zero_grad


# Weight sync counting.


def _count_weight_syncs(strategy: str) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _shard_model(build_model("gpt", True), strategy)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    groups = parameter_groups(model)
    tokens, labels = device_batch(6)
    tokens, labels = tokens.chunk(world_size)[rank], labels.chunk(world_size)[rank]
    with spy_on_engine() as calls:

        def syncs() -> list[int]:
            return [calls.refreshes[id(g.weights)] for g in groups]

        for _ in range(2):
            for i in range(3):
                with microbatch(model, is_first=i == 0, is_last=i == 2):
                    model(tokens, labels=labels).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        syncs_in_loop = syncs()
        gathers_in_loop = calls.count("gather")
        with torch.no_grad(), microbatch(model, is_first=False, is_last=True):
            model(tokens, labels=labels)
        stale_after_skipped = [g.weights.is_stale for g in groups]
        with torch.no_grad():
            fsdp_loss = model(tokens, labels=labels)
        syncs_after = syncs()
    plain = build_model("gpt", True)
    plain.load_state_dict({k: v.to(torch.bfloat16) for k, v in full_state(model).items()})
    with torch.no_grad():
        plain_loss = plain(tokens, labels=labels)
    return dict(
        syncs_in_loop=syncs_in_loop,
        gathers_in_loop=gathers_in_loop,
        on_device=[g.weights.refreshes_on_device for g in groups],
        num_groups=len(groups),
        stale_after_skipped=stale_after_skipped,
        syncs_after=syncs_after,
        fsdp_loss=fsdp_loss,
        plain_loss=plain_loss,
    )


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "no_shard"])
def test_weight_sync_once_per_step_and_fresh_outside_microbatch(strategy):
    for r in run_distributed(_count_weight_syncs, 2, strategy):
        # Step 1 starts in sync; step 1's update is synced once, in step 2's first microbatch.
        assert r["syncs_in_loop"] == [1] * r["num_groups"]
        # ZeRO-3's refresh queues nothing (each use gathers); ZeRO-2's gathers the new bf16
        # weights, no_shard's casts them.
        assert r["on_device"] == [strategy != "optim_grads_params"] * r["num_groups"]
        if strategy == "optim_grads_params":
            # ...while each of the 6 microbatches still all-gathers the root (kept through
            # backward) and every layer for its forward, and again for its backward all but
            # the last (the only layer kept when the forward ends).
            num_layers = r["num_groups"] - 1
            assert r["gathers_in_loop"] == 6 * (1 + num_layers + max(0, num_layers - 1))
        # `is_first=False` no longer skips the refresh the main weights need.
        assert not any(r["stale_after_skipped"]), "a forward used stale weights"
        assert r["syncs_after"] == [2] * r["num_groups"]
        torch.testing.assert_close(r["fsdp_loss"], r["plain_loss"])


# Tied, frozen, meta, unwrapped parent.


def test_tied_embeddings_match_single_process():
    tied = {"share_embeddings_and_output_weights": True}
    results = run_distributed(
        train_fsdp, 2, "gpt", "optim_grads_params", 3, False, model_kwargs=tied
    )
    expected = train_reference("gpt", False, model_kwargs=tied)
    assert "output_layer.weight" not in expected
    for r in results:
        for name in expected:
            torch.testing.assert_close(r[name], expected[name], msg=name)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_frozen_parameters_stay_and_the_rest_trains(strategy):
    frozen = ("embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight")
    results = run_distributed(train_fsdp, 2, "gpt", strategy, 1, False, frozen=frozen)
    expected = train_reference("gpt", False, frozen=frozen)
    initial = full_state(build_model("gpt", False))
    for r in results:
        for name in expected:
            torch.testing.assert_close(r[name], expected[name], msg=name)
        for name in frozen:
            assert torch.equal(r[name], initial[name])


def _peak_bytes(fn):
    """Runs `fn`; returns its result and the peak of memory allocated meanwhile, on this
    rank's device."""
    device = current_device()
    if device.type == "cuda":
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        return result, torch.cuda.max_memory_allocated() - baseline
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = []
    for event in prof.events():
        if event.name == "[memory]":
            events.append((event.time_range.start, event.cpu_memory_usage))
        elif event.self_cpu_memory_usage > 0:
            events.append((event.time_range.start, event.self_cpu_memory_usage))
    current = peak = 0
    for _, delta in sorted(events):
        current += delta
        peak = max(peak, current)
    return result, peak


def _meta_init() -> dict:
    config = tiny_gpt_config(num_layers=4, hidden_size=64)
    torch.manual_seed(7)
    # Built where the sharded model materialises, so both draw from the same generator.
    with torch.device(current_device()):
        eager = GPTModel(config, get_gpt_layer_local_spec(), VOCAB_SIZE, SEQ_LENGTH)
    model_bytes = sum(p.numel() * p.element_size() for p in eager.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in eager.decoder.layers[0].parameters())
    torch.manual_seed(7)
    with torch.device("meta"):
        model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB_SIZE, SEQ_LENGTH)
    index = FSDPDistributedIndex.from_pg_collection(None)
    # Wrapping, then the root's first use, which materialises the weights.
    _, peak = _peak_bytes(lambda: fsdp_contexts(_shard_model(model, distributed_index=index)))
    loss = model(*device_batch(2)[:1], labels=device_batch(2)[1]).mean()
    loss.backward()
    return dict(
        sharded=full_state(model),
        eager={n: p.detach() for n, p in eager.named_parameters()},
        peak=peak,
        model_bytes=model_bytes,
        layer_bytes=layer_bytes,
        loss=loss.detach(),
        eager_loss=eager(*device_batch(2)[:1], labels=device_batch(2)[1]).mean().detach(),
    )


def test_meta_device_init_is_sharded_and_matches_eager_weights():
    for r in run_distributed(_meta_init, 4):
        for name, value in r["eager"].items():
            assert torch.equal(r["sharded"][name], value), name
        torch.testing.assert_close(r["loss"], r["eager_loss"])
        # This rank's quarter of the fp32 weights and of the gradient buffer, plus one unit's
        # compute weights in flight (a layer's, the largest unit here); 10% for padding and
        # small temporaries. Never the whole model.
        bound = 1.1 * (2 * r["model_bytes"] / 4 + r["layer_bytes"])
        assert r["peak"] <= bound < r["model_bytes"], (r["peak"], bound, r["model_bytes"])


class _Container(torch.nn.Module):
    """An unwrapped parent around a sharded model."""

    def __init__(self):
        super().__init__()
        self.net = build_model("uneven", False)

    def forward(self, x, labels):
        return self.net(x, labels=labels)


def _train_unwrapped_parent() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    container = _Container()
    _shard_model(container.net, "optim")
    roots = fsdp_roots(container)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(container.parameters(), lr=1e-3), container)
    for inputs, labels in make_batches("uneven"):
        inputs = shard_batch(inputs, rank, world_size).chunk(3)
        labels = shard_batch(labels, rank, world_size).chunk(3)
        for i in range(3):
            with microbatch(container, is_first=i == 0, is_last=i == 2):
                (container(inputs[i], labels[i]).mean() / 3).backward()
        optimizer.step()
        optimizer.zero_grad()
    return dict(roots=[r is container.net for r in roots], state=full_state(container.net))


def test_microbatch_finds_roots_under_an_unwrapped_parent():
    expected = train_reference("uneven", False)
    for r in run_distributed(_train_unwrapped_parent, 2):
        assert r["roots"] == [True]
        for name in expected:
            torch.testing.assert_close(r["state"][name], expected[name], msg=name)


# Bad input.


def _bad_inputs() -> dict[str, str]:
    errors = {}

    def catch(key, fn, error=ValueError):
        with pytest.raises(error) as info:
            fn()
        errors[key] = str(info.value)

    model = build_model("uneven", False)
    stale_optimizer = torch.optim.AdamW(model.parameters())
    _shard_model(model)
    catch("twice", lambda: fully_shard(model))
    catch("deepcopy", lambda: copy.deepcopy(model), TypeError)
    catch("strategy", lambda: fully_shard(UnevenNet(), sharding_strategy="zero3"))
    catch("hfsdp", lambda: fully_shard(UnevenNet(), outer_dp_sharding_strategy="optim"))
    catch("optimizer", lambda: fully_shard_optimizer(stale_optimizer, model))
    catch("microbatch", lambda: microbatch(UnevenNet(), is_first=True, is_last=True).__enter__())

    shared = UnevenNet()
    shared.blocks[1].fc1.weight = shared.blocks[0].fc1.weight
    fully_shard(shared.blocks[0])
    catch("shared", lambda: fully_shard(shared.blocks[1]))

    # Units of several modules.
    net = UnevenNet()
    catch("empty_list", lambda: fully_shard([]))
    catch("listed_twice", lambda: fully_shard([net.blocks[0], net.blocks[0]]))
    catch("nested", lambda: fully_shard([net.blocks[0], net.blocks[0].fc1]))
    fully_shard(list(net.blocks))
    catch("no_root", lambda: net.blocks[0].unshard())

    # A unit used before its root: its own root's state would be lost when the root binds it.
    early = _shard_model(build_model("uneven", False))
    inputs, labels = make_batches("uneven")[0]
    inputs, labels = inputs.to(current_device()), labels.to(current_device())
    early.blocks[0](inputs @ torch.ones(inputs.shape[-1], 15, device=inputs.device))
    catch("unit_first", lambda: early(inputs, labels=labels))
    return errors


BAD_INPUT_MESSAGES = {
    "twice": ["already a Megatron-FSDP unit"],
    "deepcopy": ["cannot be deep-copied", "load_state_dict(copy.deepcopy(model.state_dict()))"],
    "strategy": ["'zero3' does not exist", "optim_grads_params"],
    "hfsdp": ["num_distributed_optimizer_instances > 1"],
    "optimizer": ["Build the optimizer after fully_shard()"],
    "microbatch": ["No Megatron-FSDP unit"],
    "shared": ["lowest common ancestor"],
    "empty_list": ["give at least one"],
    "listed_twice": ["same module twice"],
    "nested": ["contains it"],
    "no_root": ["has no root yet"],
    "unit_first": ["blocks.0 was used before the root UnevenNet", "Use the root first"],
}
"""Each bad input's error: what it must say."""


def test_bad_inputs_raise_value_errors_with_the_fix():
    errors = run_distributed(_bad_inputs, 2)[0]
    assert errors.keys() == BAD_INPUT_MESSAGES.keys()
    for case, fragments in BAD_INPUT_MESSAGES.items():
        for fragment in fragments:
            assert fragment in errors[case], (case, fragment)


def test_wrapped_module_keeps_identity_and_gains_the_mixin():
    assert run_distributed(_identity_check, 2) == [True, True]


def _identity_check() -> bool:
    model = build_model("uneven", False)
    block = model.blocks[0]
    _shard_model(model)
    return (
        model.blocks[0] is block
        and isinstance(block, FsdpModule)
        and isinstance(block, torch.nn.Module)
        and all(isinstance(p, DTensor) for p in model.parameters())
    )
