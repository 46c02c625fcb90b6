"""Multi-latent attention (DeepSeek-V2 and V3), with Megatron-core's module and parameter names.

For each token x (the normalised hidden state), with n heads, content widths dk (queries and
keys) and dv (values), and rotated width dr:

    c_q = q_layernorm(x W_q_down)                  linear_q_down_proj  [q_lora_rank]
    [q_c, q_r] = c_q W_q_up  (x W_q without it)    linear_q_up_proj    [n, dk + dr]
    [c_kv, k_r] = x W_kv_down                      linear_kv_down_proj [kv_lora_rank + dr]
    [k_c, v] = kv_layernorm(c_kv) W_kv_up          linear_kv_up_proj   [n, dk + dv]
    query = [q_c, rope(q_r)], key = [k_c, rope(k_r)]   (one k_r for every head)
    output = softmax(query key^T * scale, causal) v  W_o                 linear_proj

Queries and keys are thus `dk + dr` wide and values `dv`; only the latents and k_r need storing
per token at inference. The rotation pairs adjacent channels of q_r and k_r (DeepSeek's layout);
upstream pairs channel 2i with 2i + 1 too, writing the rotated pair to channels i and i + dr / 2,
a permutation of q's and k's channels alike that no dot product sees. With `rope_type="yarn"` the
rotation is YaRN's, its concentration factor scaling q_r and k_r, and the softmax scale is
yarn_mscale(mscale_all_dim)^2 / sqrt(dk + dr) (`MLATransformerConfig`).

Tensor parallelism splits the heads: the up-projections (and `linear_q_proj`) are
column-parallel, `linear_proj` row-parallel. The down-projections are replicated (`Linear`,
as in upstream's Transformer Engine spec; upstream's local spec splits them and gathers their
outputs, an all-gather more per projection). Every rank's heads read the one k_r, so its
gradient is summed over the tensor-parallel ranks (upstream's local spec misses this sum,
NVIDIA/Megatron-LM#1699). Under sequence parallelism the down-projections and latent norms see
this rank's part of the sequence, their weights' gradients summed over the ranks; the
up-projections gather the latents, and k_r is gathered.

The core attention is `DotProductAttention` (SDPA's kernels, causal without a mask tensor). With
`attention_backend="flash"` and dv != dk + dr the values are zero-padded to the query width for
FlashAttention, which needs one width, and the padding dropped from its output; the other
kernels take the two widths as they are.

Under context parallelism the layer holds two chunks of every sequence: the rotary angles are
those of the chunks' positions in the whole sequence, and the core attention runs across the
context-parallel group (its `p2p` and `allgather` block kernels pad the values themselves where
a kernel needs one width).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.context_parallel import resolve_cp_group, split_sequence
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    RotaryEmbedding,
    rotate_query_and_key,
)
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.tensor_parallel.utils import group_rank, group_size
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.recompute import recompute_keeping
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import (
    MLATransformerConfig,
    TransformerConfig,
    recomputes,
    yarn_mscale,
)

ATTENTION_KERNELS: tuple[torch._ops.OpOverload, ...] = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)
"""The aten operators SDPA's fused kernels run as: what "mla_up_proj" recompute stores (SDPA's
math kernel, and the `local` backend, are plain operators, recomputed with the rest)."""


def mla_rotary_embedding(
    config: MLATransformerConfig, interleaved: bool = True
) -> RotaryEmbedding | YarnRotaryEmbedding:
    """The rotary embedding of MLA's rotated channels (`qk_pos_emb_head_dim`): plain RoPE for
    `rope_type="rope"`, else YaRN with the config's scaling. MLA rotates adjacent channel pairs
    (`interleaved`); upstream rotates the halves, which `interleaved=False` gives."""
    if config.rope_type == "rope":
        return RotaryEmbedding(
            config.qk_pos_emb_head_dim,
            config.rotary_percent,
            rotary_interleaved=interleaved,
            rotary_base=config.rotary_base,
        )
    return YarnRotaryEmbedding(
        config.qk_pos_emb_head_dim,
        rotary_interleaved=interleaved,
        rotary_base=config.rotary_base,
        scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings,
        beta_fast=config.beta_fast,
        beta_slow=config.beta_slow,
        mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim,
    )


@dataclass
class MLASelfAttentionSubmodules:
    """Specs of the parts of `MLASelfAttention` (Megatron-core's names).

    Attributes:
        linear_q_proj: Query projection from the hidden state (`q_lora_rank` None).
        linear_q_down_proj: Query down-projection to `q_lora_rank` (replicated over tp).
        linear_q_up_proj: Query up-projection to the heads (column-parallel).
        linear_kv_down_proj: Down-projection to the key/value latent and the shared rotated key
            (replicated over tp).
        linear_kv_up_proj: Key/value up-projection to the heads (column-parallel).
        core_attention: The attention itself (e.g. `DotProductAttention`).
        linear_proj: Output projection (row-parallel).
        q_layernorm: Norm of the query latent, built when `config.qk_layernorm` and
            `q_lora_rank` are set.
        kv_layernorm: Norm of the key/value latent, built when `config.qk_layernorm`.
    """

    linear_q_proj: ModuleSpec | type | None = None
    linear_q_down_proj: ModuleSpec | type | None = None
    linear_q_up_proj: ModuleSpec | type | None = None
    linear_kv_down_proj: ModuleSpec | type | None = None
    linear_kv_up_proj: ModuleSpec | type | None = None
    core_attention: ModuleSpec | type | None = None
    linear_proj: ModuleSpec | type | None = None
    q_layernorm: ModuleSpec | type | None = None
    kv_layernorm: ModuleSpec | type | None = None


class MLASelfAttention(Attention):
    """Causal multi-latent self-attention (module docstring), its own rotary embedding inside.

    Selective recompute "mla_up_proj" (`config.recompute_modules`) recomputes the
    up-projections and the rotation in backward instead of storing the queries, keys and values
    (their latents are stored), as upstream; the attention kernel's outputs are stored, unless
    "core_attn" recomputes the attention too.

    Args:
        config: An `MLATransformerConfig`.
        submodules: Specs of the projections, norms and core attention.
        layer_number: 1-based index of the layer this attention belongs to.
        pg_collection: Process groups; its `tp` splits the heads.

    Raises:
        ValueError: the config is not an `MLATransformerConfig`; `config.qk_layernorm` with a
            spec whose latent norms are empty.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int = 1,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        if not isinstance(config, MLATransformerConfig):
            raise ValueError(
                f"MLASelfAttention needs an MLATransformerConfig (the latent ranks, head widths "
                f"and YaRN settings), got a {type(config).__name__}; build the model from an "
                "MLATransformerConfig, or use get_gpt_layer_local_spec() without "
                "multi_latent_attention for standard attention."
            )
        super().__init__(config, layer_number, pg_collection)
        self.config: MLATransformerConfig
        heads = config.num_attention_heads
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        # The down-projections see this rank's part of the sequence under sequence parallelism.
        split_sequence_group = self.tp_group if config.sequence_parallel else None
        if config.q_lora_rank is None:
            self.linear_q_proj = self._column_parallel(
                submodules.linear_q_proj, config.hidden_size, heads * self.q_head_dim, "q_proj"
            )
        else:
            self.linear_q_down_proj = build_module(
                submodules.linear_q_down_proj,
                config.hidden_size,
                config.q_lora_rank,
                config=config,
                init_method=config.init_method,
                bias=False,
                tp_group=split_sequence_group,
            )
            self.linear_q_up_proj = self._column_parallel(
                submodules.linear_q_up_proj, config.q_lora_rank, heads * self.q_head_dim, "q_up"
            )
        self.linear_kv_down_proj = build_module(
            submodules.linear_kv_down_proj,
            config.hidden_size,
            config.kv_lora_rank + config.qk_pos_emb_head_dim,
            config=config,
            init_method=config.init_method,
            bias=False,
            tp_group=split_sequence_group,
        )
        self.linear_kv_up_proj = self._column_parallel(
            submodules.linear_kv_up_proj,
            config.kv_lora_rank,
            heads * (config.qk_head_dim + config.v_head_dim),
            "kv_up",
        )
        softmax_scale = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2
        self._build_output(
            submodules.core_attention,
            submodules.linear_proj,
            heads * config.v_head_dim,
            pg_collection,
            softmax_scale=softmax_scale / math.sqrt(self.q_head_dim),
        )
        self.q_layernorm, self.kv_layernorm = self._build_latent_norms(
            submodules, split_sequence_group
        )
        self.rotary_pos_emb = mla_rotary_embedding(config)
        self.cp_group = resolve_cp_group(None if pg_collection is None else pg_collection.cp)
        self.pad_value = (
            config.attention_backend == AttnBackend.flash and config.v_head_dim != self.q_head_dim
        )
        """FlashAttention needs the values as wide as the queries (module docstring)."""
        self.recompute_up_proj = recomputes(config, "mla_up_proj")
        # With "core_attn" too, nothing of the attention is stored: a plain checkpoint.
        self.recompute_kept_ops = () if self.recompute_core_attention else ATTENTION_KERNELS

    def _column_parallel(
        self, spec: ModuleSpec | type, input_size: int, output_size: int, name: str
    ) -> torch.nn.Module:
        return build_module(
            spec,
            input_size,
            output_size,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name=name,
            tp_group=self.tp_group,
        )

    def _build_latent_norms(
        self, submodules: MLASelfAttentionSubmodules, tp_group: dist.ProcessGroup | None
    ) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
        config = self.config
        if not config.qk_layernorm:
            return None, None
        specs = {"kv_layernorm": (submodules.kv_layernorm, config.kv_lora_rank)}
        if config.q_lora_rank is not None:
            specs["q_layernorm"] = (submodules.q_layernorm, config.q_lora_rank)
        empty = [name for name, (spec, _) in specs.items() if spec is None or spec is IdentityOp]
        if empty:
            raise ValueError(
                f"config.qk_layernorm asks for the latent norms, but the layer spec's "
                f"{' and '.join(empty)} is empty (get_gpt_layer_local_spec(qk_layernorm=False) "
                "puts IdentityOp there); pass qk_layernorm=True (or None, to follow the config)."
            )
        norms = {
            name: build_module(
                spec,
                config=config,
                hidden_size=size,
                eps=config.layernorm_epsilon,
                tp_group=tp_group,
            )
            for name, (spec, size) in specs.items()
        }
        return norms.get("q_layernorm"), norms["kv_layernorm"]

    @property
    def adds_residual(self) -> bool:
        """Whether `forward(..., residual=)` takes the layer's residual connection: this
        `forward` (a subclass that overrides it may not pass the residual on, or may change
        the output after it) and an output projection that adds it."""
        return type(self).forward is MLASelfAttention.forward and self._projection_adds_residual()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attends over the sequence.

        Args:
            hidden_states: [s, b, h] (normalised); under sequence parallelism this rank's
                [s/T, b, h].
            attention_mask: None for causal attention, or a boolean mask (True = masked out).
            rotary_pos_emb: Must be None: the layer rotates by its own embedding (upstream
                asserts the same).
            residual: The layer's residual connection, added to the output (where
                `adds_residual`), or None.

        Returns:
            `(output, None)`: output [s, b, h] (under sequence parallelism [s/T, b, h]), the
            projection's bias (and `residual`) added.

        Raises:
            ValueError: `rotary_pos_emb` is given.
        """
        if rotary_pos_emb is not None:
            raise ValueError(
                "MLASelfAttention rotates queries and keys by its own (YaRN) embedding; pass "
                "rotary_pos_emb=None (GPTModel builds no rotary embedding for it)."
            )
        latents = self._down_project(hidden_states)
        if self.recompute_up_proj and self.training and torch.is_grad_enabled():
            context = recompute_keeping(
                self.recompute_kept_ops, self._up_project_and_attend, *latents, attention_mask
            )
            return self._project(context, residual)
        query, key, value = self._up_project(*latents)
        return self._attend_and_project(query, key, value, attention_mask, residual)

    def _down_project(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query latent (the hidden states without `q_lora_rank`), the key/value latent,
        normalised, and the shared rotated key k_r [s, b, 1, dr] of the whole sequence."""
        config = self.config
        if config.q_lora_rank is None:
            q_latent = hidden_states
        else:
            q_latent, _ = self.linear_q_down_proj(hidden_states)
            if self.q_layernorm is not None:
                q_latent = self.q_layernorm(q_latent)
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        kv_latent, k_rot = torch.split(
            kv_combined, [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1
        )
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        if group_size(self.tp_group) > 1:
            # Every rank's heads read k_r: gathered along the sequence (its gradient then
            # reduce-scattered), or, with the whole sequence here, its gradient all-reduced.
            if config.sequence_parallel:
                k_rot = gather_from_sequence_parallel_region(k_rot, self.tp_group)
            else:
                k_rot = copy_to_tensor_model_parallel_region(k_rot, self.tp_group)
        return q_latent, kv_latent, k_rot.unsqueeze(2)

    def _up_project(
        self, q_latent: torch.Tensor, kv_latent: torch.Tensor, k_rot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's queries and keys [s, b, n/T, dk + dr] and values [s, b, n/T, dv]."""
        config = self.config
        heads = self.num_attention_heads_per_partition
        q_proj = self.linear_q_proj if config.q_lora_rank is None else self.linear_q_up_proj
        query, _ = q_proj(q_latent)
        query = query.unflatten(-1, (heads, self.q_head_dim))
        q_content, q_rot = torch.split(
            query, [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1
        )
        kv, _ = self.linear_kv_up_proj(kv_latent)
        kv = kv.unflatten(-1, (heads, config.qk_head_dim + config.v_head_dim))
        k_content, value = torch.split(kv, [config.qk_head_dim, config.v_head_dim], dim=-1)

        # The angles of this rank's chunks of the whole sequence under context parallelism.
        cp_size = group_size(self.cp_group)
        angles = self.rotary_pos_emb(query.shape[0] * cp_size, device=query.device)
        angles = split_sequence(angles, 0, group_rank(self.cp_group), cp_size)
        q_rot, k_rot = rotate_query_and_key(
            q_rot,
            k_rot,
            angles,
            rotary_interleaved=True,
            fused=config.apply_rope_fusion,
            mscale=self.rotary_pos_emb.concentration_factor,
        )
        query = torch.cat([q_content, q_rot], dim=-1)
        key = torch.cat([k_content, k_rot.expand(-1, -1, heads, -1)], dim=-1)
        return query, key, value

    def _up_project_and_attend(
        self,
        q_latent: torch.Tensor,
        kv_latent: torch.Tensor,
        k_rot: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """`_up_project`, then the core attention: the context [s, b, n/T * dv] (what "mla_up_proj"
        recompute checkpoints)."""
        query, key, value = self._up_project(q_latent, kv_latent, k_rot)
        return self._context(query, key, value, attention_mask)

    def _context(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if not self.pad_value:
            return super()._context(query, key, value, attention_mask)
        width = value.shape[-1]
        value = F.pad(value, (0, self.q_head_dim - width))
        context = super()._context(query, key, value, attention_mask)
        return context.unflatten(-1, (-1, self.q_head_dim))[..., :width].flatten(-2)
