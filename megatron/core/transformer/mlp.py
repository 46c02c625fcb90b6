"""The feed-forward block of a transformer layer: fc1, activation (optionally gated), fc2.

Under tensor parallelism over T ranks fc1 is column-parallel and fc2 row-parallel: each rank
computes `ffn / T` of the intermediate features and fc2 sums the ranks' parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.activations import gated_linear_unit
from megatron.core.fusions.fused_swiglu import fused_swiglu, fused_swiglu_supported
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


def mlp_activation(
    intermediate: torch.Tensor, config: TransformerConfig, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The MLP's activation of fc1's output: `config.activation_func`, or with
    `config.gated_linear_unit` the GLU over its `[gate | linear]` halves with
    `config.glu_linear_offset` and `config.activation_func_clamp_value` (`gated_linear_unit`);
    SwiGLU in the fused kernels with `config.bias_activation_fusion` where they run.

    Args:
        intermediate: fc1's output [..., fc1_out].
        config: the activation's fields.
        weights: [..., 1] factors of the rows (an MoE expert's routing weights) that multiply
            the activation, or None; the product is taken in the wider dtype (fp32 with fp32
            weights) and returned in `intermediate`'s.
    """
    fused = (
        config.gated_linear_unit
        and config.bias_activation_fusion
        and _plain_swiglu(config)
        and fused_swiglu_supported(intermediate)
    )
    if fused:
        return fused_swiglu(intermediate, weights)
    if not config.gated_linear_unit:
        activated = config.activation_func(intermediate)
    else:
        activated = gated_linear_unit(
            intermediate,
            config.activation_func,
            config.glu_linear_offset,
            config.activation_func_clamp_value,
        )
    return activated if weights is None else (activated * weights).to(intermediate.dtype)


def _plain_swiglu(config: TransformerConfig) -> bool:
    """Whether the gated activation is SwiGLU itself: SiLU, no offset, no clamp."""
    return (
        config.activation_func is F.silu
        and config.glu_linear_offset == 0.0
        and config.activation_func_clamp_value is None
    )


@dataclass
class MLPSubmodules:
    """Specs of the two projections of `MLP`.

    Attributes:
        linear_fc1: hidden -> ffn (2 * ffn when gated); may fuse the pre-MLP norm.
        linear_fc2: ffn -> hidden.
    """

    linear_fc1: ModuleSpec | type | None = None
    linear_fc2: ModuleSpec | type | None = None


class MLP(MegatronModule):
    """fc2(act(fc1(x))), or with `gated_linear_unit` fc2(act(x W) * (x V)) (SwiGLU with SiLU;
    gpt-oss's clamped GLU with an offset, see `mlp_activation`).

    In the gated case fc1 computes both halves in one GEMM: its output is `[x W | x V]` along
    the last dimension, as in Megatron-LM. Under tensor parallelism fc1 is built with stride 2,
    so tp rank t holds `[W_t; V_t]` (its part of each half) and its output is `[x W_t | x V_t]`.

    Args:
        config: The transformer configuration.
        submodules: Specs of `linear_fc1` and `linear_fc2`.
        ffn_hidden_size: Width of the MLP (all tp ranks); None means `config.ffn_hidden_size`
            (MoE's shared experts pass theirs).
        tp_group: The tensor-parallel group the width is split over; None resolves to
            parallel_state's when initialised, else no split.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        ffn_hidden_size: int | None = None,
        *,
        tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(config)
        if ffn_hidden_size is None:
            ffn_hidden_size = config.ffn_hidden_size
        fc1_output_size = ffn_hidden_size
        if config.gated_linear_unit:
            fc1_output_size *= 2
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            config.hidden_size,
            fc1_output_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear,
            skip_bias_add=False,
            stride=2 if config.gated_linear_unit else 1,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=tp_group,
        )
        # The linear adds its own bias (in the GEMM's epilogue at tp 1, after the sum over tp
        # otherwise) rather than handing it to the layer's bias-dropout-add, as upstream does for
        # its fused kernel: unfused, that is one more pass over the activations.
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=tp_group,
        )

    @property
    def adds_residual(self) -> bool:
        """Whether `forward(..., residual=)` takes the layer's residual connection: this
        `forward` (a subclass that overrides it, as MoE's shared experts do, may not pass the
        residual on, or may change the output after it) and an fc2 that adds it
        (`RowParallelLinear.forward`), in its GEMM where it can."""
        fc2 = self.linear_fc2
        return (
            type(self).forward is MLP.forward
            and isinstance(fc2, RowParallelLinear)
            and not fc2.skip_bias_add
        )

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Applies the MLP to [s, b, h] hidden states (under sequence parallelism this rank's
        [s/T, b, h]), plus `residual` where given (the layer's residual connection, where
        `adds_residual`).

        Returns:
            `(output, None)`: output of the input's shape, fc2's bias added (Megatron-LM's
            calling convention: the second entry is a bias left for the caller to add).
        """
        intermediate, _ = self.linear_fc1(hidden_states)
        activated = mlp_activation(intermediate, self.config)
        if residual is None:
            return self.linear_fc2(activated)
        return self.linear_fc2(activated, residual=residual)
