"""A dense projection that is never split over tensor-parallel ranks, with the calling
convention of the parallel linears.

The local layer spec uses `ColumnParallelLinear` / `RowParallelLinear`
(`megatron.core.tensor_parallel`), which compute exactly what `Linear` does at tensor-parallel
size 1 (same parameters, initialisation and outputs). `Linear` stays for projections that must
stay whole on every rank: the forward returns `(output, bias)`, where `bias` is None unless
`skip_bias_add` asks the caller to add it (so that a later fused bias-dropout-add can absorb it).

Replicated over the tensor-parallel ranks while its input is split along the sequence (sequence
parallelism; multi-latent attention's down-projections), each rank's weight gradient covers its
part of the sequence only: given that group (`tp_group`), the layer sums them over it in
backward, as the norms of sequence-parallel activations do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.grad_accumulation import linear
from megatron.core.tensor_parallel.mappings import grad_sum_over_tp
from megatron.core.transformer.transformer_config import TransformerConfig

if TYPE_CHECKING:
    from megatron.core.fp8.linear import Fp8LinearSlots


class Linear(torch.nn.Module):
    """y = x W^T (+ b), with Megatron's initialisation and parameters in `config.params_dtype`.

    Args:
        input_size: Size of the last input dimension.
        output_size: Size of the last output dimension.
        config: The transformer configuration (`params_dtype`; `gradient_accumulation_fusion`
            says whether the weight gradient may fuse into a registered `main_grad`).
        init_method: In-place initialiser of the weight (e.g. `config.init_method`).
        bias: Whether the layer has a bias.
        skip_bias_add: Return the bias instead of adding it.
        tp_group: The tensor-parallel group whose ranks hold the same weight but see different
            parts of the input (sequence parallelism): the weight's and bias's gradients are
            summed over it in backward. None: no sum (the weight sees every rank's input).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], torch.Tensor],
        bias: bool = True,
        skip_bias_add: bool = False,
        tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.input_size = input_size
        self.output_size = output_size
        self.init_method = init_method
        self.skip_bias_add = skip_bias_add
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(output_size, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.fp8: Fp8LinearSlots | None = None
        """FP8 settings when the layer's GEMMs run in FP8 (given by the transformer block
        that holds it, `megatron.core.fp8`); None: high precision."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight from `init_method`, bias zero."""
        self.init_method(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Projects the last dimension of `x`.

        Args:
            x: Input of shape [..., input_size].

        Returns:
            `(output, bias)`: output of shape [..., output_size]; bias is the un-added bias when
            `skip_bias_add`, else None.
        """
        # The parameters themselves without a group of two or more ranks (so that their
        # gradients can fuse into `main_grad`), else their gradient-summing views.
        weight = grad_sum_over_tp(self.weight, self.tp_group)
        bias = None if self.bias is None else grad_sum_over_tp(self.bias, self.tp_group)
        fusion = self.config.gradient_accumulation_fusion
        if self.skip_bias_add:
            return linear(x, weight, fp8=self.fp8, fusion=fusion), bias
        return linear(x, weight, bias, self.fp8, fusion=fusion), None

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"bias={self.bias is not None}, skip_bias_add={self.skip_bias_add}"
        )
