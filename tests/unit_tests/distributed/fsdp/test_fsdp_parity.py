"""Megatron-FSDP trains exactly like one process on the concatenated batch, for every strategy,
with and without gradient accumulation, in fp32 and in bf16 with fp32 main weights."""

from __future__ import annotations

import pytest
import torch

from megatron.core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES
from tests.unit_tests.distributed.fsdp.fsdp_training import (
    BF16_MAX_UPDATE_ERROR,
    assert_update_close,
    build_model,
    full_state,
    train_fsdp,
    train_reference,
)
from tests.unit_tests.distributed_harness import run_distributed


def _assert_matches(results, expected):
    for rank_state in results:
        assert rank_state.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(rank_state[name], expected[name], msg=name)


def _assert_trained(kind, bf16, expected):
    initial = full_state(build_model(kind, bf16))
    assert any(not torch.equal(initial[n], expected[n]) for n in expected), "training did nothing"


@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_gpt_matches_single_process(strategy, num_microbatches):
    results = run_distributed(train_fsdp, 2, "gpt", strategy, num_microbatches, False)
    expected = train_reference("gpt", False)
    _assert_matches(results, expected)
    _assert_trained("gpt", False, expected)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_gpt_bf16_with_fp32_main_weights(strategy, num_microbatches, optimizer):
    results = run_distributed(
        train_fsdp, 2, "gpt", strategy, num_microbatches, True, optimizer=optimizer
    )
    expected = train_reference(
        "gpt", True, optimizer=optimizer, world_size=2, num_microbatches=num_microbatches
    )
    initial = full_state(build_model("gpt", True))
    assert_update_close(results, expected, initial, BF16_MAX_UPDATE_ERROR[optimizer])


@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_uneven_shapes_match_single_process_at_world_size_4(strategy, num_microbatches):
    results = run_distributed(train_fsdp, 4, "uneven", strategy, num_microbatches, False)
    _assert_matches(results, train_reference("uneven", False))


def test_uneven_shapes_bf16_at_world_size_4():
    results = run_distributed(train_fsdp, 4, "uneven", "optim_grads_params", 3, True)
    expected = train_reference("uneven", True, world_size=4, num_microbatches=3)
    initial = full_state(build_model("uneven", True))
    assert_update_close(results, expected, initial, BF16_MAX_UPDATE_ERROR["adamw"])


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_sgd_catches_gradient_scale(strategy):
    """SGD's update is proportional to the gradient: a wrong average would show."""
    results = run_distributed(train_fsdp, 4, "uneven", strategy, 3, False, optimizer="sgd")
    _assert_matches(results, train_reference("uneven", False, optimizer="sgd"))


@pytest.mark.parametrize(
    "strategy, outer",
    [(s, "no_shard") for s in SHARDING_STRATEGIES] + [("optim_grads_params", "optim")],
    ids=[f"hsdp-{s}" for s in SHARDING_STRATEGIES] + ["hfsdp"],
)
@pytest.mark.parametrize("num_microbatches", [1, 3])
def test_hybrid_sharding_2x2_matches_single_process(strategy, outer, num_microbatches):
    results = run_distributed(
        train_fsdp, 4, "gpt", strategy, num_microbatches, False, outer=outer, num_replicas=2
    )
    _assert_matches(results, train_reference("gpt", False))


@pytest.mark.parametrize("kind", ["gpt", "uneven"])
def test_hfsdp_sgd_uneven_and_bf16(kind):
    results = run_distributed(
        train_fsdp,
        4,
        kind,
        "optim_grads_params",
        3,
        False,
        outer="optim",
        num_replicas=2,
        optimizer="sgd",
    )
    _assert_matches(results, train_reference(kind, False, optimizer="sgd"))


@pytest.mark.parametrize(
    "strategy, outer, num_replicas",
    [(s, "no_shard", 1) for s in SHARDING_STRATEGIES] + [("optim_grads_params", "optim", 2)],
    ids=[*SHARDING_STRATEGIES, "hfsdp"],
)
def test_stepping_local_shards_equals_stepping_dtensors(strategy, outer, num_replicas):
    # bf16 compute, fp32 main weights, frozen weights and accumulation: every path of the
    # gradients to the optimizer; the same arithmetic on the same storage is bitwise equal.
    kwargs = dict(
        outer=outer, num_replicas=num_replicas, frozen=("decoder.layers.0.mlp.linear_fc1.weight",)
    )
    args = (train_fsdp, 4, "gpt", strategy, 2, True)
    dtensors = run_distributed(*args, local_shards=False, **kwargs)
    local = run_distributed(*args, **kwargs)
    _assert_trained("gpt", True, local[0])
    for expected, got in zip(dtensors, local):
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
