"""`FullyShardedDataParallel` wraps a GPTModel, trains like the DDP engine under the same
Megatron-style loop, and puts parameter all-gathers on the separate all-gather group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    data_parallel_class,
)
from megatron.core.distributed.fsdp import (
    FsdpModule,
    FullyShardedDataParallel,
    fully_shard_optimizer,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed.fsdp.engine_spies import spy_on_engine
from tests.unit_tests.distributed.fsdp.fsdp_training import LR, full_state, megatron_loop
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    device_batch,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
    wrap_for_engine,
)


def _train_adapter(ddp_kwargs: dict, tied: bool = False) -> dict:
    model = build_tiny_gpt(share_embeddings_and_output_weights=tied)
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, **ddp_kwargs)
    fsdp = FullyShardedDataParallel(model.config, config, model)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(fsdp.parameters(), lr=LR), fsdp)
    losses = megatron_loop(fsdp, optimizer, lambda opt: opt.step())
    units = {
        "layers": all(isinstance(m, FsdpModule) for m in model.decoder.layers),
        "embedding": isinstance(model.embedding, FsdpModule),
        "output_layer": isinstance(model.output_layer, FsdpModule),
    }
    return dict(state=full_state(model), losses=losses, units=units)


def _train_ddp(tied: bool = False, config: TransformerConfig | None = None) -> dict:
    model = build_tiny_gpt(config, share_embeddings_and_output_weights=tied)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(opt):
        for param in model.parameters():
            param.grad = param.main_grad
        opt.step()

    losses = megatron_loop(ddp, optimizer, step)
    return dict(state=full_state(model), losses=losses)


@pytest.mark.parametrize(
    "ddp_kwargs",
    [
        {"data_parallel_sharding_strategy": "optim_grads_params"},
        {"data_parallel_sharding_strategy": "optim_grads", "grad_reduce_in_fp32": True},
        {"data_parallel_sharding_strategy": "optim", "fsdp_all_gather_in_start_param_sync": False},
        {"data_parallel_sharding_strategy": "no_shard"},
    ],
    ids=lambda kwargs: kwargs["data_parallel_sharding_strategy"],
)
def test_adapter_matches_ddp_engine(ddp_kwargs):
    fsdp = run_distributed(_train_adapter, 2, ddp_kwargs)
    ddp = run_distributed(_train_ddp, 2)
    for fsdp_rank in fsdp:
        assert fsdp_rank["units"] == dict(layers=True, embedding=True, output_layer=True)
    _assert_matches_ddp(fsdp, ddp)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_embedding_and_output_layer_are_units_unless_they_share_a_weight(tied):
    # A tied output layer computes with the embedding's weight outside the embedding's
    # forward: both must then stay in the root, whose weights are whole throughout.
    kwargs = {"data_parallel_sharding_strategy": "optim_grads_params"}
    fsdp = run_distributed(_train_adapter, 2, kwargs, tied)
    ddp = run_distributed(_train_ddp, 2, tied)
    for fsdp_rank in fsdp:
        assert fsdp_rank["units"] == dict(layers=True, embedding=not tied, output_layer=not tied)
    _assert_matches_ddp(fsdp, ddp)


def _assert_matches_ddp(fsdp: list[dict], ddp: list[dict]) -> None:
    for fsdp_rank, ddp_rank in zip(fsdp, ddp):
        # fp32 losses, compared at fp32's tolerance (a list of floats would get float64's):
        # the engines' sharded and whole arithmetic may round differently in the last bits.
        torch.testing.assert_close(
            torch.tensor(fsdp_rank["losses"], dtype=torch.float32),
            torch.tensor(ddp_rank["losses"], dtype=torch.float32),
        )
        for name, value in ddp_rank["state"].items():
            torch.testing.assert_close(fsdp_rank["state"][name], value, msg=name)


def _collective_groups(create_all_gather_group: bool) -> dict:
    parallel_state.initialize_model_parallel(create_all_gather_group=create_all_gather_group)
    try:
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        model = build_tiny_gpt()
        config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
        )
        fsdp = FullyShardedDataParallel(model.config, config, model, pg_collection=pgs)
        optimizer = fully_shard_optimizer(torch.optim.AdamW(fsdp.parameters(), lr=LR), fsdp)
        with spy_on_engine() as calls:
            losses = megatron_loop(fsdp, optimizer, lambda opt: opt.step())
        ag_group = pgs.dp_cp_ag if create_all_gather_group else pgs.dp_cp
        return dict(
            gathers_on_ag=[group is ag_group for group in calls.gather_groups],
            scatters_on_dp=[group is pgs.dp_cp for group in calls.scatter_groups],
            distinct=pgs.dp_cp_ag is not pgs.dp_cp if create_all_gather_group else True,
            losses=losses,
        )
    finally:
        parallel_state.destroy_model_parallel()


def test_all_gathers_use_the_separate_all_gather_group():
    with_ag = run_distributed(_collective_groups, 2, True)
    without = run_distributed(_collective_groups, 2, False)
    for rank_with, rank_without in zip(with_ag, without):
        assert rank_with["distinct"]
        assert rank_with["gathers_on_ag"] and all(rank_with["gathers_on_ag"])
        assert rank_with["scatters_on_dp"] and all(rank_with["scatters_on_dp"])
        assert all(rank_without["gathers_on_ag"])
        assert rank_with["losses"] == rank_without["losses"]


def _state_dict_round_trip() -> dict:
    config = DistributedDataParallelConfig(use_megatron_fsdp=True)
    source = build_tiny_gpt(seed=1)
    fsdp_source = FullyShardedDataParallel(
        source.config,
        DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
        ),
        source,
    )
    full = full_state(source)
    target = build_tiny_gpt(seed=2)
    fsdp_target = FullyShardedDataParallel(target.config, config, target)
    fsdp_target.load_state_dict(full)
    tokens, labels = device_batch(4)
    with torch.no_grad():
        loaded = fsdp_target(tokens, labels=labels)
        reference = fsdp_source(tokens, labels=labels)
    bad = dict(full)
    bad["output_layer.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="another model"):
        fsdp_target.load_state_dict(bad)
    return dict(loaded=loaded, reference=reference, state=full_state(target), full=full)


def test_load_state_dict_of_whole_tensors_across_strategies():
    for r in run_distributed(_state_dict_round_trip, 2):
        torch.testing.assert_close(r["loaded"], r["reference"])
        for name, value in r["full"].items():
            assert torch.equal(r["state"][name], value), name


def _config_errors() -> list[str]:
    model = build_tiny_gpt()
    messages = []
    for kwargs in ({}, {"use_megatron_fsdp": True, "num_distributed_optimizer_instances": 2}):
        with pytest.raises(ValueError) as info:
            FullyShardedDataParallel(model.config, DistributedDataParallelConfig(**kwargs), model)
        messages.append(str(info.value))
    return messages


def test_bad_configs_name_the_field():
    plain, replicas = run_distributed(_config_errors, 2)[0]
    assert "use_megatron_fsdp=True" in plain
    assert "num_distributed_optimizer_instances=2" in replicas


def test_use_megatron_fsdp_selects_the_wrapper():
    assert data_parallel_class(DistributedDataParallelConfig(use_megatron_fsdp=True)) is (
        FullyShardedDataParallel
    )
    assert data_parallel_class(DistributedDataParallelConfig()) is DistributedDataParallel


def _upstream_calls() -> tuple[float, float, set[str], str, str]:
    """A step written as Megatron-core code writes it: positional constructor arguments
    (..., fsdp_unit_modules, disable_bucketing, device, pg_collection), the optimizer over the
    model chunks' list, and the engine calls' keyword arguments (before: TypeErrors); and the
    same SGD step in one process."""
    model = build_tiny_gpt()
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True)
    fsdp = FullyShardedDataParallel(model.config, ddp_config, model, None, False, None, None)
    plain_sgd = dict(lr=0.1, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0)
    optimizer = get_megatron_optimizer(OptimizerConfig(**plain_sgd), [fsdp])
    tokens, labels = device_batch(4)
    reference = build_tiny_gpt()
    reference(tokens, labels=labels).mean().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    with torch.no_grad():
        expected = reference(tokens, labels=labels).mean().item()
    fsdp.zero_grad_buffer()
    fsdp(tokens, labels=labels).mean().backward()
    fsdp.finish_grad_sync(force_all_reduce=False)
    optimizer.step()
    fsdp.start_param_sync(force_dispatch=True)
    with torch.no_grad():
        after = fsdp(tokens, labels=labels).mean().item()
    keys = set(fsdp.state_dict_for_save_checkpoint()) ^ set(fsdp.state_dict())
    errors = []
    for bad in (
        lambda: FullyShardedDataParallel(
            model.config, ddp_config, build_tiny_gpt(), None, False, torch.device("meta")
        ),
        lambda: get_megatron_optimizer(OptimizerConfig(lr=0.1), [fsdp, fsdp]),
    ):
        with pytest.raises(ValueError) as error:
            bad()
        errors.append(str(error.value))
    return after, expected, keys, *errors


def test_megatron_core_style_calls():
    for after, expected, keys, device_error, chunks_error in run_distributed(_upstream_calls, 2):
        assert after == pytest.approx(expected, rel=1e-5) and not keys
        assert "device=meta, but the process groups' buffers live on cpu" in device_error
        assert "got 2 model chunks, some of them more than once" in chunks_error


def _upstream_per_token_recipe(engine: str) -> tuple[dict, dict]:
    """Megatron-core's per-token recipe in a loop of one's own: each rank backpropagates the
    sum of its tokens' losses, the engine reduces, and `scale_gradients(1 / global tokens)`
    (before: the engines averaged, so the gradients came out 1 / dp too small)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, labels = make_token_batches(1, 8, seed=5)[0]
    mask = (tokens % 3 != 0).float()  # uneven token counts per rank
    model = build_tiny_gpt(tiny_gpt_config(calculate_per_token_loss=True))
    wrapped = wrap_for_engine(model, engine)
    local = [shard_batch(t, rank, world) for t in (tokens, labels, mask)]
    (wrapped(local[0], labels=local[1]) * local[2]).sum().backward()
    wrapped.finish_grad_sync()
    count = local[2].sum()
    dist.all_reduce(count)
    wrapped.scale_gradients(1.0 / count)
    reference = build_tiny_gpt()
    ((reference(tokens, labels=labels) * mask).sum() / mask.sum()).backward()
    grads = {name: _full_grad(wrapped, param) for name, param in model.named_parameters()}
    return grads, {name: p.grad for name, p in reference.named_parameters()}


def _full_grad(wrapped, param: torch.Tensor) -> torch.Tensor:
    grad = param.main_grad if isinstance(wrapped, DistributedDataParallel) else param.grad
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


@pytest.mark.parametrize("engine", ["ddp", "no_shard", "optim", "optim_grads_params"])
def test_upstreams_per_token_recipe_gives_the_per_token_gradient(engine):
    for grads, expected in run_distributed(_upstream_per_token_recipe, 2, engine):
        for name, value in expected.items():
            torch.testing.assert_close(grads[name], value, msg=name)


def _after_broadcast(strategy: str) -> tuple[float, dict, dict]:
    """Each rank builds other weights (its own seed), then `broadcast_params()`."""
    model = build_tiny_gpt(seed=dist.get_rank())
    rank0_weights = full_state(build_tiny_gpt(seed=0))
    wrapped = wrap_for_engine(model, strategy)
    wrapped.broadcast_params()
    tokens, labels = device_batch(4)
    with torch.no_grad():
        loss = wrapped(tokens, labels=labels).mean().item()
    return loss, full_state(model), rank0_weights


@pytest.mark.parametrize("strategy", ["ddp", "no_shard", "optim"])
def test_broadcast_params_gives_every_rank_the_same_weights(strategy):
    """Before: AttributeError under Megatron-FSDP, and ranks of a replicated engine stayed apart
    for good. ZeRO-1 refreshes its compute weights from the one sharded copy."""
    (loss0, state0, rank0), (loss1, state1, _) = run_distributed(_after_broadcast, 2, strategy)
    assert loss0 == loss1
    for name in state0:
        torch.testing.assert_close(state0[name], state1[name], rtol=0, atol=0)
        if strategy != "optim":  # replicated: rank 0's own weights
            torch.testing.assert_close(state0[name], rank0[name], rtol=0, atol=0)
