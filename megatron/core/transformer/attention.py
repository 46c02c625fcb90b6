"""Self-attention: fused QKV projection, rotary embeddings, core attention, output projection;
and `Attention`, the part it shares with multi-latent attention (`multi_latent_attention.py`):
the core attention over this rank's heads and the output projection.

The QKV projection uses Megatron-LM's grouped layout, so checkpoints and Transformer Engine
modules line up with Megatron's: per token the projection output is `num_query_groups` blocks,
each holding that group's query heads followed by its one key head and one value head,
`[ng, (nh / ng + 2) * d]`.

With tensor parallelism over T ranks the QKV projection is column-parallel: the grouped layout
splits by query group, so each rank holds `ng / T` whole groups (their `nh / T` query heads and
`ng / T` key and value heads) and attends over them alone; the output projection is
row-parallel and sums the ranks' parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import rotate_query_and_key
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.tensor_parallel.utils import divide, group_size
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule, resolve_tp_group
from megatron.core.transformer.recompute import recompute
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import L2Norm
from megatron.core.transformer.transformer_config import (
    TransformerConfig,
    recomputes,
    yarn_concentration_factor,
)


@dataclass
class SelfAttentionSubmodules:
    """Specs of the three parts of `SelfAttention`.

    Attributes:
        linear_qkv: Input projection to queries, keys and values (may fuse the input norm).
        core_attention: The attention itself (e.g. `DotProductAttention`).
        linear_proj: Output projection back to the hidden size.
        q_layernorm: Norm of each query head, built when `config.qk_layernorm` (`L2Norm` in
            its place with `config.qk_l2_norm`).
        k_layernorm: Norm of each key head, likewise.
    """

    linear_qkv: ModuleSpec | type | None = None
    core_attention: ModuleSpec | type | None = None
    linear_proj: ModuleSpec | type | None = None
    q_layernorm: ModuleSpec | type | None = None
    k_layernorm: ModuleSpec | type | None = None


class Attention(MegatronModule):
    """What the attention layers share: heads split over the tensor-parallel group, the core
    attention over this rank's heads, the row-parallel output projection, and running the two
    (`_attend_and_project`, with `config.recompute_modules` "core_attn").

    A subclass builds its input projections first and then `_build_output`, so that the weights
    are drawn from the generator in the order of the layer's computation.

    Args:
        config: The transformer configuration.
        layer_number: 1-based index of the layer this attention belongs to.
        pg_collection: Process groups; its `tp` splits the heads (see `resolve_tp_group`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int = 1,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config)
        self.layer_number = layer_number
        self.tp_group = resolve_tp_group(pg_collection)
        self.num_attention_heads_per_partition = divide(
            config.num_attention_heads, group_size(self.tp_group)
        )
        # Decided once, not in every layer's forward.
        self.recompute_core_attention = recomputes(config, "core_attn")

    @property
    def adds_residual(self) -> bool:
        """Whether `forward(..., residual=)` takes the layer's residual connection (the
        classes whose `forward` passes it to the output projection say so)."""
        return False

    def _projection_adds_residual(self) -> bool:
        """Whether the output projection adds a residual (`RowParallelLinear.forward`), in its
        GEMM where it can."""
        proj = self.linear_proj
        return isinstance(proj, RowParallelLinear) and not proj.skip_bias_add

    def _build_output(
        self,
        core_attention: ModuleSpec | type,
        linear_proj: ModuleSpec | type,
        context_size: int,
        pg_collection: ProcessGroupCollection | None,
        softmax_scale: float | None = None,
    ) -> None:
        """Builds `core_attention` and `linear_proj`, which projects the context of all heads
        (`context_size` wide over all tp ranks) back to the hidden size.

        Args:
            core_attention: Spec of the core attention.
            linear_proj: Spec of the output projection.
            context_size: Width of the attention's context, all heads.
            pg_collection: Process groups, passed on to the core attention (its `tp` splits
                the learnable softmax sinks with the heads).
            softmax_scale: The core attention's scale, when the layer sets it (None: the core
                attention's default).
        """
        config = self.config
        scale = {} if softmax_scale is None else {"softmax_scale": softmax_scale}
        self.core_attention = build_module(
            core_attention,
            config=config,
            layer_number=self.layer_number,
            pg_collection=pg_collection,
            **scale,
        )
        # The linear adds its own bias, as `MLP.linear_fc2` does (see there).
        self.linear_proj = build_module(
            linear_proj,
            context_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=self.tp_group,
        )

    def _attend_and_project(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The core attention of this rank's heads, then the output projection (plus
        `residual`, where given: `adds_residual`): `(output, None)`, output [s, b, h] (under
        sequence parallelism [s/T, b, h])."""
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            # Recompute the attention in backward instead of storing its activations; the RNG
            # states are replayed, so attention dropout draws the same mask again.
            context = recompute(self._context, query, key, value, attention_mask)
        else:
            context = self._context(query, key, value, attention_mask)
        return self._project(context, residual)

    def _project(
        self, context: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`linear_proj(context)`, plus `residual` where given (`adds_residual`)."""
        if residual is None:
            return self.linear_proj(context)
        return self.linear_proj(context, residual=residual)

    def _context(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The core attention's context of this rank's heads, [s, b, n/T * dv]."""
        return self.core_attention(query, key, value, attention_mask)


class SelfAttention(Attention):
    """Causal self-attention with optional grouped-query attention and rotary embeddings.

    With `config.qk_layernorm` each query and key head is normalised (the spec's
    `q_layernorm` / `k_layernorm`, over the head width) and with `config.qk_l2_norm` scaled to
    unit RMS (`L2Norm`), after the projection and before the rotary embedding, as in
    Megatron-LM. Under tensor parallelism the QK norms act on this rank's heads, so their
    weights' gradients are summed over the tensor-parallel group (as Megatron-LM sums them).

    Args:
        config: The transformer configuration.
        submodules: Specs of `linear_qkv`, `core_attention`, `linear_proj` and the QK norms.
        layer_number: 1-based index of the layer this attention belongs to.
        pg_collection: Process groups; its `tp` splits the heads (see `resolve_tp_group`).

    Raises:
        ValueError: `config.qk_layernorm` or `config.qk_l2_norm` with a spec whose
            `q_layernorm`/`k_layernorm` are empty (None or `IdentityOp`); a config of
            multi-latent attention (built by `MLASelfAttention`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int = 1,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        if config.multi_latent_attention:
            raise ValueError(
                "SelfAttention was given a config of multi-latent attention "
                "(multi_latent_attention=True); build the layer with "
                "get_gpt_layer_local_spec(multi_latent_attention=True) (or "
                "get_gpt_decoder_block_spec(config, ...), which follows the config)."
            )
        super().__init__(config, layer_number, pg_collection)
        tp_size = group_size(self.tp_group)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.head_dim = config.kv_channels
        # Sizes of the whole layer (all tp ranks), as the parallel linears take them.
        self.query_projection_size = config.num_attention_heads * self.head_dim
        self.kv_projection_size = config.num_query_groups * self.head_dim

        self.linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            self.query_projection_size + 2 * self.kv_projection_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=self.tp_group,
        )
        self._build_output(
            submodules.core_attention,
            submodules.linear_proj,
            self.query_projection_size,
            pg_collection,
        )
        self.q_layernorm, self.k_layernorm = self._build_qk_norms(config, submodules)
        # As upstream's attention: YaRN's concentration factor scales the rotated queries and
        # keys (1 unless the config's yarn_* fields describe YaRN, which GPTModel checks).
        self.rotary_mscale = yarn_concentration_factor(
            config.yarn_rotary_scaling_factor, config.yarn_mscale, config.yarn_mscale_all_dim
        )

    def _build_qk_norms(
        self, config: TransformerConfig, submodules: SelfAttentionSubmodules
    ) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
        if not (config.qk_l2_norm or config.qk_layernorm):
            return None, None
        specs = (submodules.q_layernorm, submodules.k_layernorm)
        if any(spec is None or spec is IdentityOp for spec in specs):
            raise ValueError(
                "config.qk_layernorm / qk_l2_norm asks for query-key norms, but the layer spec "
                "has none (get_gpt_layer_local_spec(qk_layernorm=False) puts IdentityOp there, "
                "where Megatron-core would silently build none): pass qk_layernorm=True (or "
                "qk_l2_norm=True) to the spec, or leave them None to follow the config."
            )
        if config.qk_l2_norm:
            specs = (L2Norm, L2Norm)
        kwargs = dict(
            config=config,
            hidden_size=self.head_dim,
            eps=config.layernorm_epsilon,
            tp_group=self.tp_group,
        )
        return tuple(build_module(spec, **kwargs) for spec in specs)

    def get_query_key_value_tensors(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projects [s, b, h] hidden states (under sequence parallelism this rank's [s/T, b, h])
        to this rank's heads: q [s, b, nh/T, d] and k, v [s, b, ng/T, d]."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        groups = self.num_query_groups_per_partition
        heads_per_group = self.num_attention_heads_per_partition // groups
        mixed_qkv = mixed_qkv.view(
            *mixed_qkv.shape[:-1], groups, (heads_per_group + 2) * self.head_dim
        )
        query, key, value = torch.split(
            mixed_qkv, [heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1
        )
        query = query.reshape(
            *query.shape[:2], self.num_attention_heads_per_partition, self.head_dim
        )
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
            key = self.k_layernorm(key)
        return query, key, value

    @property
    def adds_residual(self) -> bool:
        """Whether `forward(..., residual=)` takes the layer's residual connection: this
        `forward` (a subclass that overrides it may not pass the residual on, or may change
        the output after it) and an output projection that adds it."""
        return type(self).forward is SelfAttention.forward and self._projection_adds_residual()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attends over the sequence.

        Args:
            hidden_states: [s, b, h] (already normalised, unless the QKV projection fuses it);
                under sequence parallelism this rank's [s/T, b, h].
            attention_mask: None for causal attention, or a boolean mask (True = masked out).
            rotary_pos_emb: Angles from `RotaryEmbedding` (or `YarnRotaryEmbedding`: the
                config's `yarn_*` fields give its concentration factor), [s, 1, 1, rot_dim],
                or None.
            residual: The layer's residual connection, added to the output (where
                `adds_residual`), or None.

        Returns:
            `(output, None)`: output [s, b, h] (under sequence parallelism [s/T, b, h]), the
            projection's bias (and `residual`) added.
        """
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None:
            query, key = rotate_query_and_key(
                query,
                key,
                rotary_pos_emb,
                rotary_interleaved=self.config.rotary_interleaved,
                fused=self.config.apply_rope_fusion,
                mscale=self.rotary_mscale,
            )

        return self._attend_and_project(query, key, value, attention_mask, residual)
