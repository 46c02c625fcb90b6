"""One training iteration (`train_step`, and `start_train_step`, which reads the optimizer step's
outcome later): every microbatch's forward and backward through this rank's model chunks, the
gradients' reduction, the optimizer step and the schedule's step (`megatron.training.training`
describes the sequence)."""

from __future__ import annotations

import argparse

import torch

from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.stage import Model, model_chunks
from megatron.core.pipeline_parallel.tied_embeddings import allreduce_tied_embedding_grads
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, update_expert_bias
from megatron.training.cuda_graphs import GraphedIteration
from megatron.training.loss_reduction import (
    ReducedLosses,
    average_loss_dicts,
    divide_gradients_by_tokens,
)
from megatron.training.optimizer_step import PendingStep, take_optimizer_step
from megatron.training.profiling import empty_unused_memory
from megatron.training.schedules import DataIterator, ForwardStepFunc, forward_backward
from megatron.training.utils import get_device


def train_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: DataIterator,
    model: Model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
    num_microbatches: int | None = None,
    graph: GraphedIteration | None = None,
) -> tuple[ReducedLosses, bool, float | None, int | None]:
    """One iteration: every microbatch's forward and backward, then the optimizer step and the
    schedule's step, read at once (`start_train_step` leaves the step's outcome for later).

    Args:
        forward_step_func: `(data_iterator, model) -> (output_tensor, loss_func)`.
        data_iterator: this rank's training micro-batches.
        model: the wrapped model, or the list of this rank's wrapped model chunks.
        optimizer: steps the model's main weights.
        scheduler: stepped after a successful update.
        args: validated arguments (`num_microbatches`, `check_for_nan_in_loss_and_grad`,
            `calculate_per_token_loss`).
        num_microbatches: this iteration's (a batch-size schedule's); None: `args`'.
        graph: with a full-iteration CUDA graph, runs the iteration's device work (the same
            computation, the optimizer stepping on the device: `megatron.training.cuda_graphs`).

    Returns:
        (losses, skipped, grad_norm, num_zeros_in_grad): the reported losses averaged over the
        microbatches and data-parallel ranks (on the device until read, where no pipeline stages
        or CUDA graph read them already), whether the optimizer step was skipped (a gradient
        norm that is not finite, or an fp16 overflow), that norm (None when the loss scaler
        skipped the step before taking it), and the number of zero gradient elements (None
        without `--log-num-zeros-in-grad`).

    Raises:
        RuntimeError: see `PendingStep.outcome`.
    """
    losses, step = start_train_step(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        scheduler,
        args,
        previous=None,
        num_microbatches=num_microbatches,
        graph=graph,
    )
    outcome = step.outcome()
    return losses, not outcome.update_successful, outcome.grad_norm, outcome.num_zeros_in_grad


def start_train_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: DataIterator,
    model: Model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
    previous: PendingStep | None,
    num_microbatches: int | None = None,
    graph: GraphedIteration | None = None,
) -> tuple[ReducedLosses, PendingStep]:
    """`train_step` with the optimizer step's outcome, and so the schedule's step, read when
    first asked for (`megatron.training.optimizer_step`): the training loop's iteration.

    Args:
        previous: the step the iteration before this one took, settled here before this one's
            step is taken (None: none, or settled already).
        Others: see `train_step`.

    Returns:
        (losses, step): the reported losses, on the device until read, and the optimizer step.

    Raises:
        RuntimeError: see `PendingStep.outcome` (for `previous`, or a step read at once).
    """
    if num_microbatches is None:
        num_microbatches = args.num_microbatches
    samples = num_microbatches * args.micro_batch_size * args.data_parallel_size
    if graph is not None:
        if previous is not None:
            previous.outcome()  # the graph's step reads the rates the schedule set
        values, update_successful, grad_norm, num_zeros_in_grad = graph(data_iterator)
        losses = ReducedLosses(values=values)
        measured = (update_successful, grad_norm, num_zeros_in_grad)
        step = PendingStep(measured, optimizer, scheduler, args, samples, losses)
        step.outcome()
        return losses, step
    loss_dicts = compute_gradients(
        forward_step_func, model, optimizer, args, data_iterator, num_microbatches
    )
    # Before the step: their copy to the host is then queued ahead of the step's kernels.
    losses = average_loss_dicts(loss_dicts)
    step = take_optimizer_step(optimizer, scheduler, args, samples, losses, previous)
    empty_unused_memory(args, level=2)
    return losses, step


def compute_gradients(
    forward_step_func: ForwardStepFunc,
    model: Model,
    optimizer: MegatronOptimizer,
    args: argparse.Namespace,
    data_iterator: DataIterator,
    num_microbatches: int,
) -> list[dict[str, torch.Tensor]]:
    """Every microbatch's forward and backward through this rank's model chunks, then the
    reduced gradients, ready for the optimizer step (a full-iteration CUDA graph captures this
    too). Returns each microbatch's reported losses (this rank's)."""
    chunks = model_chunks(model)
    config = chunks[0].config
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for chunk in chunks:
        chunk.start_param_sync()
    if config.num_moe_experts is not None or config.mtp_num_layers is not None:
        _set_auxiliary_loss_scale(optimizer, num_microbatches, args)
    loss_dicts, num_tokens = forward_backward(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        scale_loss=optimizer.scale_loss,
        calculate_per_token_loss=args.calculate_per_token_loss,
        cp_group=parallel_state.get_context_parallel_group(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
    )
    empty_unused_memory(args, level=1)
    for chunk in chunks:
        chunk.finish_grad_sync()
    # The two stages' copies of tied embeddings take the sum of their gradients.
    allreduce_tied_embedding_grads(chunks, parallel_state.get_embedding_group())
    if args.calculate_per_token_loss:
        divide_gradients_by_tokens(chunks, num_tokens)
    if config.moe_router_enable_expert_bias:
        # Megatron-core's place: once the gradients are final, before the step; every step
        # counts, skipped or not. The counts are summed over dp x cp here and over tp by the
        # routers' own group (under sequence parallelism each tp rank routes its own part of
        # the sequence): upstream's tp x dp x cp.
        update_expert_bias(
            chunks, parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
    return loss_dicts


def _set_auxiliary_loss_scale(
    optimizer: MegatronOptimizer, num_microbatches: int, args: argparse.Namespace
) -> None:
    """Gives the MoE auxiliary losses and the multi-token prediction losses the gradient scale
    of the main loss: the loss scale, divided by the microbatches and multiplied by the
    context-parallel size unless the loss is summed over tokens (as Megatron-core's schedule;
    each cp rank backpropagates its share of those losses, and the engines average over the cp
    ranks, as for the main loss). Their backward bypasses the loss, so it cannot inherit the
    scale. `MTPLossAutoScaler` shares `MoEAuxLossAutoScaler`'s scale."""
    scale = optimizer.scale_loss(torch.ones((), device=get_device()))
    if not args.calculate_per_token_loss:
        scale = scale * args.context_parallel_size / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale)
