"""The tiny MoE layer the MoE layer tests build: its sizes, config and construction."""

from __future__ import annotations

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed_harness import current_device

WORLD = 4
"""Ranks of the multi-rank cases (expert-parallel sizes up to 4)."""
SEQ, BATCH, HIDDEN, EXPERTS, TOPK = 4, 2, 32, 8, 2


def moe_config(ep: int = 1, etp: int = 1, **overrides) -> TransformerConfig:
    """The tiny layer's config at expert-parallel size `ep` and expert tensor-parallel `etp`."""
    fields = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=16,
        moe_router_topk=TOPK,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    return TransformerConfig(**{**fields, **overrides})


def moe_layer(config: TransformerConfig) -> MoELayer:
    """The layer `config` describes, its weights from a fixed seed, on the rank's device."""
    torch.manual_seed(123)
    spec = get_moe_module_spec(moe_grouped_gemm=config.moe_grouped_gemm)
    return MoELayer(config, spec.submodules, layer_number=1).to(current_device())
