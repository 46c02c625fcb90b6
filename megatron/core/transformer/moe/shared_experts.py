"""Shared experts: a dense MLP every token of an MoE layer goes through (DeepSeek, Qwen2-MoE)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import grad_sum_over_tp
from megatron.core.tensor_parallel.utils import get_tensor_model_parallel_group_if_none
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig


class SharedExpertMLP(MLP):
    """The dense MLP of width `moe_shared_expert_intermediate_size`, without biases, optionally
    scaled per token by a sigmoid gate (`moe_shared_expert_gate`, Qwen2-MoE's).

    Parameters: `linear_fc1.weight`, `linear_fc2.weight` as the dense MLP (split over tp as
    its column- and row-parallel projections), and `gate_weight` [1, hidden] with the gate
    (initialised with `config.init_method` in fp32, stored in `params_dtype`, replicated over
    tp). The gate is drawn before the projections, the order in which `module.modules()`
    visits them: a model built on the `meta` device and initialised module by module in that
    order (Megatron-FSDP's materialisation) gets the weights of an eager build.

    Args:
        config: The transformer configuration.
        submodules: Specs of the two projections.
        tp_group: The tensor-parallel group; None resolves to parallel_state's when initialised,
            else no split. MoE layers with more than one tp rank run sequence parallel (the
            config requires it), so each rank gates its own part of the sequence.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        *,
        tp_group: dist.ProcessGroup | None = None,
    ):
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        gate = _drawn_gate(config) if config.moe_shared_expert_gate else None
        super().__init__(
            config, submodules, config.moe_shared_expert_intermediate_size, tp_group=tp_group
        )
        self.tp_group = tp_group
        if gate is not None:
            self.gate_weight = torch.nn.Parameter(gate.to(config.params_dtype))
        else:
            self.register_parameter("gate_weight", None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draws the gate again (the projections reset themselves)."""
        if self.gate_weight is not None:
            self.gate_weight.copy_(_drawn_gate(self.config, self.gate_weight.device))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Returns the shared experts' [s, b, h] output (gated when configured); [s/T, b, h]
        in and out under sequence parallelism."""
        output, _ = super().forward(hidden_states)  # no fc2 bias: the config refuses biases
        if self.gate_weight is not None:
            gate_weight = grad_sum_over_tp(self.gate_weight, self.tp_group)
            output = output * torch.sigmoid(F.linear(hidden_states, gate_weight))
        return output


def _drawn_gate(config: TransformerConfig, device: torch.device | None = None) -> torch.Tensor:
    """A [1, hidden] fp32 gate weight from `config.init_method`, on `device` (None: the
    default)."""
    gate = torch.empty(1, config.hidden_size, dtype=torch.float32, device=device)
    config.init_method(gate)
    return gate
