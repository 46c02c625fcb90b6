"""Model FLOPs of a GPT training step, for TFLOP/s reporting.

Counts matrix multiplications only (norms, softmax and element-wise work are negligible), with
Megatron-LM's conventions: backward costs twice the forward, and attention scores are counted for
the full (not causally halved) sequence, so numbers compare with Megatron-LM's logs. An MoE layer
counts the work each token does, as Megatron-LM's `num_floating_point_operations`: its
`--moe-router-topk` experts of width `--moe-ffn-hidden-size` and the shared experts; like
Megatron-LM's, the router's small GEMM (hidden x experts per token) is left out.
"""

from __future__ import annotations

from megatron.core.transformer.moe.moe_config import moe_layer_pattern
from megatron.core.transformer.transformer_config import TransformerConfig


def num_floating_point_operations(
    config: TransformerConfig, vocab_size: int, seq_length: int, batch_size: int
) -> float:
    """FLOPs of forward + backward for `batch_size` sequences of `seq_length` tokens."""
    hidden = config.hidden_size
    query_width = config.num_attention_heads * config.kv_channels
    kv_width = config.num_query_groups * config.kv_channels
    # Weights per unit of MLP width: fc1 ([x W | x V] when gated) and fc2.
    mlp_weights_per_width = hidden * (3 if config.gated_linear_unit else 2)
    attention_weights = (
        hidden * (query_width + 2 * kv_width)  # fused QKV projection
        + query_width * hidden  # output projection
    )
    num_moe_layers = sum(moe_layer_pattern(config))
    num_dense_layers = config.num_layers - num_moe_layers
    active_moe_width = 0
    if num_moe_layers:
        active_moe_width = config.moe_router_topk * config.moe_ffn_hidden_size + (
            config.moe_shared_expert_intermediate_size or 0
        )
    matmul_weights = (
        config.num_layers * attention_weights
        + num_dense_layers * config.ffn_hidden_size * mlp_weights_per_width
        + num_moe_layers * active_moe_width * mlp_weights_per_width
        + hidden * vocab_size  # logits
    )
    # Scores (QK^T) and context (AV): 2 GEMMs of 2 * seq * query_width FLOPs per token.
    attention_per_token = config.num_layers * 4 * seq_length * query_width
    forward_per_token = 2 * matmul_weights + attention_per_token
    return 3.0 * forward_per_token * seq_length * batch_size
