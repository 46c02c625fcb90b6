"""Core attention: softmax(q k^T * scale) v over causal (or explicitly masked) positions, the
scale 1 / sqrt(d) unless `config.softmax_scale` sets it.

`config.attention_backend` picks the kernel: `torch.nn.functional.scaled_dot_product_attention`
with the backend SDPA chooses (`auto`) or the one named (`flash`, `fused` = cuDNN, `unfused` =
math), or the explicit `local` implementation, which materialises the [s, s] scores and honours
`attention_softmax_in_fp32` and `apply_query_key_layer_scaling` as Megatron-core's local
attention does.

A layer with a sliding window (`config.window_size`, on the layers `window_attn_skip_freq`
picks: `attention_window`) or softmax sinks (`config.softmax_type`: `softmax_sinks`) runs
FlexAttention on CUDA under the `auto` backend: block-sparse, skipping the blocks outside the
window, with the sinks applied through its log-sum-exp (`flex_attention`). The `local` backend,
and where FlexAttention does not apply (the CPU, which lacks its backward; heads narrower than
16), computes them from dense scores, as Megatron-core's unfused attention. A learnable sink is
the parameter `softmax_offset`, one logit per head (this rank's heads under tensor
parallelism), initialised with `init_method`.

With context parallelism (`config.context_parallel_size` > 1) each rank holds two chunks of
every sequence (`megatron.core.context_parallel.sequence_split`) and attention runs across the
context-parallel group as `config.cp_comm_type` says: ring attention (`p2p`) or all-gathered keys
and values (`allgather`) on block kernels of their own, or all-to-all (`a2a`) around the
attention described above, which then sees whole sequences of a share of the heads.

Under tensor parallelism each rank attends over its own heads, so attention dropout must draw a
different mask on each rank: it runs in the RNG tracker's tensor-parallel state, as in
Megatron-core (under sequence parallelism the whole decoder already runs in that state). At
tensor-parallel size 1 it draws from the default generator, so the tracker need not be seeded.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.context_parallel import (
    BlockAttention,
    CPCommType,
    Ring,
    all_gather_attention,
    all_to_all_attention,
    resolve_cp_group,
    ring_attention,
    select_block_kernel,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layout import TensorParallelLayout, shard_tensor
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel.utils import divide, group_rank, group_size
from megatron.core.transformer.attention_window import causal_window_mask, layer_window
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.flex_attention import (
    flex_attention_applies,
    flex_attention_with_sinks,
    window_block_mask,
)
from megatron.core.transformer.module import MegatronModule, resolve_tp_group
from megatron.core.transformer.softmax_sinks import softmax_with_sink
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import outside_compiled_graphs

SDPA_BACKENDS: dict[AttnBackend, SDPBackend] = {
    AttnBackend.flash: SDPBackend.FLASH_ATTENTION,
    AttnBackend.fused: SDPBackend.CUDNN_ATTENTION,
    AttnBackend.unfused: SDPBackend.MATH,
}
"""The SDPA kernel each named backend pins (`auto` pins none; `local` does not use SDPA)."""


MASKED_SCORE = -10000.0
"""The `local` backend's score at masked-out positions (Megatron-core's)."""

SINK_LAYOUT = TensorParallelLayout(partition_dim=0)
"""The learnable sinks are split over tp by head, as the query heads are."""


class DotProductAttention(MegatronModule):
    """Multi-head / grouped-query attention over [s, b, n, d] queries, keys and values.

    With grouped-query attention each key/value head serves `num_attention_heads /
    num_query_groups` consecutive query heads (Megatron's grouping). The key/value heads are
    expanded to one per query head with a broadcast view and one copy, so SDPA sees plain
    multi-head attention and can use the flash kernel. A layer with a sliding window or sinks
    takes FlexAttention or dense scores instead (see the module's description).

    Args:
        config: The transformer configuration.
        layer_number: 1-based index of the layer this attention belongs to (it decides whether
            the layer has the sliding window).
        attention_dropout: Dropout on the attention probabilities; None means
            `config.attention_dropout`.
        softmax_scale: The scores' scale; None means `config.softmax_scale` (multi-latent
            attention passes its own, as upstream's layers do).
        pg_collection: Process groups; its `tp` splits the heads, and with them the learnable
            sinks (see `resolve_tp_group`); its `cp` (else parallel_state's) is the
            context-parallel group.

    Raises:
        ValueError: The context-parallel group's size is not `config.context_parallel_size`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int = 1,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config)
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
        # None: 1 / sqrt(head width), SDPA's default.
        self.softmax_scale = config.softmax_scale if softmax_scale is None else softmax_scale
        self.fork_tensor_parallel_rng = (
            config.tensor_model_parallel_size > 1 and not config.sequence_parallel
        )
        self.window = layer_window(config, layer_number)
        # FlexAttention's (or dense scores') work: SDPA has neither windows nor sinks.
        self.windows_or_sinks = self.window is not None or config.softmax_type != "vanilla"
        self.tp_group = resolve_tp_group(pg_collection)
        self.num_attention_heads_per_partition = divide(
            config.num_attention_heads, group_size(self.tp_group)
        )
        self.cp_group, self.cp_comm_type, self.ring = _context_parallel(config, pg_collection)
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(
                torch.empty(self.num_attention_heads_per_partition, dtype=config.params_dtype)
            )
        else:
            self.register_parameter("softmax_offset", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The learnable sinks: this rank's heads of `init_method` applied to all heads' (so
        that the same seed gives the same sinks at any tensor-parallel size)."""
        if self.softmax_offset is None:
            return
        with torch.no_grad():
            full = torch.empty(
                self.config.num_attention_heads,
                dtype=self.softmax_offset.dtype,
                device=self.softmax_offset.device,
            )
            self.config.init_method(full)
            part = shard_tensor(
                full, SINK_LAYOUT, group_rank(self.tp_group), group_size(self.tp_group)
            )
            self.softmax_offset.copy_(part)

    def tensor_parallel_layouts(self) -> dict[str, TensorParallelLayout]:
        """The learnable sinks are split over tp by head."""
        if self.softmax_offset is None:
            return {}
        return {"softmax_offset": SINK_LAYOUT}

    def _sinks(self, query: torch.Tensor) -> torch.Tensor | None:
        """This rank's sink logits ([n]), or None for the plain softmax."""
        if self.config.softmax_type == "vanilla":
            return None
        if self.softmax_offset is not None:
            return self.softmax_offset
        return query.new_zeros(query.shape[2])  # off-by-one: a fixed logit 0

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
                parallelism); with context parallelism s is this rank's two chunks.
            key: [s, b, g, d]: this rank's key heads (g divides n).
            value: [s, b, g, dv]: dv may differ from d (multi-latent attention).
            attention_mask: None for causal attention. Otherwise a boolean mask broadcastable to
                [b, num_attention_heads, s, s] where True means "masked out" (Megatron's
                convention); it replaces the causal mask, so it must include causality. Not
                with context parallelism.

        Returns:
            Context of shape [s, b, n * dv].
        """
        if self.cp_comm_type is not None:
            return self._context_parallel_attention(query, key, value, attention_mask)
        return self._attend(query, key, value, attention_mask, self._sinks(query))

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention over whole sequences ([s, b, n, d] queries, `forward`'s layout), with the
        sink logits of these heads."""
        seq_len, batch, num_heads, head_dim = query.shape
        dropout_p = self.attention_dropout if self.training else 0.0
        flex = (
            self.windows_or_sinks
            and not self.local_attention
            and flex_attention_applies(query.device, head_dim)
        )
        if flex and dropout_p > 0:
            raise ValueError(
                f"attention_dropout={dropout_p}: FlexAttention, which computes sliding windows "
                "and softmax sinks on CUDA, has no attention dropout; set attention_dropout=0 "
                "(--attention-dropout 0, as gpt-oss trains) or use the dense scores of "
                "attention_backend=local."
            )
        groups = key.shape[2]
        if groups != num_heads and not flex:
            repeats = num_heads // groups
            # Query head h reads key/value head h // repeats: expand a new axis after the group
            # axis (a view), then fold it into the head axis (one copy).
            key = key.unsqueeze(3).expand(seq_len, batch, groups, repeats, head_dim)
            key = key.reshape(seq_len, batch, num_heads, head_dim)
            value = value.unsqueeze(3).expand(*value.shape[:3], repeats, value.shape[-1])
            value = value.reshape(seq_len, batch, num_heads, -1)

        # [s, b, n, d] -> [b, n, s, d] as views: SDPA only needs the last dimension contiguous.
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        rng_context = (
            get_cuda_rng_tracker().fork()
            if dropout_p > 0 and self.fork_tensor_parallel_rng
            else contextlib.nullcontext()
        )
        with rng_context:
            if flex:
                block_mask = window_block_mask(seq_len, self.window, query.device, attention_mask)
                context = flex_attention_with_sinks(
                    query, key, value, block_mask, self.softmax_scale, sinks
                )
            elif self.local_attention or self.windows_or_sinks:
                context = self._local_attention(query, key, value, attention_mask, dropout_p, sinks)
            elif self.sdpa_backend is None:
                context = self._sdpa(query, key, value, attention_mask, dropout_p)
            else:
                with sdpa_kernel(self.sdpa_backend):
                    context = self._sdpa(query, key, value, attention_mask, dropout_p)
        # [b, n, s, dv] -> [s, b, n * dv]
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)

    @outside_compiled_graphs
    def _context_parallel_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """`forward` of this rank's chunks of the sequences, across the cp group."""
        if attention_mask is not None:
            raise ValueError(
                "context-parallel attention computes the causal mask itself and takes no "
                "attention_mask; drop --reset-attention-mask (or --context-parallel-size)."
            )
        if self.cp_comm_type is CPCommType.a2a:
            sinks = self._sinks(query)

            def attend(q, k, v, heads):
                return self._attend(q, k, v, None, None if sinks is None else sinks[heads])

            return all_to_all_attention(query, key, value, attend, self.cp_group)
        seq_len, batch = query.shape[:2]
        backend = self.config.attention_backend
        kernel = select_block_kernel(
            query.device,
            query.dtype,
            max(query.shape[-1], value.shape[-1]),
            explicit_scores=backend in (AttnBackend.local, AttnBackend.unfused),
            flash_only=backend == AttnBackend.flash,
        )
        block = BlockAttention(kernel, self.softmax_scale)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.cp_comm_type is CPCommType.p2p:
            context = ring_attention(query, key, value, block, self.ring)
        else:
            context = all_gather_attention(query, key, value, block, self.cp_group)
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)

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
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Unfused attention over [b, n, s, d]: scores in the input dtype, softmax in fp32 when
        `attention_softmax_in_fp32` (or `apply_query_key_layer_scaling`, which needs it); the
        layer's window narrows the mask, and `sinks` ([n] logits) join the softmax's
        denominator."""
        coeff = self.softmax_scale_coeff
        scale = self.softmax_scale or 1.0 / math.sqrt(query.shape[-1])
        scores = torch.matmul(query, key.transpose(-2, -1)) * (scale / coeff)
        if attention_mask is None or self.window is not None:
            window_mask = causal_window_mask(scores.shape[-1], self.window, scores.device)
            attention_mask = window_mask if attention_mask is None else attention_mask | window_mask
        if self.softmax_in_fp32:
            scores = scores.float()
        if coeff != 1.0:
            scores = scores * coeff
        # Megatron-core's fill (`attention_mask_func`): a row masked entirely (a padded query)
        # then attends evenly instead of turning NaN, which would spread through the layers.
        scores = scores.masked_fill(attention_mask, MASKED_SCORE)
        probs = torch.softmax(scores, dim=-1) if sinks is None else softmax_with_sink(scores, sinks)
        probs = probs.to(query.dtype)
        if dropout_p > 0:
            probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs, value)


def _context_parallel(
    config: TransformerConfig, pg_collection: ProcessGroupCollection | None
) -> tuple[dist.ProcessGroup | None, CPCommType | None, Ring | None]:
    """The cp group, the comm type (None without context parallelism) and, for `p2p`, the
    ring of an attention layer.

    Raises:
        ValueError: The cp group's size is not `config.context_parallel_size`.
    """
    cp_group = resolve_cp_group(None if pg_collection is None else pg_collection.cp)
    cp_size = group_size(cp_group)
    if cp_size != config.context_parallel_size:
        raise ValueError(
            f"config.context_parallel_size ({config.context_parallel_size}) differs from the "
            f"size of the context-parallel group ({cp_size}); initialise parallel_state (or "
            "pass a pg_collection with cp) with the same context_parallel_size."
        )
    if cp_size == 1:
        return cp_group, None, None
    comm_type = CPCommType.parse(config.cp_comm_type)
    return cp_group, comm_type, Ring(cp_group) if comm_type is CPCommType.p2p else None
