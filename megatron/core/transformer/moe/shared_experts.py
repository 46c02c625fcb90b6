"""Shared experts: a dense MLP every token of an MoE layer goes through (DeepSeek, Qwen2-MoE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig


class SharedExpertMLP(MLP):
    """The dense MLP of width `moe_shared_expert_intermediate_size`, without biases, optionally
    scaled per token by a sigmoid gate (`moe_shared_expert_gate`, Qwen2-MoE's).

    Parameters: `linear_fc1.weight`, `linear_fc2.weight` as the dense MLP, and `gate_weight`
    [1, hidden] with the gate (initialised with `config.init_method`).

    Args:
        config: The transformer configuration.
        submodules: Specs of the two projections.
    """

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules):
        super().__init__(config, submodules, config.moe_shared_expert_intermediate_size)
        if config.moe_shared_expert_gate:
            gate = torch.empty(1, config.hidden_size, dtype=torch.float32)
            config.init_method(gate)
            self.gate_weight = torch.nn.Parameter(gate.to(config.params_dtype))
        else:
            self.register_parameter("gate_weight", None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Returns the shared experts' [s, b, h] output (gated when configured)."""
        output, _ = super().forward(hidden_states)  # no fc2 bias: the config refuses biases
        if self.gate_weight is not None:
            output = output * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
        return output
