"""Megatron-LM's no-pipelining schedule: every microbatch of one iteration, forward, loss and
(unless evaluating) backward, inside the engine's gradient-accumulation scopes.

The script supplies `forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`;
`loss_func(output_tensor)` returns `(loss, report)`, the micro-batch's mean loss and the values
to report, or Megatron-LM's `(loss, num_tokens, report)` with the loss summed over its tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from megatron.core.distributed import FullyShardedDataParallel
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.fsdp import microbatch

DataIterator = Iterator[dict[str, torch.Tensor]]
Report = dict[str, torch.Tensor]
LossFunc = Callable[
    [torch.Tensor],
    tuple[torch.Tensor, Report] | tuple[torch.Tensor, torch.Tensor, Report],
]
ForwardStepFunc = Callable[[DataIterator, torch.nn.Module], tuple[torch.Tensor, LossFunc]]


def _microbatch_scope(
    model: _BaseDataParallel, index: int, count: int
) -> contextlib.AbstractContextManager:
    """Where microbatch `index` of `count` sits in gradient accumulation, for the engine."""
    is_last = index == count - 1
    if isinstance(model, FullyShardedDataParallel):
        return microbatch(model, is_last=is_last)
    return contextlib.nullcontext() if is_last else model.no_sync()


def forward_backward(
    forward_step_func: ForwardStepFunc,
    data_iterator: DataIterator,
    model: _BaseDataParallel,
    num_microbatches: int,
    forward_only: bool = False,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    calculate_per_token_loss: bool = False,
) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
    """Runs every microbatch of one iteration (Megatron-LM's no-pipelining schedule).

    Args:
        forward_step_func: `(data_iterator, model) -> (output_tensor, loss_func)`.
        data_iterator: this rank's micro-batches.
        model: the wrapped model.
        num_microbatches: microbatches of the iteration (gradient-accumulation steps).
        forward_only: no backward and no gradient-accumulation scopes (evaluation).
        scale_loss: multiplies each loss before backward (fp16's loss scale:
            `MegatronOptimizer.scale_loss`).
        calculate_per_token_loss: backpropagate each loss as it is (a sum over tokens) instead
            of divided by the microbatches: `train_step` divides the gradients by the global
            batch's tokens afterwards.

    A `loss_func` returns `(loss, report)` (loss: the micro-batch's mean), or Megatron-LM's
    `(loss, num_tokens, report)` (loss: the sum over its `num_tokens` tokens, divided by them,
    at least one, here unless `calculate_per_token_loss`).

    Returns:
        Each microbatch's reported losses (this rank's), and this rank's token count (None when
        `loss_func` returns no count).
    """
    loss_dicts = []
    num_tokens = None
    for index in range(num_microbatches):
        scope = (
            contextlib.nullcontext()
            if forward_only
            else _microbatch_scope(model, index, num_microbatches)
        )
        with scope:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
            outputs = loss_func(output_tensor)
            if len(outputs) == 3:
                loss, tokens, loss_dict = outputs
                num_tokens = tokens.detach() if num_tokens is None else num_tokens + tokens
                if not calculate_per_token_loss:
                    # As Megatron-LM: a micro-batch whose tokens are all masked adds nothing.
                    loss = loss / tokens.clamp(min=1)
            else:
                loss, loss_dict = outputs
            if not forward_only:
                if not calculate_per_token_loss:
                    # The gradient of the mean over microbatches: accumulation adds them up.
                    loss = loss / num_microbatches
                (loss if scale_loss is None else scale_loss(loss)).backward()
        loss_dicts.append(loss_dict)
    return loss_dicts, num_tokens
