"""Layer specs for GPT: which classes fill the slots of a `TransformerLayer`.

`get_gpt_layer_local_spec()` needs only PyTorch (apex's fused norms are used when apex is
installed); `get_gpt_layer_with_transformer_engine_spec()` uses Transformer Engine's fused
norm + linear modules and fails with install instructions when TE is missing.
`get_gpt_decoder_block_spec()` wraps either into a whole-decoder spec whose final norm comes from
the same backend (`TENorm` with Transformer Engine), as in Megatron-LM.
"""

from __future__ import annotations

from megatron.core.fusions.fused_layer_norm import HAVE_APEX, FusedLayerNorm
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.linear import Linear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import NORMALIZATIONS, TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)


def get_gpt_layer_local_spec(*, normalization: str | None = None) -> ModuleSpec:
    """Spec of a GPT layer built from PyTorch modules (apex's fused norms when available).

    Args:
        normalization: "LayerNorm" or "RMSNorm" to pin the spec to that normalisation (building
            it with a config that says otherwise raises `ValueError`); None follows
            `config.normalization`.

    Returns:
        A `TransformerLayer` `ModuleSpec`.
    """
    if normalization is not None and normalization not in NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {NORMALIZATIONS} or None, got {normalization!r}."
        )
    norm = ModuleSpec(
        module=FusedLayerNorm if HAVE_APEX else WrappedTorchNorm,
        params={"normalization": normalization},
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=Linear,
                    core_attention=DotProductAttention,
                    linear_proj=Linear,
                    # Built only with config.qk_layernorm.
                    q_layernorm=norm,
                    k_layernorm=norm,
                ),
            ),
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=MLP, submodules=MLPSubmodules(linear_fc1=Linear, linear_fc2=Linear)
            ),
        ),
    )


def get_gpt_layer_with_transformer_engine_spec() -> ModuleSpec:
    """Spec of a GPT layer using Transformer Engine's fused norm + linear modules.

    The norms are fused into the QKV projection and fc1 (`TELayerNormLinear`), so the layer's
    own norm slots hold `IdentityOp`. The core attention stays PyTorch SDPA.

    Returns:
        A `TransformerLayer` `ModuleSpec`.

    Raises:
        ImportError: transformer-engine is not installed; the message says how to install it
            and how to fall back to the local spec.
    """
    # Imported here so that importing this module never pays for (or trips over) TE.
    from megatron.core.extensions.transformer_engine import (
        TELayerNormLinear,
        TELinear,
        TENorm,
        require_te,
    )

    require_te()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=TELayerNormLinear,
                    core_attention=DotProductAttention,
                    linear_proj=TELinear,
                    q_layernorm=TENorm,
                    k_layernorm=TENorm,
                ),
            ),
            pre_mlp_layernorm=IdentityOp,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=TELayerNormLinear, linear_fc2=TELinear),
            ),
        ),
    )


def get_gpt_decoder_block_spec(
    config: TransformerConfig, use_transformer_engine: bool
) -> TransformerBlockSubmodules:
    """Spec of the whole GPT decoder: `config.num_layers` layer specs and the final norm.

    A bare layer spec gives `TransformerBlock` the default final norm (`LayerNormImpl`); this one
    takes the final norm from the layers' backend, so a Transformer Engine model normalises its
    output with TE too (`TENorm`), as Megatron-LM's `get_gpt_decoder_block_spec` does.

    Args:
        config: The transformer configuration (`num_layers`).
        use_transformer_engine: Build from `get_gpt_layer_with_transformer_engine_spec()` and
            `TENorm` instead of `get_gpt_layer_local_spec()` and `LayerNormImpl`.

    Returns:
        A `TransformerBlockSubmodules`, accepted by `GPTModel` and `TransformerBlock` in place of
        a layer spec.

    Raises:
        ImportError: `use_transformer_engine` without transformer-engine installed.
    """
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TENorm

        layer_spec, layer_norm = get_gpt_layer_with_transformer_engine_spec(), TENorm
    else:
        layer_spec, layer_norm = get_gpt_layer_local_spec(), LayerNormImpl
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * config.num_layers, layer_norm=layer_norm
    )
