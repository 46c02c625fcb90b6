"""`fp8_param_gather`: Megatron-FSDP keeps and gathers the weights of FP8 linear layers as FP8
bytes. It must change only what travels: a tiny FP8 GPT trains bit for bit as without it (losses
and every main weight), for every sharding strategy, at 2 and 4 ranks (`no_shard` at 4: with
the all-reduces summing in rank order, `_rank_ordered_all_reduce`), under HSDP and HFSDP, over a
separate all-gather group, with tensor and expert parallelism, gradient accumulation and any
torch optimizer; the all-gathers move one byte per element of those weights where bf16 moves
two, the FP8 weights are cast once per step, and the amaxes of all FP8 weights are reduced once
per step. With `keep_fp8_transpose_cache` the transposes backward makes of the FP8 weights are
made once per step (not in each backward that gathers them) and freed at the next step's
refresh, with the same training bit for bit. Each refresh scales a group's weights from their
amaxes rounded to its own model dtype (`Fp8Refresh`)."""

from __future__ import annotations

import contextlib
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy
from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import ShardLayout
from megatron.core.distributed.fsdp.fp8_gather import Fp8ComputeWeights, Fp8Refresh
from megatron.core.distributed.fsdp.roots import parameter_groups
from megatron.core.fp8.weights import Fp8Weight, fp8_weight_of
from megatron.core.fusions.fused_adam import step_and_copy
from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.unit_tests.distributed.fsdp.engine_spies import spy_on_engine
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    SEQ_LENGTH,
    VOCAB_SIZE,
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
FP8 = dict(
    params_dtype=torch.bfloat16,
    bf16=True,
    fp8="hybrid",
    fp8_amax_history_len=4,
    fp8_amax_compute_algo="max",
)
STEPS, MICROBATCHES = 3, 2
MOE = dict(
    moe_ffn_hidden_size=32,
    moe_router_topk=2,
    moe_layer_freq=[0, 1],
    moe_shared_expert_intermediate_size=32,
    add_bias_linear=False,
    gated_linear_unit=True,
    activation_func=F.silu,
)


def _rank_ordered_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """`dist.all_reduce` (sum or max, synchronous) that sums in rank order, so each element's
    bits do not depend on where it lies in the buffer. Gloo's all-reduce, as NCCL's ring,
    starts each chunk's sum at another rank; FP8 weights form parameter groups of their own,
    so their gradients lie elsewhere in the reduced buffers than without FP8 param gather, and
    beyond two ranks (where a + b = b + a) they would round differently."""
    assert op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX) and not async_op, (op, async_op)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    result = parts[0].clone()
    for part in parts[1:]:
        result = result + part if op == dist.ReduceOp.SUM else torch.maximum(result, part)
    tensor.copy_(result)


def _train(
    fp8_param_gather: bool,
    strategy: str = "optim_grads_params",
    *,
    tp: int = 1,
    replicas: int = 1,
    outer: str = "no_shard",
    ep: int | None = None,
    experts: int = 4,
    no_sync: bool = False,
    step_amaxes: bool = False,
    all_gather_group: bool = False,
    num_layers: int = 2,
    **ddp_fields,
) -> dict:
    """STEPS steps of MICROBATCHES microbatches (AdamW, the microbatches before the last of a
    step under `no_sync()` where `no_sync`); the losses, every global main weight after them,
    and what the engine launched. With `ep`, the GPT's second layer is an MoE layer of
    `experts` experts (and a shared expert) at expert parallelism `ep`. With `step_amaxes`
    the optimizer steps through `step_and_copy`, recording the FP8 weights' amaxes. With
    `all_gather_group` the weights are gathered over a group of their own. `no_shard` beyond two
    ranks, which all-reduces the gradients, sums in rank order (`_rank_ordered_all_reduce`).
    The GPT has `num_layers` layers."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        num_distributed_optimizer_instances=replicas,
        expert_model_parallel_size=ep or 1,
        create_all_gather_group=all_gather_group,
    )
    model_parallel_cuda_manual_seed(1234, device_type="cpu")
    fields = dict(
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, num_layers=num_layers, **FP8
    )
    if ep is None:
        model = build_tiny_gpt(tiny_gpt_config(**fields))
    else:
        config = tiny_gpt_config(
            **fields, **MOE, num_moe_experts=experts, expert_model_parallel_size=ep
        )
        torch.manual_seed(1234)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        model = GPTModel(config, spec, vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH)
    config = model.config
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=outer,
        num_distributed_optimizer_instances=replicas,
        fp8_param_gather=fp8_param_gather,
        **ddp_fields,
    )
    groups = ProcessGroupCollection.use_mpu_process_groups()
    fsdp = FullyShardedDataParallel(config, ddp_config, model, pg_collection=groups)
    # The main weights' local tensors: the same arithmetic as over the DTensors, without the
    # sharding propagation of each optimizer op (most of these tests' time on CPU).
    optimizer = torch.optim.AdamW(fsdp.local_main_weights().values(), lr=1e-2)
    dp = parallel_state.get_data_parallel_group()
    batches = make_token_batches(STEPS * MICROBATCHES, 4 * dp.size(), seed=5)
    losses = []
    step_ends: list[int] = []  # how many FP8 transposes were made by the end of each step
    alive: list[list[int]] = []  # after each step: how many of each step's transposes live
    ordered = strategy == "no_shard" and dist.get_world_size() > 2
    sums = mock.patch.object(dist, "all_reduce", _rank_ordered_all_reduce)
    with spy_on_engine() as calls, sums if ordered else contextlib.nullcontext():
        # Where each forward starts among the refreshes: ("forward", 0) for the root, ("forward",
        # i) for layer i (after the engine's hooks, which run first on the layers).
        for index, module in enumerate([model, *model.decoder.layers]):
            module.register_forward_pre_hook(
                lambda *_, index=index: calls.fp8_refresh_order.append(("forward", index))
            )
        for step in range(STEPS):
            fsdp.zero_grad_buffer()
            for micro in range(MICROBATCHES):
                tokens, labels = batches[step * MICROBATCHES + micro]
                tokens, labels = (shard_batch(t, dp.rank(), dp.size()) for t in (tokens, labels))
                deferred = no_sync and micro < MICROBATCHES - 1
                with fsdp.no_sync() if deferred else contextlib.nullcontext():
                    loss = fsdp(tokens, labels=labels).float().mean() / MICROBATCHES
                    loss.backward()
                losses.append(loss.detach().clone())
            fsdp.finish_grad_sync()
            if step_amaxes:
                step_and_copy(optimizer, amaxes=[fsdp.prepare_step_amaxes()])
            else:
                optimizer.step()
            optimizer.zero_grad()
            step_ends.append(len(calls.fp8_transposes))
            alive.append(_alive_per_step(calls.fp8_transposes, step_ends))
    fp8_groups = sum(g.plan.fp8_gather for g in parameter_groups(fsdp.module))
    # Each 2-D FP8 weight (each expert's of stacked expert weights), whole.
    fp8_weights = [
        expert_shape
        for g in parameter_groups(fsdp.module)
        if g.plan.fp8_gather
        for shape in g.weights.layout.shapes
        for expert_shape in ([shape[1:]] * shape[0] if len(shape) == 3 else [shape])
    ]
    expert_fp8_groups = sum(
        g.plan.fp8_gather and any(len(shape) == 3 for shape in g.weights.layout.shapes)
        for g in parameter_groups(fsdp.module)
    )
    weights = {name: p.detach().full_tensor() for name, p in fsdp.module.named_parameters()}
    return dict(
        losses=torch.stack(losses),
        weights=weights,
        fp8_groups=fp8_groups,
        fp8_casts=calls.count("fp8_cast"),
        fp8_refresh_order=calls.fp8_refresh_order,
        gathers_over_the_all_gather_group=bool(calls.gather_groups)
        and all(group is groups.dp_cp_ag for group in calls.gather_groups),
        expert_fp8_groups=expert_fp8_groups,
        gather_bytes=sum(calls.gather_bytes),
        fp8_gather_bytes=sum(
            n for n, out in zip(calls.gather_bytes, calls.gather_dtypes) if out == torch.uint8
        ),
        amax_reduces=calls.count("amax_reduce"),
        amax_records=calls.count("amax_record"),
        refreshes=calls.count("refresh"),
        fp8_weights=len(fp8_weights),
        fp8_numel=sum(shape.numel() for shape in fp8_weights),
        transposes_made=[end - start for start, end in zip([0, *step_ends], step_ends)],
        transposes_alive=alive,
        transpose_bytes_alive=sum(
            t.numel() * t.element_size() for ref in calls.fp8_transposes if (t := ref()) is not None
        ),
    )


def _alive_per_step(transposes: list[weakref.ref], step_ends: list[int]) -> list[int]:
    """How many of the transposes each step made are still in memory."""
    return [
        sum(ref() is not None for ref in transposes[start:end])
        for start, end in zip([0, *step_ends], step_ends)
    ]


def _assert_same_training(with_fp8: dict, without: dict) -> None:
    assert with_fp8["fp8_groups"] > 0 and without["fp8_groups"] == 0
    # Each group's FP8 weights are cast once per step, not at each gather.
    assert with_fp8["fp8_casts"] == STEPS * with_fp8["fp8_groups"]
    assert torch.equal(with_fp8["losses"], without["losses"])
    assert with_fp8["weights"].keys() == without["weights"].keys()
    for name, weight in with_fp8["weights"].items():
        assert torch.equal(weight, without["weights"][name]), name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp8_param_gather_changes_only_what_travels(strategy):
    with_fp8 = run_distributed(_train, 2, True, strategy)
    without = run_distributed(_train, 2, False, strategy)
    for rank_with, rank_without in zip(with_fp8, without):
        _assert_same_training(rank_with, rank_without)


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_fp8_param_gather_on_one_rank(strategy):
    """Unsharded, the FP8 weights are cast in place and never gathered or freed."""
    (with_fp8,) = run_distributed(_train, 1, True, strategy)
    (without,) = run_distributed(_train, 1, False, strategy)
    _assert_same_training(with_fp8, without)
    assert with_fp8["gather_bytes"] == 0


def test_each_units_refresh_is_queued_two_units_ahead():
    """Each unit's refresh (the cast of weights that stay whole, in launches of the groups of
    1, 1, 2, ... units) is queued when the unit two before it starts its forward, behind the
    gather of the unit between them, not all at the start of the pass: there every unit's
    casts would run ahead of the gather of the unit that computes first, on the same stream.
    The training is the same."""
    (with_fp8,) = run_distributed(_train, 1, True, "optim_grads_params", num_layers=5)
    (without,) = run_distributed(_train, 1, False, "optim_grads_params", num_layers=5)
    _assert_same_training(with_fp8, without)
    order = with_fp8["fp8_refresh_order"]
    layers = [group for event, group in order if event == "refresh"][:5]
    assert len(set(layers)) == 5 == with_fp8["fp8_groups"]
    c, r, f = ("cast", "refresh", "forward")
    first_microbatch = [
        (c, layers[0]), (r, layers[0]), (f, 0),
        (c, layers[1]), (r, layers[1]),
        (c, layers[2]), (c, layers[3]), (r, layers[2]), (f, 1),
        (r, layers[3]), (f, 2),
        (c, layers[4]), (r, layers[4]), (f, 3),
        (f, 4),
        (f, 5),
    ]  # fmt: skip
    later_microbatch = [(f, i) for i in range(6)]
    assert order == (first_microbatch + later_microbatch * (MICROBATCHES - 1)) * STEPS


def test_refreshes_that_gather_are_queued_at_once():
    """Weights that stay whole over several ranks (ZeRO-1) are all-gathered at their refresh:
    a collective, which every rank issues at once, in one order, at the start of the pass
    (not at each unit's use, where a rank that skipped a unit would hang the others)."""
    for with_fp8 in run_distributed(_train, 2, True, "optim", num_layers=3):
        assert with_fp8["fp8_groups"] == 3
        # The refreshes queued before each forward starts: all three, before the root's.
        refreshes, before = 0, []
        for event, index in with_fp8["fp8_refresh_order"]:
            if event == "refresh":
                refreshes += 1
            elif event == "forward":
                before.append((index, refreshes))
                refreshes = 0
        first_microbatch = [(0, 3), *((i, 0) for i in range(1, 4))]
        later_microbatch = [(i, 0) for i in range(4)]
        assert before == (first_microbatch + later_microbatch * (MICROBATCHES - 1)) * STEPS


@pytest.mark.parametrize(
    "topology",
    [
        *(dict(strategy=strategy) for strategy in STRATEGIES),
        dict(strategy="optim", tp=2),
        dict(strategy="optim_grads_params", tp=2),
        dict(strategy="optim_grads_params", replicas=2),  # HSDP
        dict(strategy="optim_grads_params", replicas=2, outer="optim"),  # HFSDP
    ],
    ids=[*STRATEGIES, "zero1-tp2", "zero3-tp2", "hsdp", "hfsdp"],
)
def test_fp8_param_gather_at_four_ranks(topology):
    with_fp8 = run_distributed(_train, 4, True, **topology)
    without = run_distributed(_train, 4, False, **topology)
    for rank_with, rank_without in zip(with_fp8, without):
        _assert_same_training(rank_with, rank_without)


@pytest.mark.parametrize(
    "world, topology",
    [
        *((2, dict(strategy=strategy, ep=1)) for strategy in STRATEGIES),
        *((4, dict(strategy=strategy, ep=2, experts=6)) for strategy in STRATEGIES),
    ],
    ids=[*STRATEGIES, *(f"{strategy}-ep2" for strategy in STRATEGIES)],
)
def test_fp8_param_gather_of_expert_weights(world, topology):
    """The stacked expert weights travel as FP8 with one scale per expert (each shard holds
    whole experts; 6 experts at EP 2 leave the expert data-parallel shards uneven)."""
    with_fp8 = run_distributed(_train, world, True, **topology)
    without = run_distributed(_train, world, False, **topology)
    for rank_with, rank_without in zip(with_fp8, without):
        _assert_same_training(rank_with, rank_without)
        assert rank_with["expert_fp8_groups"] > 0


def test_fp8_param_gather_over_a_separate_all_gather_group():
    """`--create-all-gather-group`: the FP8 weights travel over the group of their own, in
    half the bytes, and train as the bf16 weights gathered over it."""
    with_fp8 = run_distributed(_train, 2, True, all_gather_group=True)
    without = run_distributed(_train, 2, False, all_gather_group=True)
    for rank_with, rank_without in zip(with_fp8, without):
        _assert_same_training(rank_with, rank_without)
        assert rank_with["gathers_over_the_all_gather_group"]
        assert rank_without["gathers_over_the_all_gather_group"]
        saved = rank_without["gather_bytes"] - rank_with["gather_bytes"]
        assert saved == rank_with["fp8_gather_bytes"] > 0


def test_fp8_weights_travel_in_half_the_bytes_and_scale_in_one_reduction():
    """ZeRO-3: each FP8 weight byte gathered replaces two bf16 bytes; one MAX all-reduce of
    the amaxes per step (the FP8 weights of every unit are refreshed together)."""
    with_fp8, without = (run_distributed(_train, 2, flag)[0] for flag in (True, False))
    assert with_fp8["fp8_gather_bytes"] > 0 and without["fp8_gather_bytes"] == 0
    saved = without["gather_bytes"] - with_fp8["gather_bytes"]
    assert saved == with_fp8["fp8_gather_bytes"]
    assert with_fp8["amax_reduces"] == STEPS and without["amax_reduces"] == 0


@pytest.mark.parametrize(
    "topology",
    [
        dict(strategy="optim_grads_params"),
        dict(strategy="optim"),
        dict(strategy="no_shard"),
        dict(strategy="optim", ep=1),
    ],
    ids=["zero3", "zero1", "no-shard", "zero1-experts"],
)
def test_amaxes_recorded_by_the_step_train_the_same(topology):
    """The refresh after a step that recorded the amaxes (`prepare_step_amaxes()`) takes those
    instead of a pass over the main weights of its own, and training is the same bit for bit
    (each expert of stacked expert weights has a slot of its own)."""
    recorded = run_distributed(_train, 2, True, step_amaxes=True, **topology)
    own = run_distributed(_train, 2, True, **topology)
    for rank_recorded, rank_own in zip(recorded, own):
        assert torch.equal(rank_recorded["losses"], rank_own["losses"])
        for name, weight in rank_own["weights"].items():
            assert torch.equal(rank_recorded["weights"][name], weight), name
        # Only the first refresh, before any step, takes its amaxes itself.
        assert rank_own["amax_records"] == STEPS * rank_recorded["amax_records"] > 0
        assert rank_recorded["amax_reduces"] == rank_own["amax_reduces"]


def _write_after_step(write: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One step recording the amaxes, then (with `write`) an in-place write to a main weight
    before the next forward; that FP8 weight's bytes in the forward, and the cast of the
    main weight rounded to bf16 that they must equal."""
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234, device_type="cpu")
    model = build_tiny_gpt(tiny_gpt_config(**FP8))
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        fp8_param_gather=True,
    )
    fsdp = FullyShardedDataParallel(
        model.config,
        ddp_config,
        model,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    tokens, labels = (shard_batch(t, 0, 1) for t in make_token_batches(2, 4, seed=5)[0])
    fsdp(tokens, labels=labels).float().mean().backward()
    fsdp.finish_grad_sync()
    step_and_copy(optimizer, amaxes=[fsdp.prepare_step_amaxes()])
    optimizer.zero_grad()
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    main = dict(fsdp.module.named_parameters())[name]
    if write:
        with torch.no_grad():
            main.mul_(3.0)
    module = fsdp.module.get_submodule(name.rsplit(".", 1)[0])
    seen = []
    handle = module.register_forward_pre_hook(
        lambda mod, args: seen.append(fp8_weight_of(mod.weight).tensor)
    )
    fsdp(tokens, labels=labels)
    handle.remove()
    expected = Fp8Weight.quantized(main.detach().full_tensor().bfloat16()).tensor
    return seen[0], expected


@pytest.mark.parametrize("write", [False, True], ids=["as-stepped", "written-since"])
def test_a_write_after_the_step_makes_the_refresh_take_its_own_amaxes(write):
    """The amaxes a step recorded are those of the weights it left: written since (an
    in-place write bumps the main version), the refresh takes them again."""
    (result,) = run_distributed(_write_after_step, 1, write)
    made, expected = result
    assert torch.equal(made.scale_inv.reshape(()), expected.scale_inv.reshape(()))
    assert torch.equal(made.data.view(torch.uint8), expected.data.view(torch.uint8))


def _overlapped(fp8_param_gather: bool, **ddp_fields) -> dict:
    return _train(
        fp8_param_gather,
        overlap_param_gather=True,
        overlap_grad_reduce=True,
        fsdp_all_gather_in_start_param_sync=True,
        megatron_fsdp_keep_unsharded_params=True,
        no_sync=True,
        **ddp_fields,
    )


def test_fp8_param_gather_with_prefetch_and_kept_weights():
    with_fp8 = run_distributed(_overlapped, 2, True)
    without = run_distributed(_overlapped, 2, False)
    for rank_with, rank_without in zip(with_fp8, without):
        _assert_same_training(rank_with, rank_without)


def _assert_same_losses_and_weights(run: dict, reference: dict) -> None:
    assert torch.equal(run["losses"], reference["losses"])
    for name, weight in run["weights"].items():
        assert torch.equal(weight, reference["weights"][name]), name


def _each_step_keeps_only_its_own(made: list[int]) -> list[list[int]]:
    """`transposes_alive` when each step's transposes live until the next step's refresh."""
    return [[0] * step + [count] for step, count in enumerate(made)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kept_fp8_transposes_are_made_once_per_step(strategy):
    """`keep_fp8_transpose_cache`: each FP8 weight's transpose is made at the first backward
    after a refresh and freed at the next refresh, where ZeRO-3 makes it in each microbatch's
    backward (which gathers the weights again) and frees it at the reshard after it; weights
    that stay whole keep their transposes until the refresh either way. The same training,
    bit for bit, over steps of two microbatches."""
    kept = run_distributed(_train, 2, True, strategy, keep_fp8_transpose_cache=True)
    freed = run_distributed(_train, 2, True, strategy)
    for rank_kept, rank_freed in zip(kept, freed):
        _assert_same_losses_and_weights(rank_kept, rank_freed)
        weights = rank_kept["fp8_weights"]
        assert weights == 8  # 4 linear layers in each of 2 transformer layers
        assert rank_kept["transposes_made"] == [weights] * STEPS
        assert rank_kept["transposes_alive"] == _each_step_keeps_only_its_own([weights] * STEPS)
        # One byte per element of every whole FP8 weight, held from step to step.
        assert rank_kept["transpose_bytes_alive"] == rank_kept["fp8_numel"]
        if strategy == "optim_grads_params":
            assert rank_freed["transposes_made"] == [MICROBATCHES * weights] * STEPS
            assert rank_freed["transposes_alive"] == [[0] * (step + 1) for step in range(STEPS)]
            assert rank_freed["transpose_bytes_alive"] == 0
        else:
            assert rank_freed["transposes_made"] == rank_kept["transposes_made"]
            assert rank_freed["transposes_alive"] == rank_kept["transposes_alive"]


def test_kept_fp8_transposes_with_prefetch_and_kept_weights():
    """Units that keep their compute weights across the microbatches (prefetched) make each
    transpose once per step either way; the option keeps them past the step's last backward."""
    kept = run_distributed(_overlapped, 2, True, keep_fp8_transpose_cache=True)
    freed = run_distributed(_overlapped, 2, True)
    for rank_kept, rank_freed in zip(kept, freed):
        _assert_same_losses_and_weights(rank_kept, rank_freed)
        weights = rank_kept["fp8_weights"]
        assert rank_kept["transposes_made"] == rank_freed["transposes_made"] == [weights] * STEPS
        assert rank_kept["transposes_alive"] == _each_step_keeps_only_its_own([weights] * STEPS)
        assert rank_freed["transposes_alive"] == [[0] * (step + 1) for step in range(STEPS)]


def test_kept_fp8_transposes_under_hfsdp():
    """Four ranks, ZeRO-3 inside two replicas whose optimizer state is sharded over both."""
    topology = dict(replicas=2, outer="optim")
    kept = run_distributed(_train, 4, True, keep_fp8_transpose_cache=True, **topology)
    freed = run_distributed(_train, 4, True, **topology)
    for rank_kept, rank_freed in zip(kept, freed):
        _assert_same_losses_and_weights(rank_kept, rank_freed)
        weights = rank_kept["fp8_weights"]
        assert rank_kept["transposes_made"] == [weights] * STEPS
        assert rank_kept["transposes_alive"] == _each_step_keeps_only_its_own([weights] * STEPS)
        assert rank_freed["transposes_made"] == [MICROBATCHES * weights] * STEPS


def test_kept_fp8_transposes_of_expert_weights():
    """ZeRO-3 with FP8 experts: each expert that receives tokens has its transpose made once
    per step and kept until the next refresh; the same training bit for bit."""
    kept = run_distributed(_train, 2, True, ep=1, keep_fp8_transpose_cache=True)
    freed = run_distributed(_train, 2, True, ep=1)
    for rank_kept, rank_freed in zip(kept, freed):
        _assert_same_losses_and_weights(rank_kept, rank_freed)
        made = rank_kept["transposes_made"]
        # The dense layer's 4 weights, the shared expert's 2, and the routed experts' used.
        assert all(6 < count <= rank_kept["fp8_weights"] for count in made)
        assert rank_kept["transposes_alive"] == _each_step_keeps_only_its_own(made)
        assert sum(rank_freed["transposes_made"]) > sum(made)
        assert rank_freed["transpose_bytes_alive"] == 0


def _use_outside_a_pass(keep_fp8_transpose_cache: bool) -> str:
    """A layer's FP8 compute weight asked for after the pass resharded its unit (whose copy,
    with `keep_fp8_transpose_cache`, is kept with its transpose over the freed bytes)."""
    config = tiny_gpt_config(**FP8)
    model = build_tiny_gpt(config)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        fp8_param_gather=True,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
    )
    fsdp = FullyShardedDataParallel(config, ddp_config, model)
    tokens, labels = (shard_batch(t, 0, 1) for t in make_token_batches(1, 2)[0])
    fsdp(tokens, labels=labels).float().mean().backward()  # reshards every unit at its end
    layer = fsdp.module.decoder.layers[0]
    group = next(g for g in layer.fsdp_unit.groups if g.plan.fp8_gather)
    with pytest.raises(RuntimeError) as refused:
        fp8_weight_of(group.weights.unsharded_params[0])
    return str(refused.value)


@pytest.mark.parametrize("keep_fp8_transpose_cache", [False, True], ids=["freed", "kept"])
def test_an_fp8_weight_asked_for_outside_its_unit_is_refused_by_name(keep_fp8_transpose_cache):
    messages = run_distributed(_use_outside_a_pass, 2, keep_fp8_transpose_cache)
    assert all("used while Megatron-FSDP holds only its shard" in m for m in messages)


def test_fp8_param_gather_needs_per_tensor_fp8_layers_and_megatron_fsdp():
    model = build_tiny_gpt(tiny_gpt_config(params_dtype=torch.bfloat16, bf16=True))
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, fp8_param_gather=True)
    with pytest.raises(ValueError, match="this model has none: set config.fp8"):
        FullyShardedDataParallel(model.config, ddp_config, model)
    blockwise = tiny_gpt_config(
        params_dtype=torch.bfloat16, bf16=True, fp8="e4m3", fp8_recipe="blockwise"
    )
    with pytest.raises(ValueError, match="fp8_recipe='blockwise' needs one per 128x128 block"):
        FullyShardedDataParallel(blockwise, ddp_config, build_tiny_gpt(blockwise))
    with pytest.raises(ValueError, match="needs use_distributed_optimizer=True or Megatron-FSDP"):
        DistributedDataParallelConfig(fp8_param_gather=True)


def test_keep_fp8_transpose_cache_needs_fp8_param_gather_and_megatron_fsdp():
    """Without `fp8_param_gather` no FP8 weight outlives its layer's cast; the DDP engine keeps
    its FP8 weights, and so their transposes, from one step to the next anyway."""
    for strategy in STRATEGIES:
        config = DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=strategy,
            fp8_param_gather=True,
            keep_fp8_transpose_cache=True,
        )
        assert config.keep_fp8_transpose_cache
    assert MixedPrecisionPolicy(fp8_param_gather=True, keep_fp8_transpose_cache=True)
    with pytest.raises(ValueError, match="keep_fp8_transpose_cache=True keeps .*: add fp8_param"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, keep_fp8_transpose_cache=True)
    with pytest.raises(ValueError, match="keep_fp8_transpose_cache=True needs Megatron-FSDP"):
        DistributedDataParallelConfig(
            use_distributed_optimizer=True, fp8_param_gather=True, keep_fp8_transpose_cache=True
        )
    with pytest.raises(ValueError, match="MixedPrecisionPolicy.keep_fp8_transpose_cache=True"):
        MixedPrecisionPolicy(keep_fp8_transpose_cache=True)


class _RefreshingGroup:
    """What `Fp8Refresh` reads and writes of a group's FP8 weights (`Fp8ComputeWeights`
    between `start_refresh` and `set_scales`): its amaxes as the main weights hold them, its
    model dtype, and scale inverses in strided views of 16-byte rows, as the GEMMs read them;
    cast at its gather (ZeRO-3 over several ranks)."""

    casts_at_refresh = False

    def __init__(self, amaxes: torch.Tensor, model_dtype: torch.dtype):
        self.amaxes, self.model_dtype, self.amax_group = amaxes, model_dtype, None
        self.scale_count = amaxes.numel()
        self.scale_inverses = torch.zeros(self.scale_count, 4)[:, 0]
        self.scales = None

    def set_scales(self, scales: torch.Tensor) -> None:
        self.scales, self.amaxes = scales, None


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float16),
    ],
    ids=["one_model_dtype", "mixed_model_dtypes"],
)
def test_the_refresh_scales_each_group_from_its_rounded_amaxes(dtypes):
    """Each group's scales are `448 / amax` of its amaxes rounded to its own model dtype (the
    amax of the rounded weights), their inverses written into the group's views; the amaxes
    the groups hold are read, not written."""
    generator = torch.Generator().manual_seed(5)
    # Values between bf16's and fp16's steps, so each rounding moves them differently.
    held = [1 + torch.rand(3, generator=generator) * 2**-6 for _ in dtypes]
    groups = [_RefreshingGroup(amaxes, dtype) for amaxes, dtype in zip(held, dtypes)]
    originals = [amaxes.clone() for amaxes in held]
    Fp8Refresh()(groups, Collectives())
    for group, amaxes, original, dtype in zip(groups, held, originals, dtypes):
        rounded = original.to(dtype).float()
        expected = torch.full_like(rounded, 448.0) / rounded
        assert torch.equal(group.scales, expected), dtype
        assert torch.equal(group.scale_inverses, expected.reciprocal()), dtype
        assert torch.equal(amaxes, original)
    assert not torch.equal(groups[0].scales, torch.full((3,), 448.0) / originals[0])


def _whole_group(
    shapes: list[tuple[int, int]],
    model_dtype: torch.dtype,
    magnitude: float,
    generator: torch.Generator,
    transpose_together: bool = False,
) -> tuple[Fp8ComputeWeights, list[torch.nn.Parameter], list[torch.Tensor]]:
    """The FP8 compute weights of one unsharded group (weights that stay whole), their
    parameters, and fp32 main weights whose refresh has begun."""
    params = [torch.nn.Parameter(torch.empty(shape, dtype=model_dtype)) for shape in shapes]
    weights = Fp8ComputeWeights(
        ShardLayout([torch.Size(shape) for shape in shapes], 1),
        0,
        params,
        [f"w{i}" for i in range(len(shapes))],
        model_dtype=model_dtype,
        transient=False,
        amax_group=None,
        gather_group=None,
        device=torch.device("cpu"),
        transpose_together=transpose_together,
    )
    sources = [torch.randn(shape, generator=generator) * magnitude for shape in shapes]
    weights.start_refresh(sources)
    return weights, params, sources


def test_groups_cast_together_each_take_their_own_scales():
    """The groups a refresh casts in one pass (`Fp8Refresh`), behind a group cast at its
    gather and in two model dtypes: each weight holds the FP8 cast of its own model-dtype
    weight, bytes and scale, as plain torch makes it (`fp8(clamp(w * 448 / max|w|))`, the
    product in fp32)."""
    generator = torch.Generator().manual_seed(7)
    gathered = _RefreshingGroup(1 + torch.rand(3, generator=generator), torch.bfloat16)
    bf16 = _whole_group([(32, 16), (16, 16)], torch.bfloat16, 1.0, generator)
    fp16 = _whole_group([(16, 32)], torch.float16, 3.0, generator)
    Fp8Refresh()([gathered, bf16[0], fp16[0]], Collectives())
    for weights, params, sources in (bf16, fp16):
        _assert_cast_as_plain_torch(weights, params, sources)
    assert gathered.scales is not None  # scaled, but left to its gather to cast


def test_groups_scaled_together_cast_in_any_batches_take_their_own_scales():
    """Groups scaled together (`Fp8Refresh.scale`) and cast in batches of some of them, in
    another order (`Fp8Refresh.cast`, as Megatron-FSDP casts units in batches): each weight
    holds its own cast, and a refresh after the next optimizer step the same."""
    generator = torch.Generator().manual_seed(11)
    groups = [
        _whole_group([(16, 16)], torch.bfloat16, magnitude, generator)
        for magnitude in (1.0, 5.0, 0.25)
    ]
    refresh = Fp8Refresh()
    for _ in range(2):
        refresh.scale([weights for weights, _, _ in groups], Collectives())
        refresh.cast([groups[2][0]])
        refresh.cast([groups[0][0], groups[1][0]])
        for weights, params, sources in groups:
            _assert_cast_as_plain_torch(weights, params, sources)
        for i, (weights, params, _) in enumerate(groups):
            sources = [torch.randn(16, 16, generator=generator) * (i + 1)]
            weights.start_refresh(sources)
            groups[i] = (weights, params, sources)


def _assert_cast_as_plain_torch(
    weights: Fp8ComputeWeights, params: list[torch.nn.Parameter], sources: list[torch.Tensor]
) -> None:
    """Each of `params` holds the FP8 cast of its model-dtype weight, bytes and scale, as plain
    torch makes it (`fp8(clamp(w * 448 / max|w|))`, the product in fp32)."""
    for param, source in zip(params, sources):
        rounded = source.to(param.dtype).float()
        scale = torch.tensor(448.0) / rounded.abs().max()
        expected = (rounded * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        made = weights.weight_of(param).tensor
        assert torch.equal(made.data.view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(made.scale_inv.reshape(-1), scale.reciprocal().reshape(-1))


def test_a_units_weights_are_transposed_together_at_the_first_need():
    """A unit's group makes every weight's transpose at the first backward need of one. A
    weight's FP8 copy stays across refreshes (over the bytes each refresh writes again: a
    gather makes no objects), and each refresh drops the transposes, made again at the next
    need, all of them at once."""
    generator = torch.Generator().manual_seed(3)
    weights, params, _ = _whole_group(
        [(32, 16), (16, 32)], torch.bfloat16, 1.0, generator, transpose_together=True
    )
    refresh = Fp8Refresh()
    refresh([weights], Collectives())

    def step() -> None:  # new main weights, refreshed: new FP8 bytes, none transposed yet
        weights.start_refresh([torch.randn(32, 16), torch.randn(16, 32)])
        refresh([weights], Collectives())

    first, second = (weights.weight_of(param) for param in params)
    with spy_on_engine() as calls:
        transposed = first.transposed()
        assert calls.count("fp8_transpose") == 2
        assert second.transposed() is second.transposed()
        assert calls.count("fp8_transpose") == 2
        assert torch.equal(transposed.data, first.tensor.data.t())
        before = first.tensor.data.clone()
        step()
        assert weights.weight_of(params[0]) is first
        assert not torch.equal(first.tensor.data, before)
        again = first.transposed()
        assert calls.count("fp8_transpose") == 4
        assert again is not transposed and torch.equal(again.data, first.tensor.data.t())
        assert torch.equal(second.transposed().data, second.tensor.data.t())
        assert calls.count("fp8_transpose") == 4
