"""`pretrain_gpt.py` with `--pipeline-model-parallel-size 2` composed with the other parallelisms
on 4 gloo ranks: PP 2 x TP 2 with sequence parallelism, MoE layers and a multi-token prediction
depth, and PP 2 x CP 2 with FP8, each under Megatron-FSDP and the DDP engine. The two engines
train alike (losses, the MoE auxiliary losses and the depth's loss, global gradient norms), every
rank records the same values (each stage's MoE layers and the last stage's depth gathered over
the stages), and the loss falls; expert parallelism splits the ranks of one stage. The library
tests check the same compositions against one process
(`tests/unit_tests/pipeline_parallel/test_pipeline_compositions.py`)."""

from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.arguments_validation import validate_args
from megatron.training.training import TrainingHistory
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.test_pretrain_gpt import TINY, ZERO3, _pretrain

STAGES = [*TINY, "--pipeline-model-parallel-size", "2", "--num-layers", "4"]

TP_MOE_MTP = [
    *STAGES,
    *"--global-batch-size 8 --tensor-model-parallel-size 2 --sequence-parallel".split(),
    *"--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq 2".split(),
    *"--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --mtp-num-layers 1".split(),
]
"""Dense and MoE layers (the experts split over tp), 4 microbatches of 2 sequences, dp 1."""

CP_FP8 = [
    *STAGES,
    *"--global-batch-size 8 --context-parallel-size 2 --position-embedding-type rope".split(),
    *"--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max".split(),
]
"""Each sequence split over 2 cp ranks, FP8 (delayed scaling) in fp32, dp 1."""


def _histories(runs: list[list[str]]) -> list[tuple[torch.Tensor, torch.Tensor, list[str]]]:
    results = []
    for flags in runs:
        history: TrainingHistory = _pretrain(flags)["history"]
        keys = sorted(history.losses[0])
        losses = torch.tensor([[losses[key] for key in keys] for losses in history.losses])
        results.append((losses, torch.tensor(history.grad_norms), keys))
    return results


def test_stages_train_alike_under_both_engines_with_tp_moe_mtp_and_cp_fp8():
    runs = [[*TP_MOE_MTP, *ZERO3], TP_MOE_MTP, [*CP_FP8, *ZERO3], CP_FP8]
    per_rank = run_distributed(_histories, 4, runs)
    expected_keys = [
        ["lm loss", "load_balancing_loss", "mtp_1 loss", "z_loss"],
        ["lm loss"],
    ]
    for pair, keys in enumerate(expected_keys):
        fsdp, ddp = per_rank[0][2 * pair], per_rank[0][2 * pair + 1]
        losses, grad_norms, names = ddp
        assert names == keys
        assert losses[-1, 0] < losses[0, 0]
        assert (grad_norms > 0).all()
        for rank_result in per_rank:
            for run in rank_result[2 * pair : 2 * pair + 2]:
                torch.testing.assert_close(run[:2], (losses, grad_norms))
        torch.testing.assert_close(fsdp[:2], (losses, grad_norms))


def test_expert_parallelism_splits_the_ranks_of_a_stage():
    flags = [*STAGES, "--num-experts", "4", "--distributed-backend", "gloo"]
    validate_args(parse_args(args=[*flags, "--expert-model-parallel-size", "2"]), world_size=4)
    args = parse_args(args=[*flags, "--expert-model-parallel-size", "4"])
    with pytest.raises(ValueError, match="does not divide the 2 ranks of a pipeline stage"):
        validate_args(args, world_size=4)
