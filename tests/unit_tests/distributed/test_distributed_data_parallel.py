"""The DDP engine matches single-process training on the concatenated batch."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from tests.unit_tests.distributed_harness import DistributedTestError, run_distributed
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


def _bf16_local_and_reduced_grads() -> tuple[dict, dict]:
    """This rank's own bf16 gradients (plain model) and the DDP-reduced fp32 `main_grad`s."""
    config = tiny_gpt_config(params_dtype=torch.bfloat16, bf16=True)
    plain, wrapped = build_tiny_gpt(config), build_tiny_gpt(config)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), wrapped
    )
    tokens, labels = make_token_batches(1, 8)[0]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokens, labels = shard_batch(tokens, rank, world_size), shard_batch(labels, rank, world_size)
    plain(tokens, labels=labels).mean().backward()
    ddp(tokens, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    local = {name: param.grad for name, param in plain.named_parameters()}
    reduced = {name: param.main_grad.clone() for name, param in wrapped.named_parameters()}
    return local, reduced


def test_grad_reduce_in_fp32_with_bf16_params():
    world_size = 2
    results = run_distributed(_bf16_local_and_reduced_grads, world_size)
    local_grads = [local for local, _ in results]
    for name, grad in local_grads[0].items():
        assert grad.dtype == torch.bfloat16
        expected = sum(grads[name].float() / world_size for grads in local_grads)
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


def _scale_and_zero() -> tuple[float, float, float]:
    model = build_tiny_gpt()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    tokens, labels = device_batch(4)
    ddp(tokens, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    param = next(model.parameters())
    before = param.main_grad.norm().item()
    ddp.scale_gradients(0.5)
    scaled = param.main_grad.norm().item()
    ddp.zero_grad_buffer()
    return before, scaled, param.main_grad.norm().item()


def test_scale_gradients_and_zero_grad_buffer():
    for before, scaled, zeroed in run_distributed(_scale_and_zero, 2):
        assert before > 0
        assert scaled == pytest.approx(before / 2)
        assert zeroed == 0.0


def _double_sync_without_zeroing() -> None:
    model = build_tiny_gpt()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    tokens, labels = device_batch(4)
    for _ in range(2):
        ddp(tokens, labels=labels).mean().backward()


def test_second_synced_backward_without_zero_grad_buffer_is_an_error():
    with pytest.raises(DistributedTestError, match="zero_grad_buffer"):
        run_distributed(_double_sync_without_zeroing, 2)


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


def _wrap_with_fsdp_config() -> None:
    model = build_tiny_gpt()
    with pytest.raises(ValueError, match="FullyShardedDataParallel"):
        DistributedDataParallel(
            model.config, DistributedDataParallelConfig(use_megatron_fsdp=True), model
        )


def test_ddp_refuses_an_fsdp_config():
    run_distributed(_wrap_with_fsdp_config, 2)
