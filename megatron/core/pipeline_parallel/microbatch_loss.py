"""One microbatch's loss as the schedules backpropagate it, and the engines' gradient
accumulation scope around its passes: shared by every schedule.

The script's `loss_func(output_tensor)` returns `(loss, report)`, the micro-batch's mean loss
and the values to report, or Megatron-LM's `(loss, num_tokens, report)` with the loss summed
over its tokens.

Under context parallelism each rank holds two chunks of every sequence, so a loss summed over
its tokens is its share of the micro-batch's: it is divided by the token count of the whole
sequences (the counts summed over the cp group) and multiplied by the cp size, since the engines
average gradients over data x context-parallel ranks: their mean is then the gradient of the
micro-batch's mean over all its tokens. A `(loss, report)` mean is multiplied by the cp size
alone (Megatron-LM's rule): the mean of the ranks' means, the whole sequence's mean where the
ranks count the same number of tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import group_size


@dataclasses.dataclass
class MicrobatchLoss:
    """What one microbatch's `loss_func` gave, ready for backward.

    Attributes:
        loss: the scalar to backpropagate (before the loss scale).
        report: the values to report.
        num_tokens: the token count `loss_func` returned (None: it returned none).
    """

    loss: torch.Tensor
    report: dict[str, torch.Tensor]
    num_tokens: torch.Tensor | None


def microbatch_loss(
    outputs: tuple,
    num_microbatches: int,
    forward_only: bool,
    calculate_per_token_loss: bool,
    cp_group: dist.ProcessGroup | None,
) -> MicrobatchLoss:
    """Turns `loss_func`'s outputs into the loss to backpropagate (module docstring): the
    gradient of the mean over microbatches, unless `calculate_per_token_loss` (then the sum,
    which the training step divides by the global batch's tokens afterwards)."""
    cp_size = group_size(cp_group)
    num_tokens = None
    if len(outputs) == 3:
        loss, tokens, report = outputs
        num_tokens = tokens.detach()
        if not calculate_per_token_loss and not forward_only:
            # As Megatron-LM: a micro-batch whose tokens are all masked adds nothing.
            loss = loss * cp_size / _sequence_tokens(tokens, cp_group).clamp(min=1)
    else:
        loss, report = outputs
        loss = loss * cp_size
    if not forward_only and not calculate_per_token_loss:
        # The gradient of the mean over microbatches: accumulation adds them up.
        loss = loss / num_microbatches
    return MicrobatchLoss(loss, report, num_tokens)


def _sequence_tokens(tokens: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The micro-batch's token count over its whole sequences: `tokens` summed over the cp
    group (a device tensor: no host synchronisation)."""
    if group_size(cp_group) == 1:
        return tokens
    total = tokens.detach().clone()
    dist.all_reduce(total, group=cp_group)
    return total


def accumulation_scope(model: torch.nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
    """The engine's scope for a pass of a step: `is_last` for the pass whose backward ends the
    step's gradient accumulation for `model` (its deferred reductions run then); every other
    pass only accumulates. A module without an engine gets no scope.

    Both engines defer their once-per-step reductions inside `no_sync()` (for Megatron-FSDP
    the same as `microbatch(is_last=False)`) and run them at the end of a backward outside it,
    so the last pass needs no scope."""
    if is_last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()
