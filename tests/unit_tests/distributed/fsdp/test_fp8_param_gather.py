"""`fp8_param_gather`: Megatron-FSDP keeps and gathers the weights of FP8 linear layers as FP8
bytes. It must change only what travels: a tiny FP8 GPT trains bit for bit as without it (losses
and every main weight), for every sharding strategy, at 2 and 4 ranks, under HSDP and HFSDP,
with tensor parallelism, gradient accumulation and any torch optimizer; the all-gathers move
one byte per element of those weights where bf16 moves two, and the amaxes of all FP8 weights
are reduced once per step."""

from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp import FullyShardedDataParallel, parameter_groups
from megatron.core.fp8.weights import fp8_weight_of
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.unit_tests.distributed.fsdp.engine_spies import spy_on_engine
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
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


def _train(
    fp8_param_gather: bool,
    strategy: str = "optim_grads_params",
    *,
    tp: int = 1,
    replicas: int = 1,
    outer: str = "no_shard",
    **ddp_fields,
) -> dict:
    """STEPS steps of MICROBATCHES microbatches (AdamW); the losses, every global main
    weight after them, and what the engine launched."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, num_distributed_optimizer_instances=replicas
    )
    model_parallel_cuda_manual_seed(1234, device_type="cpu")
    config = tiny_gpt_config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, **FP8)
    model = build_tiny_gpt(config)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=outer,
        num_distributed_optimizer_instances=replicas,
        fp8_param_gather=fp8_param_gather,
        **ddp_fields,
    )
    fsdp = FullyShardedDataParallel(
        config, ddp_config, model, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    dp = parallel_state.get_data_parallel_group()
    batches = make_token_batches(STEPS * MICROBATCHES, 4 * dp.size(), seed=5)
    losses = []
    with spy_on_engine() as calls:
        for step in range(STEPS):
            fsdp.zero_grad_buffer()
            for micro in range(MICROBATCHES):
                tokens, labels = batches[step * MICROBATCHES + micro]
                tokens, labels = (shard_batch(t, dp.rank(), dp.size()) for t in (tokens, labels))
                loss = fsdp(tokens, labels=labels).float().mean() / MICROBATCHES
                loss.backward()
                losses.append(loss.detach().clone())
            fsdp.finish_grad_sync()
            optimizer.step()
            optimizer.zero_grad()
    fp8_groups = sum(g.plan.fp8_gather for g in parameter_groups(fsdp.module))
    weights = {name: p.detach().full_tensor() for name, p in fsdp.module.named_parameters()}
    return dict(
        losses=torch.stack(losses),
        weights=weights,
        fp8_groups=fp8_groups,
        gather_bytes=sum(calls.gather_bytes),
        fp8_gather_bytes=sum(
            n for n, out in zip(calls.gather_bytes, calls.gather_dtypes) if out == torch.uint8
        ),
        amax_reduces=calls.count("amax_reduce"),
        refreshes=calls.count("refresh"),
    )


def _assert_same_training(with_fp8: dict, without: dict) -> None:
    assert with_fp8["fp8_groups"] > 0 and without["fp8_groups"] == 0
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


@pytest.mark.parametrize(
    "topology",
    [
        dict(strategy="optim_grads_params"),
        dict(strategy="optim", tp=2),
        dict(strategy="optim_grads_params", tp=2),
        dict(strategy="optim_grads_params", replicas=2),  # HSDP
        dict(strategy="optim_grads_params", replicas=2, outer="optim"),  # HFSDP
    ],
    ids=["zero3", "zero1-tp2", "zero3-tp2", "hsdp", "hfsdp"],
)
def test_fp8_param_gather_at_four_ranks(topology):
    with_fp8 = run_distributed(_train, 4, True, **topology)
    without = run_distributed(_train, 4, False, **topology)
    for rank_with, rank_without in zip(with_fp8, without):
        _assert_same_training(rank_with, rank_without)


def test_fp8_weights_travel_in_half_the_bytes_and_scale_in_one_reduction():
    """ZeRO-3: each FP8 weight byte gathered replaces two bf16 bytes; one MAX all-reduce of
    the amaxes per step (the FP8 weights of every unit are refreshed together)."""
    with_fp8, without = (run_distributed(_train, 2, flag)[0] for flag in (True, False))
    assert with_fp8["fp8_gather_bytes"] > 0 and without["fp8_gather_bytes"] == 0
    saved = without["gather_bytes"] - with_fp8["gather_bytes"]
    assert saved == with_fp8["fp8_gather_bytes"]
    assert with_fp8["amax_reduces"] == STEPS and without["amax_reduces"] == 0


def _overlapped(fp8_param_gather: bool) -> dict:
    return _train(
        fp8_param_gather,
        overlap_param_gather=True,
        overlap_grad_reduce=True,
        fsdp_all_gather_in_start_param_sync=True,
        megatron_fsdp_keep_unsharded_params=True,
    )


def test_fp8_param_gather_with_prefetch_and_kept_weights():
    with_fp8 = run_distributed(_overlapped, 2, True)
    without = run_distributed(_overlapped, 2, False)
    for rank_with, rank_without in zip(with_fp8, without):
        _assert_same_training(rank_with, rank_without)


def _use_outside_a_pass() -> str:
    """A layer's FP8 compute weight asked for after the forward resharded its unit."""
    config = tiny_gpt_config(**FP8)
    model = build_tiny_gpt(config)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        fp8_param_gather=True,
    )
    fsdp = FullyShardedDataParallel(config, ddp_config, model)
    with torch.no_grad():  # an inference forward reshards every unit at its end
        fsdp(make_token_batches(1, 2)[0][0])
    layer = fsdp.module.decoder.layers[0]
    group = next(g for g in layer.fsdp_unit.groups if g.plan.fp8_gather)
    with pytest.raises(RuntimeError) as refused:
        fp8_weight_of(group.weights.unsharded_params[0])
    return str(refused.value)


def test_an_fp8_weight_asked_for_outside_its_unit_is_refused_by_name():
    messages = run_distributed(_use_outside_a_pass, 2)
    assert all("used while Megatron-FSDP holds only its shard" in m for m in messages)


def test_fp8_param_gather_needs_fp8_layers_and_megatron_fsdp():
    model = build_tiny_gpt(tiny_gpt_config(params_dtype=torch.bfloat16, bf16=True))
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, fp8_param_gather=True)
    with pytest.raises(ValueError, match="this model has none: set config.fp8"):
        FullyShardedDataParallel(model.config, ddp_config, model)
    with pytest.raises(ValueError, match="fp8_param_gather=True needs Megatron-FSDP"):
        DistributedDataParallelConfig(fp8_param_gather=True)
