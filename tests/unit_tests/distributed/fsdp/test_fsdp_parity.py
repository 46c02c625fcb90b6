"""Megatron-FSDP trains exactly like one process on the concatenated batch, for every strategy,
with and without gradient accumulation, in fp32 and in bf16 with fp32 main weights."""

from __future__ import annotations

import pytest
import torch

from megatron.core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES
from tests.unit_tests.distributed.fsdp.fsdp_training import (
    LR,
    STEPS,
    build_model,
    full_state,
    train_fsdp,
    train_reference,
)
from tests.unit_tests.distributed_harness import run_distributed

# bf16: each rank's backward rounds differently from the one-process backward, so gradients
# differ at bf16 precision and Adam may move a weight differently. One AdamW step moves a weight
# by at most lr * (1 - beta1) / sqrt(1 - beta2) (= 3.16 lr at the default betas, Kingma & Ba
# section 2.1), so two runs drift apart by at most twice that per step.
BF16_ATOL = STEPS * 2 * LR * (1 - 0.9) / (1 - 0.999) ** 0.5


def _assert_matches(results, expected, atol=None):
    tolerances = {} if atol is None else {"atol": atol, "rtol": 0.0}
    for rank_state in results:
        assert rank_state.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(rank_state[name], expected[name], msg=name, **tolerances)


def _assert_trained(kind, bf16, expected):
    initial = full_state(build_model(kind, bf16))
    assert any(not torch.equal(initial[n], expected[n]) for n in expected), "training did nothing"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_gpt_matches_single_process(strategy, num_microbatches, bf16):
    results = run_distributed(train_fsdp, 2, "gpt", strategy, num_microbatches, bf16)
    expected = train_reference("gpt", bf16)
    _assert_matches(results, expected, BF16_ATOL if bf16 else None)
    _assert_trained("gpt", bf16, expected)


@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_uneven_shapes_match_single_process_at_world_size_4(strategy, num_microbatches):
    results = run_distributed(train_fsdp, 4, "uneven", strategy, num_microbatches, False)
    _assert_matches(results, train_reference("uneven", False))


def test_uneven_shapes_bf16_at_world_size_4():
    results = run_distributed(train_fsdp, 4, "uneven", "optim_grads_params", 3, True)
    _assert_matches(results, train_reference("uneven", True), BF16_ATOL)


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
