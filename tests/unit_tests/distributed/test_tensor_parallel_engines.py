"""Tensor parallelism under the data-parallel engines: a model split over TP 2 x DP 2 trains
like plain single-process PyTorch (which the engines' TP 1 x DP 4 runs match: their own tests
and the TP checkpoint test) under every Megatron-FSDP strategy (also hybrid sharding), the DDP
engine and the distributed optimizer (SGD with momentum; AdamW under two engines; 2
microbatches per step): same losses, global gradient norms, weights, main weights and params
norm. A strided parameter whose data-parallel chunks would span two of its blocks is refused.
4 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from megatron.core.distributed.tensor_parallel_params import check_data_parallel_chunks
from megatron.core.tensor_parallel.layout import TensorParallelLayout
from tests.unit_tests.distributed.moe_training import Engine
from tests.unit_tests.distributed.tp_training import engine_run, global_batches, reference_run
from tests.unit_tests.distributed_harness import run_distributed

WORLD = 4
STEPS = 2
ENGINES = [
    Engine("fsdp", "no_shard"),
    Engine("fsdp", "optim"),
    Engine("fsdp", "optim_grads"),
    Engine("fsdp", "optim_grads_params"),
    Engine("fsdp", "optim_grads_params", replicas=2),
    Engine("fsdp", "optim_grads_params", outer_strategy="optim", replicas=2),
    Engine("ddp"),
    Engine("ddp", distributed_optimizer=True),
]
CASES = [("sgd", engine) for engine in ENGINES] + [
    ("adam", Engine("fsdp", "optim_grads_params")),
    ("adam", Engine("ddp", distributed_optimizer=True)),
]


def _runs(tp_size: int) -> list:
    batches = global_batches(STEPS)
    return [engine_run(tp_size, engine, kind, batches) for kind, engine in CASES]


def _assert_matches(run, reference, where: str) -> None:
    result, mains, params_norm = run
    # fp32 values (TP sums in another order): compared at fp32 precision.
    for key in ("losses", "grad_norms"):
        actual, expected = (torch.tensor(getattr(r, key)) for r in (result, reference))
        torch.testing.assert_close(actual, expected, msg=f"{where} {key}")
    assert result.weights.keys() == reference.weights.keys()
    for name, value in reference.weights.items():
        torch.testing.assert_close(result.weights[name], value, msg=f"{where} {name}")
    # Every main weight is the global value of one of the weights (and there is one each).
    assert len(mains) == len(reference.weights)
    for main in mains:
        assert any(
            main.shape == w.shape and torch.allclose(main, w, rtol=1.3e-6, atol=1e-5)
            for w in reference.weights.values()
        ), f"{where}: a main weight of shape {tuple(main.shape)} matches no weight"
    expected = torch.nn.utils.get_total_norm(list(reference.weights.values()))
    torch.testing.assert_close(torch.tensor(params_norm), expected, msg=f"{where} params norm")


def test_tensor_parallel_engines_match_plain_torch():
    batches = global_batches(STEPS)
    references = {kind: reference_run(batches, kind) for kind in ("sgd", "adam")}
    for rank, runs in enumerate(run_distributed(_runs, WORLD, 2)):
        for (kind, engine), run in zip(CASES, runs):
            _assert_matches(run, references[kind], f"rank {rank} {kind} {engine}")


def test_strided_chunks_spanning_blocks_are_refused():
    gated = TensorParallelLayout(0, 2)
    # 8 rows in 2 blocks of 4: chunks of 4 (2 ranks) or 2 (4 ranks) stay in their blocks.
    check_data_parallel_chunks("fc1.weight", torch.Size((8, 16)), gated, [2])
    check_data_parallel_chunks("fc1.weight", torch.Size((8, 16)), gated, [2, 2])
    check_data_parallel_chunks("fc1.weight", torch.Size((8, 16)), TensorParallelLayout(0), [3])
    # 6 rows in blocks of 3 over 4 ranks: chunks of 2 rows, rows 2..3 span both blocks.
    with pytest.raises(ValueError, match=r"'fc1.weight'.*2 blocks of 3 rows.*rows 2\.\.3"):
        check_data_parallel_chunks("fc1.weight", torch.Size((6, 16)), gated, [4])
    # Nested (hybrid) sharding: 4 blocks of 3 rows, halves of 6, thirds of those: rows 2..3.
    with pytest.raises(ValueError, match=r"spans two blocks"):
        check_data_parallel_chunks("w", torch.Size((12, 4)), TensorParallelLayout(0, 4), [2, 3])
