"""`pretrain_gpt.py` with `--pipeline-model-parallel-size 2` on 2 gloo ranks: Megatron-FSDP and
the DDP engine train the same (losses, global gradient norms over both stages, clipping), every
rank records the last stage's losses, and the loss falls. Flags that stages do not compose with
yet are refused by name."""

from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.arguments_validation import validate_args
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.test_pretrain_gpt import TINY, ZERO3, _losses_and_norms

PIPELINE = [*TINY, "--global-batch-size", "8", "--pipeline-model-parallel-size", "2"]
"""4 microbatches of 2 sequences through 2 stages of one layer each, tied embeddings."""


def _both_engines(flags: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_losses_and_norms([*flags, *ZERO3]), _losses_and_norms(flags)]


def test_two_stages_train_alike_under_both_engines():
    (fsdp, ddp), (fsdp_last, ddp_last) = run_distributed(_both_engines, 2, PIPELINE)
    losses, grad_norms = ddp
    assert losses[-1] < losses[0]
    assert (grad_norms > 0.3).all(), f"clipping never acted: {grad_norms}"
    for result in (fsdp, fsdp_last, ddp_last):
        torch.testing.assert_close(result, ddp)


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
        (["--calculate-per-token-loss"], "--calculate-per-token-loss"),
        (["--cuda-graph-impl", "full_iteration"], "--cuda-graph-impl"),
        (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
    ],
)
def test_unbuilt_compositions_are_refused_by_name(extra, named):
    args = parse_args(args=[*PIPELINE, "--distributed-backend", "gloo", *extra])
    with pytest.raises(ValueError, match=named):
        validate_args(args, world_size=4)


def test_split_flags_need_stages():
    args = parse_args(
        args=[*TINY, "--distributed-backend", "gloo", "--decoder-last-pipeline-num-layers", "1"]
    )
    with pytest.raises(ValueError, match="--decoder-last-pipeline-num-layers"):
        validate_args(args, world_size=1)
