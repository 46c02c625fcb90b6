"""Model FLOPs of a GPT training step, for TFLOP/s reporting.

Counts matrix multiplications only (norms, softmax and element-wise work are negligible), with
Megatron-LM's conventions: backward costs twice the forward, and attention scores are counted for
the full (not causally halved) sequence, in layers with a sliding window too (`--window-size`),
so numbers compare with Megatron-LM's logs. An MoE layer
counts the work each token does, as Megatron-LM's `num_floating_point_operations`: its
`--moe-router-topk` experts of width `--moe-ffn-hidden-size` and the shared experts; like
Megatron-LM's, the router's small GEMM (hidden x experts per token) is left out. Multi-latent
attention counts its down- and up-projections, and scores over `qk_head_dim + qk_pos_emb_head_dim`
channels per head and a context over `v_head_dim`. Multi-token prediction depths count as
Megatron-LM counts them: each one transformer layer like the decoder's last (dense or MoE), its
projection `eh_proj` (2h x h) plus 3h for its norms, and one more set of logits.
"""

from __future__ import annotations

from megatron.core.transformer.moe.moe_config import moe_layer_pattern
from megatron.core.transformer.transformer_config import TransformerConfig


def num_floating_point_operations(
    config: TransformerConfig, vocab_size: int, seq_length: int, batch_size: int
) -> float:
    """FLOPs of forward + backward for `batch_size` sequences of `seq_length` tokens."""
    hidden = config.hidden_size
    attention_weights, query_width, value_width = _attention_sizes(config)
    # Weights per unit of MLP width: fc1 ([x W | x V] when gated) and fc2.
    mlp_weights_per_width = hidden * (3 if config.gated_linear_unit else 2)
    pattern = moe_layer_pattern(config)
    depths = config.mtp_num_layers or 0
    # Each depth's layer is of the decoder's last layer's spec.
    num_moe_layers = sum(pattern) + depths * pattern[-1]
    num_layers = config.num_layers + depths
    num_dense_layers = num_layers - num_moe_layers
    active_moe_width = 0
    if num_moe_layers:
        active_moe_width = config.moe_router_topk * config.moe_ffn_hidden_size + (
            config.moe_shared_expert_intermediate_size or 0
        )
    matmul_weights = (
        num_layers * attention_weights
        + num_dense_layers * config.ffn_hidden_size * mlp_weights_per_width
        + num_moe_layers * active_moe_width * mlp_weights_per_width
        + depths * (2 * hidden * hidden + 3 * hidden)  # eh_proj, and Megatron-LM's norm term
        + (1 + depths) * hidden * vocab_size  # logits
    )
    # Scores (QK^T) and context (AV): 2 * seq FLOPs per token and channel of each.
    attention_per_token = num_layers * 2 * seq_length * (query_width + value_width)
    forward_per_token = 2 * matmul_weights + attention_per_token
    return 3.0 * forward_per_token * seq_length * batch_size


def _attention_sizes(config: TransformerConfig) -> tuple[int, int, int]:
    """An attention layer's projection weights, and the query and value widths of all heads."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    if not config.multi_latent_attention:
        query_width = heads * config.kv_channels
        kv_width = config.num_query_groups * config.kv_channels
        weights = hidden * (query_width + 2 * kv_width) + query_width * hidden  # QKV, output
        return weights, query_width, query_width
    query_width = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    value_width = heads * config.v_head_dim
    if config.q_lora_rank is None:
        query_weights = hidden * query_width
    else:
        query_weights = config.q_lora_rank * (hidden + query_width)  # down, up
    kv_weights = hidden * (config.kv_lora_rank + config.qk_pos_emb_head_dim) + (
        config.kv_lora_rank * heads * (config.qk_head_dim + config.v_head_dim)
    )  # down (with the rotated key), up
    return query_weights + kv_weights + value_width * hidden, query_width, value_width
