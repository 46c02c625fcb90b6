"""Attention sinks: a softmax whose denominator holds one more logit per head.

Megatron-core's `softmax_type` (Evan Miller's "attention is off by one"; gpt-oss's sinks):

- "vanilla": the plain softmax over the visible keys.
- "off-by-one": a fixed logit 0 joins the denominator, `p_j = e^{s_j} / (1 + sum_k e^{s_k})`, so
  a head may attend to nothing.
- "learnable": the logit is a parameter `sink_h` per head (the core attention's
  `softmax_offset`), `p_j = e^{s_j} / (e^{sink_h} + sum_k e^{s_k})`.

The sink is a logit without a value: the probabilities sum to less than one and the output is
their weighted sum of the values as before. `softmax_with_sink` computes the probabilities from
dense scores (as upstream's unfused path: the sink appended as one more column); a kernel that
returns the log-sum-exp `L` of a row's scores instead corrects its plain-softmax output
with `rescale_by_sink`, since `sum_k e^{s_k} = e^L` makes every `p_j` the plain one times
`e^L / (e^L + e^{sink}) = sigmoid(L - sink)` (upstream's inference correction). Both are exact,
and autograd carries the sink's gradient through them.
"""

from __future__ import annotations

import torch

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
"""Megatron-core's `softmax_type` values, all built."""


def softmax_with_sink(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax of `scores` over the last dimension with one more logit in the denominator.

    Args:
        scores: [b, n, s_q, s_k] attention scores (masked positions already filled).
        sinks: [n] one logit per head.

    Returns:
        [b, n, s_q, s_k] probabilities in `scores`' dtype (each row sums to less than one).
    """
    batch, heads, queries, _ = scores.shape
    sink = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(batch, heads, queries, 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def rescale_by_sink(
    output: torch.Tensor, logsumexp: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """Turns plain-softmax attention output into the output with a sink.

    Args:
        output: [b, n, s_q, d], attention output with the plain softmax.
        logsumexp: [b, n, s_q], the natural-log log-sum-exp of each row's (scaled, masked)
            scores.
        sinks: [n] one logit per head.

    Returns:
        `output * sigmoid(logsumexp - sink)` in `output`'s dtype, computed in fp32.
    """
    weight = torch.sigmoid(logsumexp.float() - sinks.float().view(1, -1, 1))
    return (output.float() * weight.unsqueeze(-1)).to(output.dtype)
