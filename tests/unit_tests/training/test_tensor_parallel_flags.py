"""Tensor parallelism in the training script: its flags and their validation, the data each
rank reads and the loss averaging (over data-parallel ranks, never tensor-parallel peers)."""

from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.datasets.mock_dataset import MockGPTDataset
from megatron.training.arguments import core_transformer_config_from_args, parse_args
from megatron.training.data_iterators import build_train_valid_test_data_iterators
from megatron.training.utils import average_losses_across_data_parallel_group
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.flag_checks import BASE, validated
from tests.unit_tests.training.log_capture import capture_training_log

TP2 = ("--tensor-model-parallel-size", "2")


def test_tensor_parallelism_sets_the_data_parallel_size_and_pads_the_vocabulary():
    args = validated(
        *TP2, "--sequence-parallel", "--make-vocab-size-divisible-by", "8", world_size=8
    )
    assert args.data_parallel_size == 4
    assert args.num_microbatches == 1
    # Upstream's padding: the vocabulary of 100 up to a multiple of
    # --make-vocab-size-divisible-by x TP = 16 (at TP 1 it would be 104).
    assert args.padded_vocab_size == 112
    config = core_transformer_config_from_args(args)
    assert (config.tensor_model_parallel_size, config.sequence_parallel) == (2, True)
    assert validated(*TP2, world_size=2).data_parallel_size == 1
    assert parse_args(args=list(BASE)).tensor_model_parallel_size == 1


def test_sequence_parallel_at_tp_1_warns_and_is_off():
    with capture_training_log() as messages:
        args = validated("--sequence-parallel")
    assert args.sequence_parallel is False
    assert any("--sequence-parallel needs --tensor-model-parallel-size > 1" in m for m in messages)


BAD = [
    ((*TP2,), 3, "world size 3 is not a multiple of --tensor-model-parallel-size 2"),
    (("--tensor-model-parallel-size", "8"), 8, "--num-attention-heads 4 is not divisible by"),
    (
        (*TP2, "--group-query-attention", "--num-query-groups", "1"),
        4,
        "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
    ),
    ((*TP2, "--ffn-hidden-size", "33"), 4, "--ffn-hidden-size 33 is not divisible"),
    (
        (*TP2, "--sequence-parallel", "--seq-length", "33", "--max-position-embeddings", "64"),
        4,
        "--seq-length 33 is not divisible by --tensor-model-parallel-size 2",
    ),
    ((*TP2, "--num-experts", "4"), 4, "needs --sequence-parallel"),
    ((*TP2, "--sequence-parallel", "--tp-comm-overlap"), 4, "--tp-comm-overlap: tensor-parallel"),
    (
        ("--num-experts", "4", "--expert-tensor-parallel-size", "2", "--ffn-hidden-size", "33"),
        4,
        r"--moe-ffn-hidden-size \(33\) must be divisible by --expert-tensor-parallel-size \(2\)",
    ),
    (
        (
            *("--tensor-model-parallel-size", "4", "--sequence-parallel", "--num-experts", "4"),
            *("--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"),
        ),
        4,
        "tensor-parallel ranks would hold copies",
    ),
    (
        (*TP2, "--use-megatron-fsdp", "--num-distributed-optimizer-instances", "4"),
        4,
        "--num-distributed-optimizer-instances 4 does not divide the data-parallel x context",
    ),
    ((*TP2, "--global-batch-size", "3"), 4, "--global-batch-size 3 is not divisible"),
]


@pytest.mark.parametrize(("flags", "world_size", "message"), BAD, ids=lambda v: str(v))
def test_bad_tensor_parallel_combination_names_the_flag(flags, world_size, message):
    with pytest.raises(ValueError, match=message):
        validated(*flags, world_size=world_size)


def _reads_and_averages() -> tuple[list[list[int]], float, list[int], int]:
    """On 4 ranks at TP 2: this rank's first training batches, and the data-parallel mean of
    its rank number, with the data x context group it should average over."""
    args = validated(
        *TP2,
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--num-workers",
        "0",
        world_size=4,
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=2)

    def provider(num_samples: list[int]) -> tuple[MockGPTDataset | None, ...]:
        return tuple(
            MockGPTDataset(n, 8, 100, seed=i) if n else None for i, n in enumerate(num_samples)
        )

    train, _, _ = build_train_valid_test_data_iterators(provider, args)
    batches = [next(train)["tokens"].flatten().tolist() for _ in range(3)]
    train.close()
    rank = torch.tensor([float(torch.distributed.get_rank())])
    mean = average_losses_across_data_parallel_group(rank).item()
    return batches, mean, ps.get_group_ranks("dp_cp"), ps.get_tensor_model_parallel_rank()


def test_tensor_parallel_peers_read_the_same_samples_and_are_not_averaged():
    results = run_distributed(_reads_and_averages, 4)
    by_rank = {rank: result for rank, result in enumerate(results)}
    for rank, (batches, mean, dp_cp, tp_rank) in by_rank.items():
        peer = rank ^ 1  # tp groups [0,1] [2,3]
        assert tp_rank == rank % 2
        assert batches == by_rank[peer][0], rank
        assert mean == sum(dp_cp) / len(dp_cp), rank
        assert rank in dp_cp and peer not in dp_cp
    # The two data-parallel ranks read different samples.
    assert by_rank[0][0] != by_rank[2][0]


def test_sequence_parallel_with_tensor_parallelism_stays_on_without_a_warning():
    with capture_training_log() as messages:
        assert validated(*TP2, "--sequence-parallel", world_size=2).sequence_parallel
    assert not any("--sequence-parallel needs" in m for m in messages)
