"""Model FLOPs of a GPT training step, for TFLOP/s reporting.

Counts matrix multiplications only (norms, softmax and element-wise work are negligible), with
Megatron-LM's conventions: backward costs twice the forward, and attention scores are counted for
the full (not causally halved) sequence, so numbers compare with Megatron-LM's logs.
"""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig


def num_floating_point_operations(
    config: TransformerConfig, vocab_size: int, seq_length: int, batch_size: int
) -> float:
    """FLOPs of forward + backward for `batch_size` sequences of `seq_length` tokens."""
    hidden = config.hidden_size
    query_width = config.num_attention_heads * config.kv_channels
    kv_width = config.num_query_groups * config.kv_channels
    fc1_width = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    layer_weights = (
        hidden * (query_width + 2 * kv_width)  # fused QKV projection
        + query_width * hidden  # output projection
        + hidden * fc1_width
        + config.ffn_hidden_size * hidden
    )
    matmul_weights = config.num_layers * layer_weights + hidden * vocab_size  # + logits
    # Scores (QK^T) and context (AV): 2 GEMMs of 2 * seq * query_width FLOPs per token.
    attention_per_token = config.num_layers * 4 * seq_length * query_width
    forward_per_token = 2 * matmul_weights + attention_per_token
    return 3.0 * forward_per_token * seq_length * batch_size
