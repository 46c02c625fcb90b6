"""How an iteration's losses and gradients are reduced over its microbatches and the
data-parallel ranks: the reported losses (means, or Megatron-LM's `[sum, count]` pairs), and
`--calculate-per-token-loss`'s division of the gradients by the global batch's token count."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.host_copy import HostCopy
from megatron.core.pipeline_parallel.stage import Model, model_chunks
from megatron.training.utils import average_losses_across_data_parallel_group

LossLayout = list[tuple[str, int]]
"""Each reported loss's key and width in a `reduce_loss_dicts` tensor: 1 for a mean, 2 for
Megatron-LM's `[sum, count]`."""


def reduce_loss_dicts(loss_dicts: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, LossLayout]:
    """Each reported loss over the microbatches, then averaged over the data-parallel ranks, as
    one flat device tensor (no host synchronisation: a CUDA graph captures it), and its layout
    for `loss_values`.

    A value of two elements is Megatron-LM's `[sum, count]` (`--calculate-per-token-loss`):
    its sums and counts are added over microbatches (averaging them over ranks leaves their
    ratio unchanged); other values are averaged. One all-reduce for all the losses.
    """
    local = []
    for key in loss_dicts[0]:
        values = torch.stack([d[key].detach().float().reshape(-1) for d in loss_dicts])
        local.append(values.sum(dim=0) if values.shape[1] == 2 else values.mean(dim=0))
    layout = [(key, value.numel()) for key, value in zip(loss_dicts[0], local)]
    return average_losses_across_data_parallel_group(torch.cat(local)), layout


def loss_values(layout: LossLayout, reduced: list[float]) -> dict[str, float]:
    """The losses a `reduce_loss_dicts` tensor (read to the host) holds: `[sum, count]` pairs
    become sum / count (nan without a count, as Megatron-LM's division)."""
    result, offset = {}, 0
    for key, width in layout:
        if width == 2:
            total, count = reduced[offset : offset + 2]
            result[key] = total / count if count else math.nan
        else:
            result[key] = reduced[offset]
        offset += width
    return result


class ReducedLosses:
    """An iteration's reported losses, reduced over its microbatches and the data-parallel ranks
    on the device, and read to the host when first asked for (`read`).

    A read at the end of every step would make the host wait for the step's GPU work before it
    queues the next iteration. Instead the losses are copied to the host as soon as they are
    computed (`HostCopy`), and `read` waits for that copy alone: a later read (an eager training
    loop's, at the next iteration) finds them there.

    Args:
        reduced: the losses, flat, as `reduce_loss_dicts` returns them (None: `values` given).
        layout: their keys and widths (`LossLayout`).
        values: losses on the host already, key -> value (then no `reduced`).
    """

    def __init__(
        self,
        reduced: torch.Tensor | None = None,
        layout: LossLayout = (),
        *,
        values: dict[str, float] | None = None,
    ) -> None:
        if (reduced is None) == (values is None):
            raise ValueError("ReducedLosses takes either the reduced losses or their values.")
        self._layout = layout
        self._values = values
        self._copy = None if reduced is None else HostCopy(reduced)

    @property
    def is_read(self) -> bool:
        """Whether `read` returns without waiting for the device."""
        return self._values is not None

    def read(self) -> dict[str, float]:
        """The losses, key -> value (waits for their copy to the host the first time)."""
        if self._values is None:
            self._values = loss_values(self._layout, self._copy.tolist())
            self._copy = None
        return self._values


def average_loss_dicts(loss_dicts: list[dict[str, torch.Tensor]]) -> ReducedLosses:
    """Averages each reported loss over the microbatches, then the data-parallel ranks
    (`reduce_loss_dicts`), unread. Under pipeline parallelism the last stage, the one with
    losses, hands its values to the other stages (`from_last_stage`), which reads them."""
    if _pipeline_group() is not None:
        values = None
        if loss_dicts:
            reduced, layout = reduce_loss_dicts(loss_dicts)
            values = loss_values(layout, reduced.tolist())
        return ReducedLosses(values=from_last_stage(values))
    return ReducedLosses(*reduce_loss_dicts(loss_dicts))


def _pipeline_group() -> dist.ProcessGroup | None:
    """The pipeline-parallel group; None with one stage."""
    if (
        not parallel_state.model_parallel_is_initialized()
        or parallel_state.get_pipeline_model_parallel_world_size() == 1
    ):
        return None
    return parallel_state.get_pipeline_model_parallel_group()


def from_last_stage(values: dict[str, float] | None) -> dict[str, float]:
    """The last pipeline stage's `values` on every stage (one broadcast over the pipeline
    group; `values` as they are with one stage), so that every rank logs and records the same
    losses."""
    group = _pipeline_group()
    if group is None:
        return values
    holder = [values]
    last_stage = dist.get_global_rank(group, group.size() - 1)
    dist.broadcast_object_list(holder, src=last_stage, group=group)
    return holder[0]


def divide_gradients_by_tokens(model: Model, num_tokens: torch.Tensor | None) -> None:
    """`--calculate-per-token-loss`: the reduced gradients (the data-parallel sum of each rank's
    summed losses' gradients: `model.sums_grads`) become the gradient of the global batch's loss
    per token.

    Args:
        model: the wrapped model, or the list of this rank's model chunks.
        num_tokens: this rank's token count of the iteration. Under pipeline parallelism only
            the last stage, which computes the loss, has one: it is broadcast to the other
            stages, so that every stage divides its gradients by the same count.

    Raises:
        RuntimeError: the loss function returned no token count (on every stage).
        ValueError: the engine averages the gradients instead of summing them.
    """
    chunks = model_chunks(model)
    if not all(chunk.sums_grads for chunk in chunks):
        raise ValueError(
            "--calculate-per-token-loss, but the wrapped model's config has "
            "calculate_per_token_loss=False, so its engine averages the gradients instead of "
            "summing them: build the model's TransformerConfig with the flag (core_transformer_"
            "config_from_args does)."
        )
    total = _tokens_of_the_last_stage(num_tokens, next(chunks[0].parameters()).device)
    if total is None:
        raise RuntimeError(
            "--calculate-per-token-loss needs the loss function to return (loss, num_tokens, "
            "report), the loss summed over num_tokens tokens; drop the flag or return the count."
        )
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dist.all_reduce(total, group=group)
    # A device tensor: no host synchronisation.
    for chunk in chunks:
        chunk.scale_gradients(1.0 / total.clamp(min=1.0))


def _tokens_of_the_last_stage(
    num_tokens: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """A float copy of the last pipeline stage's `num_tokens` on every stage (this rank's with
    one stage); None where the loss function returned no count. With several stages the count
    is broadcast over the pipeline group, -1 standing for none, which every stage reads on the
    host to raise alike (full-iteration CUDA graphs, which a host read would break, do not
    compose with stages)."""
    group = _pipeline_group()
    if group is None:
        return None if num_tokens is None else num_tokens.detach().float().clone()
    if parallel_state.is_pipeline_last_stage():
        missing = num_tokens is None
        count = torch.full((), -1.0, device=device) if missing else num_tokens.detach().float()
    else:
        count = torch.zeros((), device=device)
    count = count.clone()
    dist.broadcast(count, src=dist.get_global_rank(group, group.size() - 1), group=group)
    return None if count.item() < 0 else count
