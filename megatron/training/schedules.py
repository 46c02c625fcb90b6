"""Megatron-LM's no-pipelining schedule: every microbatch of one iteration, forward, loss and
(unless evaluating) backward, inside the engine's gradient-accumulation scopes.

The script supplies `forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`;
`loss_func(output_tensor)` returns `(loss, report)`, the micro-batch's mean loss and the values
to report, or Megatron-LM's `(loss, num_tokens, report)` with the loss summed over its tokens.

The loss each microbatch backpropagates (its scaling under context parallelism and per-token
losses) is `megatron.core.pipeline_parallel.microbatch_loss`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.microbatch_loss import accumulation_scope, microbatch_loss
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.pipeline_parallel.stage import Model, model_chunks
from megatron.core.tensor_parallel.utils import group_size

DataIterator = Iterator[dict[str, torch.Tensor]]
Report = dict[str, torch.Tensor]
LossFunc = Callable[
    [torch.Tensor],
    tuple[torch.Tensor, Report] | tuple[torch.Tensor, torch.Tensor, Report],
]
ForwardStepFunc = Callable[[DataIterator, torch.nn.Module], tuple[torch.Tensor, LossFunc]]


def forward_backward(
    forward_step_func: ForwardStepFunc,
    data_iterator: DataIterator,
    model: Model,
    num_microbatches: int,
    forward_only: bool = False,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    calculate_per_token_loss: bool = False,
    cp_group: dist.ProcessGroup | None = None,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
    """Runs every microbatch of one iteration: Megatron-LM's no-pipelining schedule, or with
    several pipeline stages (parallel_state's) the 1F1B schedule of
    `megatron.core.pipeline_parallel.schedules`, interleaved with several model chunks
    (virtual stages), which reports losses on the last stage only.

    Args:
        forward_step_func: `(data_iterator, model) -> (output_tensor, loss_func)`.
        data_iterator: this rank's micro-batches.
        model: the wrapped model, or the list of this rank's wrapped model chunks.
        num_microbatches: microbatches of the iteration (gradient-accumulation steps).
        forward_only: no backward and no gradient-accumulation scopes (evaluation).
        scale_loss: multiplies each loss before backward (fp16's loss scale:
            `MegatronOptimizer.scale_loss`).
        calculate_per_token_loss: backpropagate each loss as it is (a sum over tokens) instead
            of divided by the microbatches: `train_step` divides the gradients by the global
            batch's tokens afterwards.
        cp_group: the context-parallel group (None: none); its size must be the model config's
            `context_parallel_size`.
        seq_length: the micro-batches' sequence length (pipeline stages exchange
            [seq_length, micro_batch_size, hidden] tensors).
        micro_batch_size: sequences per micro-batch.

    A `loss_func` returns `(loss, report)` (loss: the micro-batch's mean), or Megatron-LM's
    `(loss, num_tokens, report)` (loss: the sum over its `num_tokens` tokens, divided by them,
    at least one, here unless `calculate_per_token_loss`).

    Returns:
        Each microbatch's reported losses (this rank's), and this rank's token count (None when
        `loss_func` returns no count).

    Raises:
        ValueError: `cp_group`'s size is not the model's `context_parallel_size`.
    """
    chunks = model_chunks(model)
    cp_size = group_size(cp_group)
    config = getattr(chunks[0], "config", None)  # a model without one splits no sequences
    expected = 1 if config is None else config.context_parallel_size
    if cp_size != expected:
        raise ValueError(
            f"forward_backward: the model's context_parallel_size is {expected} but cp_group "
            f"has {cp_size} ranks; pass the context-parallel group the model splits sequences "
            "over."
        )
    if config is not None and config.pipeline_model_parallel_size > 1:
        virtual = len(chunks) if len(chunks) > 1 else None
        return get_forward_backward_func(config.pipeline_model_parallel_size, virtual)(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=chunks if virtual else chunks[0],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            scale_loss=scale_loss,
            calculate_per_token_loss=calculate_per_token_loss,
            cp_group=cp_group,
        )
    if len(chunks) > 1:
        raise ValueError(
            f"forward_backward got {len(chunks)} model chunks without pipeline stages: virtual "
            "stages need the model's pipeline_model_parallel_size > 1."
        )
    (model,) = chunks
    loss_dicts = []
    num_tokens = None
    for index in range(num_microbatches):
        scope = (
            contextlib.nullcontext()
            if forward_only
            else accumulation_scope(model, is_last=index == num_microbatches - 1)
        )
        with scope:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
            result = microbatch_loss(
                loss_func(output_tensor),
                num_microbatches,
                forward_only,
                calculate_per_token_loss,
                cp_group,
            )
            if result.num_tokens is not None:
                tokens = result.num_tokens
                num_tokens = tokens if num_tokens is None else num_tokens + tokens
            if not forward_only:
                loss = result.loss
                (loss if scale_loss is None else scale_loss(loss)).backward()
        loss_dicts.append(result.report)
    return loss_dicts, num_tokens
