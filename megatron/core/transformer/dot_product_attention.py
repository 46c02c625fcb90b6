"""Core attention: softmax(q k^T * scale) v over causal (or explicitly masked) positions, the
scale 1 / sqrt(d) unless `config.softmax_scale` sets it.

`config.attention_backend` picks the kernel: `torch.nn.functional.scaled_dot_product_attention`
with the backend SDPA chooses (`auto`) or the one named (`flash`, `fused` = cuDNN, `unfused` =
math), or the explicit `local` implementation, which materialises the [s, s] scores and honours
`attention_softmax_in_fp32` and `apply_query_key_layer_scaling` as Megatron-core's local
attention does.

Under tensor parallelism each rank attends over its own heads, so attention dropout must draw a
different mask on each rank: it runs in the RNG tracker's tensor-parallel state, as in
Megatron-core (under sequence parallelism the whole decoder already runs in that state). At
tensor-parallel size 1 it draws from the default generator, so the tracker need not be seeded.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

SDPA_BACKENDS: dict[AttnBackend, SDPBackend] = {
    AttnBackend.flash: SDPBackend.FLASH_ATTENTION,
    AttnBackend.fused: SDPBackend.CUDNN_ATTENTION,
    AttnBackend.unfused: SDPBackend.MATH,
}
"""The SDPA kernel each named backend pins (`auto` pins none; `local` does not use SDPA)."""


MASKED_SCORE = -10000.0
"""The `local` backend's score at masked-out positions (Megatron-core's)."""


class DotProductAttention(MegatronModule):
    """Multi-head / grouped-query attention over [s, b, n, d] queries, keys and values.

    With grouped-query attention each key/value head serves `num_attention_heads /
    num_query_groups` consecutive query heads (Megatron's grouping). The key/value heads are
    expanded to one per query head with a broadcast view and one copy, so SDPA sees plain
    multi-head attention and can use the flash kernel.

    Args:
        config: The transformer configuration.
        layer_number: 1-based index of the layer this attention belongs to.
        attention_dropout: Dropout on the attention probabilities; None means
            `config.attention_dropout`.

    Raises:
        ValueError: `config.context_parallel_size > 1` (this attention sees the whole sequence
            and would silently ignore the other ranks' part of it).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int = 1,
        attention_dropout: float | None = None,
    ):
        super().__init__(config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size} is not supported by "
                "DotProductAttention yet; set context_parallel_size=1 in the model config."
            )
        self.layer_number = layer_number
        self.attention_dropout = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.sdpa_backend = SDPA_BACKENDS.get(config.attention_backend)
        # The `local` backend's options, resolved once. Query-key layer scaling divides the
        # scores by the layer number before the softmax and multiplies it back in fp32, keeping
        # fp16 scores of deep layers in range (the config then asks for the fp32 softmax).
        self.local_attention = config.attention_backend == AttnBackend.local
        self.softmax_scale_coeff = (
            float(layer_number) if config.apply_query_key_layer_scaling else 1.0
        )
        self.softmax_in_fp32 = config.attention_softmax_in_fp32
        self.softmax_scale = config.softmax_scale  # None: 1 / sqrt(head width), SDPA's default
        self.fork_tensor_parallel_rng = (
            config.tensor_model_parallel_size > 1 and not config.sequence_parallel
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attends each query position to the key positions it may see.

        Args:
            query: [s, b, n, d]: this rank's query heads (all of them without tensor
                parallelism).
            key: [s, b, g, d]: this rank's key heads (g divides n).
            value: [s, b, g, d].
            attention_mask: None for causal attention. Otherwise a boolean mask broadcastable to
                [b, num_attention_heads, s, s] where True means "masked out" (Megatron's
                convention); it replaces the causal mask, so it must include causality.

        Returns:
            Context of shape [s, b, n * d].
        """
        seq_len, batch, num_heads, head_dim = query.shape
        groups = key.shape[2]
        if groups != num_heads:
            repeats = num_heads // groups
            # Query head h reads key/value head h // repeats: expand a new axis after the group
            # axis (a view), then fold it into the head axis (one copy).
            key = key.unsqueeze(3).expand(seq_len, batch, groups, repeats, head_dim)
            key = key.reshape(seq_len, batch, num_heads, head_dim)
            value = value.unsqueeze(3).expand(seq_len, batch, groups, repeats, head_dim)
            value = value.reshape(seq_len, batch, num_heads, head_dim)

        # [s, b, n, d] -> [b, n, s, d] as views: SDPA only needs the last dimension contiguous.
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.attention_dropout if self.training else 0.0
        rng_context = (
            get_cuda_rng_tracker().fork()
            if dropout_p > 0 and self.fork_tensor_parallel_rng
            else contextlib.nullcontext()
        )
        with rng_context:
            if self.local_attention:
                context = self._local_attention(query, key, value, attention_mask, dropout_p)
            elif self.sdpa_backend is None:
                context = self._sdpa(query, key, value, attention_mask, dropout_p)
            else:
                with sdpa_kernel(self.sdpa_backend):
                    context = self._sdpa(query, key, value, attention_mask, dropout_p)
        # [b, n, s, d] -> [s, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, num_heads * head_dim)

    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout_p: float,
    ) -> torch.Tensor:
        if attention_mask is None:
            return F.scaled_dot_product_attention(
                query, key, value, dropout_p=dropout_p, is_causal=True, scale=self.softmax_scale
            )
        # SDPA's boolean mask marks the positions that take part, Megatron's the opposite.
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=~attention_mask,
            dropout_p=dropout_p,
            scale=self.softmax_scale,
        )

    def _local_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout_p: float,
    ) -> torch.Tensor:
        """Unfused attention over [b, n, s, d]: scores in the input dtype, softmax in fp32 when
        `attention_softmax_in_fp32` (or `apply_query_key_layer_scaling`, which needs it)."""
        coeff = self.softmax_scale_coeff
        scale = self.softmax_scale or 1.0 / math.sqrt(query.shape[-1])
        scores = torch.matmul(query, key.transpose(-2, -1)) * (scale / coeff)
        if attention_mask is None:
            seq_q, seq_k = scores.shape[-2:]
            attention_mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=scores.device)
            attention_mask = attention_mask.triu(1)
        if self.softmax_in_fp32:
            scores = scores.float()
        if coeff != 1.0:
            scores = scores * coeff
        # Megatron-core's fill (`attention_mask_func`): a row masked entirely (a padded query)
        # then attends evenly instead of turning NaN, which would spread through the layers.
        scores = scores.masked_fill(attention_mask, MASKED_SCORE)
        probs = torch.softmax(scores, dim=-1).to(query.dtype)
        if dropout_p > 0:
            probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs, value)
