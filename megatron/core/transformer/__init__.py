"""Transformer building blocks: config, module specs, attention, MLP, layers and the block."""

from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.linear import Linear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

__all__ = [
    "DotProductAttention",
    "IdentityOp",
    "Linear",
    "MLP",
    "MLPSubmodules",
    "MegatronModule",
    "ModuleSpec",
    "SelfAttention",
    "SelfAttentionSubmodules",
    "TransformerBlock",
    "TransformerBlockSubmodules",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "WrappedTorchNorm",
    "build_module",
]
