"""Cross-entropy over a large vocabulary without fp32 copies of all the logits.

`torch.nn.functional.cross_entropy(logits.float(), ...)` keeps, for every token, an fp32 copy of
the logits, the fp32 log-probabilities it saves for backward, and in backward an fp32 gradient
before casting it to the logits' dtype: with bf16 logits, five times their size. Megatron-LM's
`--cross-entropy-loss-fusion` computes the loss in one fused kernel instead. `fused_cross_entropy`
gets the same result by working through the tokens in chunks: each chunk's logits are upcast,
reduced to the loss (forward) or turned into the gradient (backward) and dropped, so the
whole-vocabulary fp32 tensors exist for one chunk at a time. Backward saves the logits in their
own dtype (the one whole-vocabulary tensor kept: half the size of the fp32 log-probabilities the
unfused loss saves, for bf16 logits), the targets and one fp32 log-sum-exp per token.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
"""Targets equal to it get loss 0 and no gradient (`torch.nn.functional.cross_entropy`'s)."""

DEFAULT_CHUNK_ELEMENTS = 2**24
"""Logits upcast per chunk (64 MiB in fp32, about 500 tokens of a 32k vocabulary): large enough
that the per-chunk kernel launches are few (8 chunks for 2 x 2048 tokens of 32000), small next
to the whole batch's fp32 logits (512 MiB there)."""


def fused_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> torch.Tensor:
    """Per-token cross-entropy, computed in fp32 one chunk of tokens at a time.

    Equal to `F.cross_entropy(logits.float(), target, reduction="none")`, gradient included (to
    fp32 rounding), whatever the dtype of `logits`.

    Args:
        logits: [tokens, vocab], any floating dtype.
        target: [tokens] class ids; `IGNORE_INDEX` gives loss 0 and a zero gradient row.
        chunk_elements: Logits upcast at a time (rounded to whole tokens, at least one).

    Returns:
        fp32 losses, [tokens].
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"fused_cross_entropy takes logits [tokens, vocab] and target [tokens], got "
            f"{tuple(logits.shape)} and {tuple(target.shape)}."
        )
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}.")
    return _ChunkedCrossEntropy.apply(logits, target, chunk_elements)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        target: torch.Tensor,
        chunk_elements: int,
    ) -> torch.Tensor:
        tokens, vocab = logits.shape
        ignored = target == IGNORE_INDEX
        safe_target = target.masked_fill(ignored, 0)
        logsumexp = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        losses = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        step = max(1, chunk_elements // vocab)  # tokens per chunk
        for start in range(0, tokens, step):
            end = start + step
            chunk = logits[start:end].float()
            torch.logsumexp(chunk, dim=-1, out=logsumexp[start:end])
            picked = chunk.gather(-1, safe_target[start:end, None]).squeeze(-1)
            torch.sub(logsumexp[start:end], picked, out=losses[start:end])
        losses.masked_fill_(ignored, 0.0)
        ctx.save_for_backward(logits, safe_target, ignored, logsumexp)
        ctx.step = step
        return losses

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_losses: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        logits, safe_target, ignored, logsumexp = ctx.saved_tensors
        step = ctx.step
        # d loss_i / d logit_ij = softmax_ij - [j == target_i], times the loss's gradient.
        scale = grad_losses.float().masked_fill(ignored, 0.0)
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], step):
            end = start + step
            chunk = torch.exp(logits[start:end].float() - logsumexp[start:end, None])
            rows = torch.arange(chunk.shape[0], device=chunk.device)
            chunk[rows, safe_target[start:end]] -= 1.0
            chunk *= scale[start:end, None]
            grad[start:end] = chunk
        return grad, None, None
