"""Cross-entropy over logits whose vocabulary is split over the tensor-parallel (tp) group.

Each tp rank holds the logits of its `V/T` vocabulary ids (the output of a column-parallel
output layer). The loss needs only per-token statistics of the whole vocabulary: the maximum,
the sum of exponentials and the target's logit (and, with label smoothing, the sum of the
logits), each reduced over tp, so the whole `[tokens, V]` logits are never gathered. The math
is fp32 whatever the logits' dtype; the result and its gradient equal
`F.cross_entropy(logits.float(), target, reduction="none", label_smoothing=...)` on the
gathered logits, including `ignore_index=-100` (loss 0, no gradient).

Label smoothing follows `torch.nn.functional.cross_entropy`: mass `label_smoothing / V` on
every id of the whole vocabulary (Megatron-core instead spreads it over the `V - 1` other ids,
counted per partition).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.fusions.fused_cross_entropy import IGNORE_INDEX
from megatron.core.tensor_parallel.utils import (
    VocabUtility,
    get_tensor_model_parallel_group_if_none,
    group_rank,
    group_size,
)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp) -> None:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        partition_vocab = logits.shape[-1]
        vocab = partition_vocab * group_size(group)
        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab, group_rank(group), group_size(group)
        )
        # Shifting by the global maximum keeps exp() finite and the reductions exact in fp32.
        logits_max = logits.detach().amax(dim=-1).float()
        _all_reduce(logits_max, group, dist.ReduceOp.MAX)
        shifted = logits.float() - logits_max.unsqueeze(-1)

        ignored = target == IGNORE_INDEX
        outside = (target < first) | (target >= last)
        local_target = (target - first).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        exp = shifted.exp()
        # One all-reduce for every per-token sum.
        sums = [target_logit.masked_fill(outside, 0.0), exp.sum(dim=-1)]
        if label_smoothing > 0.0:
            sums.append(shifted.sum(dim=-1))
        sums = torch.stack(sums)
        _all_reduce(sums, group, dist.ReduceOp.SUM)
        log_sum_exp = sums[1].log()
        loss = log_sum_exp - sums[0]
        if label_smoothing > 0.0:
            uniform_loss = log_sum_exp - sums[2] / vocab
            loss = (1.0 - label_smoothing) * loss + label_smoothing * uniform_loss
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sums[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        ctx.label_smoothing = label_smoothing
        ctx.vocab = vocab
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, outside, ignored = ctx.saved_tensors
        smoothing = ctx.label_smoothing
        grad = softmax - smoothing / ctx.vocab if smoothing > 0.0 else softmax.clone()
        on_target = (~outside).to(grad.dtype).unsqueeze(-1) * (1.0 - smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -on_target)
        scale = grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1)
        return (grad * scale).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split over tp along the vocabulary.

    Args:
        vocab_parallel_logits: [..., V/T] this rank's part of the logits (any float dtype).
        target: [...] token ids of the whole vocabulary; `-100` gives loss 0 and no gradient.
        label_smoothing: In [0, 1): probability mass spread uniformly over the vocabulary.
        tp_group: The tp group the vocabulary is split over; None resolves to parallel_state's
            when initialised, else no split (T = 1).

    Returns:
        fp32 losses of shape `target.shape`, identical on every tp rank.

    Raises:
        ValueError: shapes that do not match or `label_smoothing` outside [0, 1).
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            "vocab_parallel_cross_entropy takes logits [..., V/T] and target [...] with the same "
            f"leading shape, got {tuple(vocab_parallel_logits.shape)} and {tuple(target.shape)}."
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}.")
    group = get_tensor_model_parallel_group_if_none(tp_group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group)
