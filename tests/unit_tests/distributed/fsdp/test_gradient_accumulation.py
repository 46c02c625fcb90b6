"""Megatron-FSDP's gradient-accumulation options, `OverlapPolicy.keep_unsharded_params` and
`accumulate_unsharded_grads` (`megatron_fsdp_keep_unsharded_params`,
`megatron_fsdp_accumulate_unsharded_grads`): under every strategy, hybrid sharding, experts and
activation recompute they train as without them and as one process; ZeRO-3 then gathers each
unit once per step and ZeRO-2/3 reduce-scatter each once per step; outside `microbatch()` they
change nothing; `accumulation_memory()` is what they hold; the config refuses them where they
would change nothing."""

from __future__ import annotations

import argparse
import contextlib
import gc
import re

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES
from megatron.core.distributed.fsdp import (
    FSDPDistributedIndex,
    MixedPrecisionPolicy,
    OverlapPolicy,
    accumulation_memory,
    fully_shard,
    microbatch,
)
from megatron.core.distributed.fsdp.roots import fsdp_contexts, parameter_groups
from megatron.core.optimizer import get_megatron_optimizer
from megatron.training.utils import accumulation_memory_note
from tests.unit_tests.distributed.fsdp.engine_spies import spy_on_engine
from tests.unit_tests.distributed.fsdp.fsdp_training import (
    LR,
    build_model,
    full_state,
    hybrid_groups,
    local_adamw,
    loss_of,
    make_batches,
    train_reference,
    unit_modules,
)
from tests.unit_tests.distributed.moe_training import (
    Engine,
    RunResult,
    default_builder,
    global_batches,
    global_state,
    init_groups,
    optimizer_config,
    reference_run,
    train_steps,
    wrap,
)
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    shard_batch,
    tiny_gpt_config,
    wrap_for_engine,
)

MICROBATCHES = 3
OPTIONS = {
    "off": {},
    "keep": dict(keep_unsharded_params=True),
    "accumulate": dict(accumulate_unsharded_grads=True),
    "both": dict(keep_unsharded_params=True, accumulate_unsharded_grads=True),
}


def _deferred_bytes(model: torch.nn.Module) -> int:
    """Bytes of the whole gradient sums waiting for the last microbatch (engine internals: the
    test compares them with what the engine reports)."""
    return sum(
        grad.untyped_storage().nbytes()
        for group in parameter_groups(model)
        if group.grads is not None and group.grads.deferred_sums.exist()
        for grad in group.grads.deferred_sums.sums
    )


def _train(
    index: FSDPDistributedIndex,
    strategy: str,
    option: str,
    *,
    outer: str = "no_shard",
    scopes: str = "microbatch",
    recompute: bool = False,
) -> dict:
    """On every rank: the tiny GPT trained under `option` over `index`'s groups, with what it
    communicated and held in each step. `scopes`: "microbatch" (the last is_last=True),
    "none" (a plain loop), or "no_last" (every microbatch is_last=False; the gradients are
    finalised before the optimizer step, as `finish_grad_sync()` does)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_tiny_gpt(tiny_gpt_config(recompute_granularity="full") if recompute else None)
    for module in [*unit_modules(model), model]:
        fully_shard(
            module,
            index,
            sharding_strategy=strategy,
            outer_dp_sharding_strategy=outer,
            mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.float32),
            overlap_policy=OverlapPolicy(**OPTIONS[option]),
        )
    optimizer = local_adamw(model, LR)
    groups = parameter_groups(model)
    layer_groups = [
        group
        for layer in unit_modules(model)
        for group in layer.fsdp_unit.groups
        if group.has_transient_weights
    ]
    record = {key: [] for key in ("losses", "norms", "gathers", "scatters", "held", "deferred")}
    record.update(after=[], layers_in_embedding_backward=[])

    def count_layers(grad: torch.Tensor) -> None:
        held = sum(group.holds_unsharded for group in layer_groups)
        record["layers_in_embedding_backward"].append(held)

    def hook_embedding_output(module, args, output: torch.Tensor) -> None:
        output.register_hook(count_layers)

    model.embedding.register_forward_hook(hook_embedding_output)
    with spy_on_engine() as calls:
        for inputs, labels in make_batches("gpt"):
            inputs = shard_batch(inputs, rank, world_size).chunk(MICROBATCHES)
            labels = shard_batch(labels, rank, world_size).chunk(MICROBATCHES)
            gathers, scatters = calls.count("gather"), calls.count("reduce_scatter")
            for i in range(MICROBATCHES):
                last = i == MICROBATCHES - 1 and scopes == "microbatch"
                scope = microbatch(model, is_last=last) if scopes != "none" else None
                with scope or contextlib.nullcontext():
                    loss = loss_of(model, inputs[i], labels[i], False) / MICROBATCHES
                    loss.backward()
                record["losses"].append(loss.detach())
                if i == 0:  # what waits for the next microbatches
                    record["held"].append(
                        sum(g.weights.unsharded.data.untyped_storage().nbytes() for g in groups)
                    )
                    record["deferred"].append(_deferred_bytes(model))
            if scopes == "no_last":
                for context in fsdp_contexts(model):
                    context.finalize_grads()
            record["gathers"].append(calls.count("gather") - gathers)
            record["scatters"].append(calls.count("reduce_scatter") - scatters)
            # Nothing is kept past a step: the optimizer's new weights are gathered afresh.
            record["after"].append(
                sum(g.holds_unsharded for g in groups if g.has_transient_weights)
            )
            norms = [torch.linalg.vector_norm(p.grad.full_tensor()) for p in model.parameters()]
            record["norms"].append(torch.linalg.vector_norm(torch.stack(norms)))
            optimizer.step()
            optimizer.zero_grad()
    record.update(
        losses=torch.stack(record["losses"]),
        norms=torch.stack(record["norms"]),
        state=full_state(model),
        memory=accumulation_memory(model),
        scopes=scopes,
        num_groups=len(groups),
        num_layer_groups=len(layer_groups),
        num_gathered=sum(g.has_transient_weights for g in groups),
        num_scattered=sum(g.requires_grad and g.plan.shards_grads for g in groups),
    )
    return record


def _train_options(strategy: str, options: tuple[str, ...], num_replicas: int = 1, **kwargs):
    """`_train` under each of `options` in turn, on every rank."""
    with hybrid_groups(num_replicas) as index:
        return {option: _train(index, strategy, option, **kwargs) for option in options}


def _assert_same_training(got: dict, expected: dict, exact: bool, name: str) -> None:
    tolerance = dict(rtol=0, atol=0) if exact else {}
    torch.testing.assert_close(got["losses"], expected["losses"], **tolerance, msg=name)
    torch.testing.assert_close(got["norms"], expected["norms"], **tolerance, msg=name)
    assert got["state"].keys() == expected["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(got["state"][key], value, **tolerance, msg=f"{name} {key}")


def _assert_matches_reference(state: dict, reference: dict, name: str) -> None:
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, msg=f"{name} {key}")


def _assert_traffic_and_memory(run: dict, off: dict, option: str) -> None:
    """What `option` saves (once per step) and what it holds (its `accumulation_memory`)."""
    keeps = "keep_unsharded_params" in OPTIONS[option] and run["num_gathered"] > 0
    sums = "accumulate_unsharded_grads" in OPTIONS[option] and run["num_scattered"] > 0
    steps = len(run["gathers"])
    assert run["gathers"] == ([run["num_gathered"]] * steps if keeps else off["gathers"]), option
    scatters = [run["num_scattered"]] * steps if sums else off["scatters"]
    assert run["scatters"] == scatters, option
    memory = run["memory"]
    assert run["held"] == ([memory["keep_unsharded_params"]] * steps if keeps else off["held"])
    assert run["deferred"] == [memory["accumulate_unsharded_grads"] if sums else 0] * steps
    assert memory == off["memory"], "the costs do not depend on the options"
    assert run["after"] == [0] * steps, option
    # Kept layers are freed by their own backward in the step's last microbatch, before the
    # root's (the embedding's) backward, as without the option.
    held = off["layers_in_embedding_backward"]
    if keeps:
        layers = [run["num_layer_groups"]] * MICROBATCHES
        if run["scopes"] == "microbatch":
            layers[-1] = 0
        held = layers * steps
    assert run["layers_in_embedding_backward"] == held, option


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_options_train_as_today_and_as_one_process(strategy):
    reference = train_reference("gpt", False)
    for rank_runs in run_distributed(_train_options, 2, strategy, tuple(OPTIONS)):
        off = rank_runs["off"]
        steps, zero3 = len(off["gathers"]), strategy == "optim_grads_params"
        if zero3:
            # Each microbatch gathers every unit for its forward, and all but the root and the
            # last layer (held from forward into backward) again for its backward.
            per_microbatch = 2 * off["num_gathered"] - 2
            assert off["gathers"] == [MICROBATCHES * per_microbatch] * steps
        assert off["scatters"] == [MICROBATCHES * off["num_scattered"]] * steps
        assert (off["num_gathered"], off["num_scattered"] > 0) == (
            off["num_groups"] if zero3 else 0,
            strategy in ("optim_grads", "optim_grads_params"),
        )
        for option, run in rank_runs.items():
            # Keeping weights changes no arithmetic; summing gradients before reducing them
            # changes the order of fp32 additions, where they are sharded.
            exact = option == "keep" or run["num_scattered"] == 0
            _assert_same_training(run, off, exact, option)
            _assert_matches_reference(run["state"], reference, option)
            _assert_traffic_and_memory(run, off, option)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_outside_microbatch_the_options_change_nothing(strategy):
    # Every backward is then the last of its step: nothing to keep or defer.
    for rank_runs in run_distributed(_train_options, 2, strategy, tuple(OPTIONS), scopes="none"):
        off = rank_runs["off"]
        for option, run in rank_runs.items():
            _assert_same_training(run, off, True, option)
            keys = ("gathers", "scatters", "held", "deferred", "after")
            assert [run[key] for key in keys] == [off[key] for key in keys], option


def test_a_step_without_a_last_microbatch_is_completed_by_finalising():
    # `finish_grad_sync()` after `no_sync()` microbatches only: finalising reduce-scatters the
    # deferred sums and frees the kept weights before the optimizer step.
    reference = train_reference("gpt", False)
    runs = run_distributed(
        _train_options, 2, "optim_grads_params", tuple(OPTIONS), scopes="no_last"
    )
    for rank_runs in runs:
        off = rank_runs["off"]
        for option, run in rank_runs.items():
            _assert_same_training(run, off, option == "keep", option)
            _assert_matches_reference(run["state"], reference, option)
            _assert_traffic_and_memory(run, off, option)


def _abandoned_step(strategy: str, option: str) -> tuple[dict, dict]:
    """A step abandoned after its first microbatch (`model.zero_grad()`), then a step of one
    microbatch: its gradients, and those of a fresh model's first step on the same batch."""
    rank, size = dist.get_rank(), dist.get_world_size()
    batches = [
        [shard_batch(tensor, rank, size) for tensor in batch]
        for batch in make_batches("uneven")[:2]
    ]
    grads = []
    for abandon in (True, False):
        model = build_model("uneven", False)
        for unit in [*unit_modules(model), model]:
            fully_shard(
                unit, sharding_strategy=strategy, overlap_policy=OverlapPolicy(**OPTIONS[option])
            )
        for inputs, labels in batches[0 if abandon else 1 :]:
            last = inputs is batches[1][0]
            with microbatch(model, is_last=last):
                loss_of(model, inputs, labels, False).backward()
            if not last:
                model.zero_grad()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    return grads[0], grads[1]


@pytest.mark.parametrize("option", ["accumulate", "both"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_model_zero_grad_abandons_a_step_midway(strategy, option):
    """The whole sums of the earlier microbatches are not in `.grad`, so an optimizer's
    `zero_grad()` cannot reach them; the module's does."""
    for abandoned, fresh in run_distributed(_abandoned_step, 2, strategy, option):
        assert abandoned.keys() == fresh.keys()
        for name in fresh:
            torch.testing.assert_close(abandoned[name], fresh[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "strategy, outer",
    [
        ("optim_grads_params", "no_shard"),
        ("optim_grads", "no_shard"),
        ("optim_grads_params", "optim"),
    ],
    ids=["hsdp-zero3", "hsdp-zero2", "hfsdp"],
)
def test_hybrid_sharding_2x2(strategy, outer):
    reference = train_reference("gpt", False)
    runs = run_distributed(_train_options, 4, strategy, ("off", "both"), 2, outer=outer)
    for rank_runs in runs:
        off, both = rank_runs["off"], rank_runs["both"]
        _assert_same_training(both, off, False, "both")
        _assert_matches_reference(both["state"], reference, "both")
        _assert_traffic_and_memory(both, off, "both")


def test_activation_recompute_regathers_nothing_kept():
    reference = train_reference("gpt", False)
    runs = run_distributed(_train_options, 2, "optim_grads_params", ("off", "both"), recompute=True)
    for rank_runs in runs:
        off, both = rank_runs["off"], rank_runs["both"]
        _assert_same_training(both, off, False, "both")
        _assert_matches_reference(both["state"], reference, "recompute")
        _assert_traffic_and_memory(both, off, "both")


def _experts_with_options(ep: int) -> tuple[RunResult, RunResult, list[int]]:
    """The toy MoE under ZeRO-3 with both options, through the adapter (the config's fields,
    `no_sync()` for the microbatches before the last), at expert parallelism `ep`."""
    batches = global_batches(dist.get_world_size())
    expected = reference_run(default_builder, batches)
    engine = Engine(
        "fsdp", "optim_grads_params", keep_unsharded_params=True, accumulate_unsharded_grads=True
    )
    init_groups(ep)
    model = wrap(default_builder(parallel_state.get_expert_model_parallel_group()), engine)
    actual = RunResult()
    optimizer = get_megatron_optimizer(optimizer_config(), model)
    with spy_on_engine() as calls:
        train_steps(model, optimizer, batches, actual, dist.get_rank(), dist.get_world_size())
    actual.weights = global_state(model.state_dict())
    counts = [calls.count("gather"), calls.count("reduce_scatter"), len(parameter_groups(model))]
    parallel_state.destroy_model_parallel()
    return actual, expected, counts


def test_experts_through_the_adapter_and_no_sync():
    for actual, expected, (gathers, scatters, num_groups) in run_distributed(
        _experts_with_options, 4, 2
    ):
        torch.testing.assert_close(actual.losses, expected.losses)
        torch.testing.assert_close(actual.grad_norms, expected.grad_norms)
        assert actual.weights.keys() == expected.weights.keys()
        for name, weight in expected.weights.items():
            torch.testing.assert_close(actual.weights[name], weight, msg=name)
        # Every group (dense and expert, ZeRO-3, trainable) gathered and reduced once a step.
        assert gathers == scatters == len(actual.losses) * num_groups


@pytest.mark.parametrize(
    "strategy, field",
    [
        ("optim_grads", "megatron_fsdp_keep_unsharded_params"),
        ("no_shard", "megatron_fsdp_keep_unsharded_params"),
        ("optim", "megatron_fsdp_accumulate_unsharded_grads"),
        ("no_shard", "megatron_fsdp_accumulate_unsharded_grads"),
    ],
)
def test_config_refuses_an_option_that_would_change_nothing(strategy, field):
    with pytest.raises(ValueError, match=f"{field}=True needs .*{strategy}"):
        DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy, **{field: True}
        )
    with pytest.raises(ValueError, match=f"{field}=True needs Megatron-FSDP"):
        DistributedDataParallelConfig(**{field: True})


def _start_up_notes() -> tuple[list[str], dict[str, int]]:
    model = wrap_for_engine(
        build_tiny_gpt(),
        "optim_grads_params",
        megatron_fsdp_keep_unsharded_params=True,
        megatron_fsdp_accumulate_unsharded_grads=True,
    )
    notes = [
        accumulation_memory_note(
            model,
            argparse.Namespace(
                use_megatron_fsdp=True,
                megatron_fsdp_keep_unsharded_params=keep,
                megatron_fsdp_accumulate_unsharded_grads=accumulate,
            ),
        )
        for keep, accumulate in [(True, False), (False, True), (False, False)]
    ]
    return notes, accumulation_memory(model)


def test_the_start_up_line_reports_what_each_option_on_holds():
    notes, memory = run_distributed(_start_up_notes, 2)[0]
    for note, option in zip(notes, ("keep_unsharded_params", "accumulate_unsharded_grads")):
        flag = "--megatron-fsdp-" + option.replace("_", "-")
        shown = re.fullmatch(rf"; {flag} holds up to ([\d.,]+) MiB .*", note)[1]
        mib = float(shown.replace(",", ""))
        assert memory[option] > 0 and mib == round(memory[option] / 2**20, 1)
    assert notes[2] == ""


# GPU: the side streams around kept weights and deferred sums, and the memory they cost.


def _requested_bytes(key: str) -> int:
    return torch.cuda.memory_stats()[f"requested_bytes.all.{key}"]


def _gpu_training(option: str) -> dict:
    """ZeRO-3 through the adapter with overlap on, bf16 compute, fp32 gradients, 2 steps of
    `MICROBATCHES`, math attention (deterministic); the losses and the peak of the bytes
    requested above what was allocated before the model."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    base = _requested_bytes("current")
    config = tiny_gpt_config(
        num_layers=4,
        hidden_size=1024,
        num_attention_heads=8,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    fields = {f"megatron_fsdp_{name}": value for name, value in OPTIONS[option].items()}
    fsdp = wrap_for_engine(
        build_tiny_gpt(config, vocab_size=4096, max_sequence_length=1024),
        "optim_grads_params",
        overlap_param_gather=True,
        overlap_grad_reduce=True,
        grad_reduce_in_fp32=True,
        **fields,
    )
    optimizer = local_adamw(fsdp, LR)
    generator = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(0, 4096, (2 * MICROBATCHES, 1025), generator=generator).cuda()
    tokens = data[:, :-1].contiguous().chunk(MICROBATCHES)
    labels = data[:, 1:].contiguous().chunk(MICROBATCHES)
    losses = []
    with sdpa_kernel([SDPBackend.MATH]):
        for _ in range(2):
            fsdp.zero_grad_buffer()
            for i in range(MICROBATCHES):
                with microbatch(fsdp, is_last=i == MICROBATCHES - 1):
                    loss = fsdp(tokens[i], labels=labels[i]).mean() / MICROBATCHES
                    loss.backward()
                losses.append(loss.detach())
            fsdp.finish_grad_sync()
            optimizer.step()
    torch.cuda.synchronize()
    return dict(
        losses=torch.stack(losses).cpu(),
        peak=_requested_bytes("peak") - base,
        memory=accumulation_memory(fsdp),
    )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_options_on_gpu_train_as_today_within_the_memory_they_report():
    runs = {option: run_distributed(_gpu_training, 2, option) for option in OPTIONS}
    for rank, off in enumerate(runs["off"]):
        for option, per_rank in runs.items():
            run = per_rank[rank]
            exact = option in ("off", "keep")
            tolerance = dict(rtol=0, atol=0) if exact else {}
            torch.testing.assert_close(run["losses"], off["losses"], **tolerance, msg=option)
            # What an option holds bounds what it adds to the peak.
            extra = sum(run["memory"][name] for name in OPTIONS[option])
            assert run["peak"] <= off["peak"] + extra, (option, run["peak"], off["peak"])
