"""Evaluation during and after training: the reported losses over `--eval-iters` global batches
of a split, in eval mode, run eagerly (outside any CUDA graph of the training iteration)."""

from __future__ import annotations

import argparse

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.stage import Model, model_chunks
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.training.loss_reduction import from_last_stage, loss_values, reduce_loss_dicts
from megatron.training.profiling import empty_unused_memory
from megatron.training.schedules import DataIterator, ForwardStepFunc, forward_backward
from megatron.training.training_log import TrainingLog


@torch.no_grad()
def evaluate(
    forward_step_func: ForwardStepFunc,
    data_iterator: DataIterator,
    model: Model,
    args: argparse.Namespace,
) -> dict[str, float]:
    """The reported losses over `--eval-iters` global batches, in eval mode (no dropout).

    Args:
        forward_step_func: `(data_iterator, model) -> (output_tensor, loss_func)`.
        data_iterator: this rank's micro-batches of the split.
        model: the wrapped model, or the list of this rank's wrapped model chunks; back in
            train mode on return.
        args: validated arguments (`eval_iters`, `num_microbatches`).

    Returns:
        Each reported loss over the batches, microbatches and data-parallel ranks: a mean
        averaged, a `[sum, count]` pair pooled (the sum of the sums over the sum of the
        counts, as Megatron-LM).
    """
    chunks = model_chunks(model)
    for chunk in chunks:
        chunk.eval()
    total = None
    for _ in range(args.eval_iters):
        # Plain forwards: outside microbatch() each one refreshes stale weights on its own.
        loss_dicts, _ = forward_backward(
            forward_step_func,
            data_iterator,
            model,
            args.num_microbatches,
            forward_only=True,
            cp_group=parallel_state.get_context_parallel_group(),
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
        )
        empty_unused_memory(args, level=1)
        if not loss_dicts:  # a pipeline stage other than the last
            continue
        reduced, layout = reduce_loss_dicts(loss_dicts)
        total = reduced if total is None else total + reduced
    for chunk in chunks:
        chunk.train()
    # As Megatron-LM: whatever evaluation recorded stays out of the next step's report.
    get_moe_metrics_tracker().clear()
    # None: --eval-iters 0, or a pipeline stage without the loss (the last stage's follow).
    # Dividing a pair's sums and counts alike leaves its ratio as pooled.
    values = {} if total is None else loss_values(layout, (total / args.eval_iters).tolist())
    return from_last_stage(values)


def evaluate_and_print_results(
    forward_step_func: ForwardStepFunc,
    data_iterator: DataIterator,
    model: Model,
    args: argparse.Namespace,
    log: TrainingLog,
    *,
    split: str,
    when: str,
    iteration: int,
    write_to_tensorboard: bool = True,
) -> dict[str, float]:
    """Evaluates on `data_iterator` and logs the result (see `TrainingLog.log_evaluation`;
    `write_to_tensorboard=False` logs the box without writing scalars)."""
    losses = evaluate(forward_step_func, data_iterator, model, args)
    log.log_evaluation(split, when, iteration, losses, write_to_tensorboard)
    return losses
