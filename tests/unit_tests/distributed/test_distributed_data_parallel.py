"""The DDP engine matches single-process training on the concatenated batch."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import weakref

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel_config import UNBUILT_FIELDS
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.distributed_harness import current_device, error_of, run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    device_batch,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)

STEPS = 3
GLOBAL_BATCH = 12
LR = 1e-3


def _step_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    # The engine leaves reduced gradients in `main_grad`; a stock optimizer reads `.grad`.
    for param in model.parameters():
        param.grad = param.main_grad
    optimizer.step()


def _train_ddp(
    ddp_kwargs: dict, num_microbatches: int, model_kwargs: dict
) -> dict[str, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_tiny_gpt(**model_kwargs)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(**ddp_kwargs), model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for tokens, labels in make_token_batches(STEPS, GLOBAL_BATCH):
        local_tokens = shard_batch(tokens, rank, world_size).chunk(num_microbatches)
        local_labels = shard_batch(labels, rank, world_size).chunk(num_microbatches)
        ddp.zero_grad_buffer()
        for i, (micro_tokens, micro_labels) in enumerate(zip(local_tokens, local_labels)):
            last = i == num_microbatches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = ddp(micro_tokens, labels=micro_labels).mean() / num_microbatches
                loss.backward()
        ddp.start_grad_sync()
        ddp.finish_grad_sync()
        _step_optimizer(optimizer, model)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _train_single_process(model_kwargs: dict) -> dict[str, torch.Tensor]:
    model = build_tiny_gpt(**model_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for tokens, labels in make_token_batches(STEPS, GLOBAL_BATCH):
        optimizer.zero_grad()
        model(tokens, labels=labels).mean().backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize(
    "world_size, ddp_kwargs, num_microbatches, model_kwargs",
    [
        pytest.param(2, {}, 1, {}, id="ws2"),
        pytest.param(4, {}, 1, {}, id="ws4"),
        pytest.param(
            2, {"overlap_grad_reduce": True, "bucket_size": 2000}, 1, {}, id="ws2-overlap-buckets"
        ),
        pytest.param(
            4,
            {"overlap_grad_reduce": True, "average_in_collective": True, "bucket_size": 3000},
            1,
            {"share_embeddings_and_output_weights": True},
            id="ws4-overlap-avg-tied",
        ),
        pytest.param(2, {}, 3, {}, id="ws2-no_sync-3-microbatches"),
        pytest.param(
            4, {"overlap_grad_reduce": True}, 3, {}, id="ws4-overlap-no_sync-3-microbatches"
        ),
    ],
)
def test_matches_single_process_on_concatenated_batch(
    world_size, ddp_kwargs, num_microbatches, model_kwargs
):
    results = run_distributed(_train_ddp, world_size, ddp_kwargs, num_microbatches, model_kwargs)
    expected = _train_single_process(model_kwargs)
    for rank_state in results:
        assert rank_state.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(rank_state[name], expected[name], msg=name)
    initial = build_tiny_gpt(**model_kwargs).state_dict()
    assert any(not torch.equal(initial[n], expected[n]) for n in expected), "training did nothing"


def _buckets_launched_during_backward() -> tuple[int, list[bool], list[bool]]:
    model = build_tiny_gpt()
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1500),
        model,
    )
    tokens, labels = device_batch(4)
    with ddp.no_sync():
        ddp(tokens, labels=labels).mean().backward()
    after_no_sync = [bucket.started for bucket in ddp.buckets]
    ddp(tokens, labels=labels).mean().backward()
    after_last_backward = [bucket.started for bucket in ddp.buckets]
    ddp.finish_grad_sync()
    return len(ddp.buckets), after_no_sync, after_last_backward


def test_overlap_launches_every_bucket_during_backward():
    for num_buckets, after_no_sync, after_last in run_distributed(
        _buckets_launched_during_backward, 2
    ):
        assert num_buckets > 2
        assert not any(after_no_sync)
        assert all(after_last)


def _bf16_local_and_reduced_grads(num_microbatches: int) -> tuple[dict, dict]:
    """This rank's bf16 gradients of each microbatch (plain model), summed in fp32, and the
    DDP-reduced fp32 `main_grad`s after accumulating the same microbatches."""
    config = tiny_gpt_config(params_dtype=torch.bfloat16, bf16=True)
    plain, wrapped = build_tiny_gpt(config), build_tiny_gpt(config)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), wrapped
    )
    tokens, labels = make_token_batches(1, 12)[0]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    micro_tokens = shard_batch(tokens, rank, world_size).chunk(num_microbatches)
    micro_labels = shard_batch(labels, rank, world_size).chunk(num_microbatches)
    local = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in plain.named_parameters()}
    for i, (t, lab) in enumerate(zip(micro_tokens, micro_labels)):
        plain.zero_grad()
        (plain(t, labels=lab).mean() / num_microbatches).backward()
        for name, param in plain.named_parameters():
            assert param.grad.dtype == torch.bfloat16
            local[name] += param.grad.float()
        with ddp.no_sync() if i < num_microbatches - 1 else contextlib.nullcontext():
            (ddp(t, labels=lab).mean() / num_microbatches).backward()
    ddp.finish_grad_sync()
    reduced = {name: param.main_grad.clone() for name, param in wrapped.named_parameters()}
    return local, reduced


@pytest.mark.parametrize("num_microbatches", [1, 3])
def test_grad_reduce_in_fp32_with_bf16_params(num_microbatches):
    """Accumulation and reduction happen in fp32: the result matches the fp32 sum of the bf16
    microbatch gradients to fp32 precision (bf16 accumulation would be off by ~1e-3)."""
    world_size = 2
    results = run_distributed(_bf16_local_and_reduced_grads, world_size, num_microbatches)
    local_grads = [local for local, _ in results]
    for name in local_grads[0]:
        expected = sum(grads[name] / world_size for grads in local_grads)
        for _, reduced in results:
            assert reduced[name].dtype == torch.float32
            torch.testing.assert_close(reduced[name], expected, msg=name)


def _nan_gradient_raises() -> str:
    model = build_tiny_gpt()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(check_for_nan_in_grad=True), model
    )
    tokens, labels = device_batch(4)
    (ddp(tokens, labels=labels).mean() * float("nan")).backward()
    with pytest.raises(RuntimeError, match="NaN or Inf") as info:
        ddp.finish_grad_sync()
    return str(info.value)


def test_check_for_nan_in_grad_raises_before_communication():
    messages = run_distributed(_nan_gradient_raises, 2)
    assert all("check_for_nan_in_grad" in message for message in messages)


def _scale_and_zero(distributed_optimizer: bool) -> tuple[float, float, float]:
    model = build_tiny_gpt()
    config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    ddp = DistributedDataParallel(model.config, config, model)
    tokens, labels = device_batch(4)
    ddp(tokens, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    param = next(model.parameters())
    # What the optimizer reads: the reduced shard of this rank's rows, or the whole main_grad.
    grad = ddp.grad_shard(param) if distributed_optimizer else param.main_grad
    before = grad.norm().item()
    ddp.scale_gradients(0.5)
    scaled = grad.norm().item()
    ddp.zero_grad_buffer()
    return before, scaled, param.main_grad.norm().item()


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_scale_gradients_and_zero_grad_buffer(distributed_optimizer):
    for before, scaled, zeroed in run_distributed(_scale_and_zero, 2, distributed_optimizer):
        assert before > 0
        assert scaled == pytest.approx(before / 2)
        assert zeroed == 0.0


def _scaled_before_the_reduction(distributed_optimizer: bool) -> tuple[float, float]:
    """The reduced gradient's norm, and its norm when `scale_gradients(0.5)` ran between the
    backward and `finish_grad_sync()` (before: lost with the distributed optimizer)."""
    model = build_tiny_gpt()
    config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    ddp = DistributedDataParallel(model.config, config, model)
    tokens, labels = device_batch(4)
    param = next(model.parameters())
    norms = []
    for scale_first in (False, True):
        ddp.zero_grad_buffer()
        ddp(tokens, labels=labels).mean().backward()
        if scale_first:
            ddp.scale_gradients(0.5)
        ddp.finish_grad_sync()
        grad = ddp.grad_shard(param) if distributed_optimizer else param.main_grad
        norms.append(grad.norm().item())
    return norms[0], norms[1]


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_scale_gradients_before_the_reduction(distributed_optimizer):
    for unscaled, scaled in run_distributed(_scaled_before_the_reduction, 2, distributed_optimizer):
        assert unscaled > 0 and scaled == pytest.approx(unscaled / 2)


def _abandoned_step_then_a_fresh_one() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A backward whose overlapped all-reduces are in flight, abandoned by `zero_grad_buffer()`
    (before: zeroed before waiting, so the reductions wrote old sums into the next step), then
    a fresh step; and the fresh step alone."""
    model = build_tiny_gpt()
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2000)
    ddp = DistributedDataParallel(model.config, config, model)
    tokens, labels = device_batch(4)
    grads = []
    for abandon_first in (True, False):
        if abandon_first:
            ddp(tokens, labels=labels).mean().mul(1000.0).backward()
        ddp.zero_grad_buffer()
        ddp(tokens, labels=labels).mean().backward()
        ddp.finish_grad_sync()
        grads.append([p.main_grad.clone() for p in model.parameters()])
    return grads[0], grads[1]


def test_zero_grad_buffer_waits_for_reductions_in_flight():
    for after_abandoned, fresh in run_distributed(_abandoned_step_then_a_fresh_one, 2):
        for actual, expected in zip(after_abandoned, fresh):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _torch_shaped_loop(
    distributed_optimizer: bool, per_token: bool = False
) -> dict[str, torch.Tensor]:
    """Stock SGD over `ddp.parameters()` in torch's loop (zero_grad, backward, step) with
    `finish_grad_sync()` but no `zero_grad_buffer()` (before: every step after the first
    skipped its all-reduce and the ranks drifted apart)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_tiny_gpt(tiny_gpt_config(calculate_per_token_loss=per_token))
    config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    ddp = DistributedDataParallel(model.config, config, model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for tokens, labels in make_token_batches(STEPS, GLOBAL_BATCH):
        optimizer.zero_grad()
        tokens, labels = (
            shard_batch(tokens, rank, world_size),
            shard_batch(labels, rank, world_size),
        )
        ddp(tokens, labels=labels).mean().backward()
        ddp.finish_grad_sync()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_a_loop_without_zero_grad_buffer_reduces_every_step():
    reference = build_tiny_gpt()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for tokens, labels in make_token_batches(STEPS, GLOBAL_BATCH):
        optimizer.zero_grad()
        reference(tokens, labels=labels).mean().backward()
        optimizer.step()
    for state in run_distributed(_torch_shaped_loop, 2, False):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, msg=name)
    for message in run_distributed(error_of, 2, _torch_shaped_loop, True):
        assert "call zero_grad_buffer" in message
    # Summed reductions would count the reduced gradients once per rank: refused too.
    for message in run_distributed(error_of, 2, _torch_shaped_loop, False, True):
        assert re.search("calculate_per_token_loss .summed gradients", message), message


def _prefixed_keys() -> bool:
    model = build_tiny_gpt()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    expected = {f"x.{key}" for key in model.state_dict()}
    return set(ddp.state_dict("x.")) == expected == set(ddp.state_dict(prefix="x."))


def test_state_dict_takes_upstreams_positional_prefix():
    """Before: torch read the prefix as the destination dict and failed."""
    assert run_distributed(_prefixed_keys, 2) == [True, True]


def _double_sync_without_zeroing() -> None:
    model = build_tiny_gpt()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(overlap_grad_reduce=True), model
    )
    tokens, labels = device_batch(4)
    for _ in range(2):
        ddp(tokens, labels=labels).mean().backward()


def test_overlap_second_synced_backward_without_zero_grad_buffer_is_an_error():
    for message in run_distributed(error_of, 2, _double_sync_without_zeroing):
        assert "zero_grad_buffer" in message


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"data_parallel_sharding_strategy": "zero3"}, "data_parallel_sharding_strategy"),
        (
            {"use_megatron_fsdp": True, "outer_dp_sharding_strategy": "full"},
            "outer_dp_sharding_strategy",
        ),
        ({"bucket_size": 0}, "bucket_size"),
        ({"num_distributed_optimizer_instances": 0}, "num_distributed_optimizer_instances"),
        ({"megatron_fsdp_main_params_dtype": torch.int8}, "megatron_fsdp_main_params_dtype"),
        ({"data_parallel_sharding_strategy": "optim_grads"}, "use_megatron_fsdp=True"),
        ({"use_symm_mem": True}, "use_symm_mem"),
        (
            {
                "use_megatron_fsdp": True,
                "outer_dp_sharding_strategy": "optim",
                "data_parallel_sharding_strategy": "optim_grads_params",
            },
            "num_distributed_optimizer_instances",
        ),
        (
            {
                "use_megatron_fsdp": True,
                "outer_dp_sharding_strategy": "optim",
                "num_distributed_optimizer_instances": 2,
                "data_parallel_sharding_strategy": "optim",
            },
            "optim_grads_params",
        ),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DistributedDataParallelConfig(**kwargs)


def test_megatron_cores_config_fields_are_accepted_or_refused_by_name():
    """Upstream's Megatron-FSDP tests build the config with these (before: TypeError)."""
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        num_buckets=None,
        fsdp_double_buffer=True,  # speed only: any value
        nccl_ub=True,
        check_for_large_grads=False,
        align_param_gather=False,
    )
    assert config.fsdp_double_buffer and config.nccl_ub
    defaults = {f.name: f.default for f in dataclasses.fields(DistributedDataParallelConfig)}
    for name in UNBUILT_FIELDS:
        bad = ("x",) if isinstance(defaults[name], tuple) else not defaults[name]
        with pytest.raises(ValueError, match=f"DistributedDataParallelConfig.{name}=.* not built"):
            DistributedDataParallelConfig(**{name: bad})


def _wrap_with_fsdp_config() -> None:
    model = build_tiny_gpt()
    with pytest.raises(ValueError, match="FullyShardedDataParallel"):
        DistributedDataParallel(
            model.config, DistributedDataParallelConfig(use_megatron_fsdp=True), model
        )


def test_ddp_refuses_an_fsdp_config():
    run_distributed(_wrap_with_fsdp_config, 2)


def _nccl_kernels_overlapping_compute() -> tuple[int, int]:
    """(all-reduce kernels, of which overlap a compute kernel) in one overlapped backward."""
    from torch.profiler import ProfilerActivity, profile

    config = tiny_gpt_config(hidden_size=1024, num_attention_heads=8, num_layers=4)
    model = build_tiny_gpt(config, vocab_size=1024, max_sequence_length=512)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=4_000_000),
        model,
    )
    tokens = torch.randint(0, 1024, (4, 512), device="cuda")

    def step() -> None:
        ddp.zero_grad_buffer()
        ddp(tokens, labels=tokens).mean().backward()
        ddp.finish_grad_sync()
        torch.cuda.synchronize()

    step()  # warm-up: NCCL communicator and cuBLAS handles
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = [e for e in kernels if "nccl" in e.name.lower()]
    compute = [e for e in kernels if "nccl" not in e.name.lower()]

    def overlaps(a, b) -> bool:
        return a.time_range.start < b.time_range.end and b.time_range.start < a.time_range.end

    return len(nccl), sum(any(overlaps(n, c) for c in compute) for n in nccl)


@pytest.mark.gpu
def test_overlapped_all_reduce_runs_concurrently_with_backward_on_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for num_all_reduces, num_overlapping in run_distributed(_nccl_kernels_overlapping_compute, 2):
        assert num_all_reduces > 2
        assert num_overlapping >= 1


def _unused_parameter(overlap: bool) -> float:
    model = build_tiny_gpt()
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(3, device=current_device())))
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(overlap_grad_reduce=overlap), model
    )
    tokens, labels = device_batch(4)
    ddp(tokens, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    return model.unused.main_grad.abs().sum().item()


def test_unused_parameter_without_overlap_gets_a_zero_gradient():
    assert run_distributed(_unused_parameter, 2, False) == [0.0, 0.0]


def test_unused_parameter_with_overlap_is_named_in_the_error():
    for message in run_distributed(error_of, 2, _unused_parameter, True):
        assert re.search(r"no gradient.*'unused'", message), message


def _wrap_twice_then_after_delete() -> bool:
    model = build_tiny_gpt()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    with pytest.raises(ValueError, match="already wrapped"):
        DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    engine = weakref.ref(ddp)
    del ddp
    freed = engine() is None  # no strong back-edge from the parameters keeps it alive
    rewrapped = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    tokens, labels = device_batch(4)
    rewrapped(tokens, labels=labels).mean().backward()
    rewrapped.finish_grad_sync()
    return freed and all(p.main_grad.abs().sum() > 0 for p in model.decoder.parameters())


def test_wrapping_twice_is_refused_and_a_deleted_engine_is_freed():
    assert run_distributed(_wrap_twice_then_after_delete, 2) == [True, True]


def _reduce_over_explicit_group() -> tuple[list[int], dict, dict, dict]:
    """Ranks {0,1} and {2,3} form two data-parallel groups given through pg_collection."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    members = [0, 1] if rank < 2 else [2, 3]
    model, plain = build_tiny_gpt(), build_tiny_gpt()
    if rank % 2:  # different weights on the second rank of each group, until broadcast
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(),
        model,
        pg_collection=ProcessGroupCollection(dp_cp=groups[rank // 2]),
    )
    ddp.broadcast_params()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    tokens, labels = device_batch(4, seed=rank)
    plain(tokens, labels=labels).mean().backward()
    ddp(tokens, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    local = {name: p.grad for name, p in plain.named_parameters()}
    reduced = {name: p.main_grad.clone() for name, p in model.named_parameters()}
    for group in groups:
        dist.destroy_process_group(group)
    return members, weights, local, reduced


def test_pg_collection_group_and_broadcast_params():
    results = run_distributed(_reduce_over_explicit_group, 4)
    initial = {name: p.detach() for name, p in build_tiny_gpt().named_parameters()}
    for members, weights, _, reduced in results:
        for name in initial:
            torch.testing.assert_close(weights[name], initial[name], rtol=0, atol=0)
            expected = sum(results[m][2][name] for m in members) / len(members)
            torch.testing.assert_close(reduced[name], expected, msg=name)
    # The two groups saw different data, so their averages differ.
    name = next(iter(initial))
    assert not torch.allclose(results[0][3][name], results[2][3][name])
