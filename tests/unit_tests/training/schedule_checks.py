"""What the schedule tests share: a tiny mock-data command line for `pretrain` on 2 ranks,
`validated()`, parameter groups for a scheduler alone, and one SGD `train_step` of a masked
batch (`masked_sgd_train_step`)."""

from __future__ import annotations

import argparse
import functools

import torch

import pretrain_gpt
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import global_vars
from megatron.training.train_step import train_step
from tests.unit_tests.model_builders import shard_batch
from tests.unit_tests.training import flag_checks

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --lr 1e-2 --mock-data --vocab-size 64 --distributed-backend gloo"
).split()
TINY = [*BASE, *"--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --eval-iters 0".split()]
"""A tiny fp32 mock-data run for `pretrain` (2 ranks); each test adds its batch and length."""


validated = functools.partial(flag_checks.validated, base=tuple(BASE))
"""`BASE` plus the flags, parsed and validated (`flag_checks.validated`)."""


class ParamGroups:
    """Something with `param_groups`, for a scheduler alone."""

    def __init__(self, *groups: dict):
        self.param_groups = [dict(group) for group in groups]


def _masked_forward_step(data_iterator, model):
    tokens, labels, mask = next(data_iterator)
    return model(tokens, labels=labels), functools.partial(pretrain_gpt.loss_func, mask)


def masked_sgd_train_step(
    wrapped: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_microbatches: int,
    dp_rank: int,
    dp_size: int,
    per_token: bool,
) -> tuple[dict[str, float], bool]:
    """One `train_step` of `wrapped` (SGD, lr 1, no clipping: the weights move by the
    gradient) on this data-parallel rank's share of the global `batch` (tokens, labels, loss
    mask), each micro-batch's loss `pretrain_gpt.loss_func` of its mask. Returns the reported
    losses and whether the step was skipped."""
    tokens, labels, mask = batch
    config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0)
    config.clip_grad = 0.0
    optimizer = get_megatron_optimizer(config, wrapped)
    scheduler = OptimizerParamScheduler(
        optimizer, 0.0, 1.0, 0.0, 0, 100, "constant", 0.0, 0.0, 1, "constant"
    )
    args = argparse.Namespace(
        num_microbatches=num_microbatches,
        micro_batch_size=len(tokens) // (dp_size * num_microbatches),
        seq_length=tokens.shape[1],
        data_parallel_size=dp_size,
        check_for_nan_in_loss_and_grad=True,
        calculate_per_token_loss=per_token,
        empty_unused_memory_level=0,
    )
    global_vars.set_args(args)
    try:
        shares = (shard_batch(t, dp_rank, dp_size).chunk(num_microbatches) for t in batch)
        micro_batches = iter(list(zip(*shares)))
        losses, skipped, _, _ = train_step(
            _masked_forward_step, micro_batches, wrapped, optimizer, scheduler, args
        )
    finally:
        global_vars.set_args(None)
    return losses.read(), skipped
