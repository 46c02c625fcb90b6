"""Normalisation layers built from plain PyTorch (`torch.nn.LayerNorm` / `torch.nn.RMSNorm`).

This is the norm of the torch-only ("local") layer spec, used whenever neither apex nor
Transformer Engine provides a fused one. It also holds the zero-centred-gamma variants
(`--apply-layernorm-1p`), the weightless `L2Norm` of `qk_l2_norm`, and the variants whose
replicated parameters see only part of the activations on each tensor-parallel rank (norms on
sequence-parallel activations, QK norms on the rank's heads): their gradients are summed over
the tensor-parallel group in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import grad_sum_over_tp
from megatron.core.tensor_parallel.utils import group_size
from megatron.core.transformer.transformer_config import NORMALIZATIONS, TransformerConfig


def resolve_normalization(config: TransformerConfig, normalization: str | None) -> str:
    """Returns the normalisation to build, checking a spec's request against the config.

    Args:
        config: The transformer configuration; `config.normalization` decides.
        normalization: What the layer spec was made for (None: whatever the config says).

    Raises:
        ValueError: The spec was made for another normalisation than the config asks for.
    """
    if normalization is not None and normalization != config.normalization:
        raise ValueError(
            f"the layer spec was built with normalization={normalization!r} but "
            f"config.normalization is {config.normalization!r}; pass the same value to both "
            "(e.g. get_gpt_layer_local_spec(normalization=config.normalization))."
        )
    return config.normalization


class WrappedTorchNorm:
    """Factory returning `torch.nn.LayerNorm` or `torch.nn.RMSNorm` as `config` asks.

    Without a tensor-parallel group to sum over it returns the torch module itself (not a
    wrapper), so parameter names are `weight` and `bias` and the module's own
    `reset_parameters()` (weight one, bias zero) is Megatron's init. With one (of more than one
    rank) it returns a subclass that sums the parameters' gradients over that group.

    Args:
        config: The transformer configuration (`normalization`, `params_dtype`).
        hidden_size: Size of the normalised (last) dimension.
        eps: Epsilon added to the variance.
        normalization: Normalisation the spec expects; must match `config.normalization`.
        tp_group: The tensor-parallel group over which the parameters' gradients are summed
            (each rank normalising part of the activations); None: no sum.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        normalization: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> torch.nn.Module:
        kind = resolve_normalization(config, normalization)
        assert kind in NORMALIZATIONS
        layer_norm = kind == "LayerNorm"
        kwargs = dict(eps=eps, dtype=config.params_dtype)
        if config.layernorm_zero_centered_gamma:
            norm_cls = ZeroCenteredLayerNorm if layer_norm else ZeroCenteredRMSNorm
        elif group_size(tp_group) > 1:
            norm_cls = TensorParallelLayerNorm if layer_norm else TensorParallelRMSNorm
        else:
            return (torch.nn.LayerNorm if layer_norm else torch.nn.RMSNorm)(hidden_size, **kwargs)
        return norm_cls(hidden_size, tp_group=tp_group, **kwargs)


class _GradSumOverTp:
    """Mixin of a norm holding `tp_group`: `_summed(param)` is the parameter to compute with,
    whose gradient is summed over the group in backward (identity without a group)."""

    def __init__(self, *args, tp_group: dist.ProcessGroup | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp_group = tp_group

    def _summed(self, param: torch.Tensor | None) -> torch.Tensor | None:
        return None if param is None else grad_sum_over_tp(param, self.tp_group)


class TensorParallelLayerNorm(_GradSumOverTp, torch.nn.LayerNorm):
    """`torch.nn.LayerNorm` whose weight and bias gradients are summed over `tp_group`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self._summed(self.weight), self._summed(self.bias)
        return F.layer_norm(input, self.normalized_shape, weight, bias, self.eps)


class TensorParallelRMSNorm(_GradSumOverTp, torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` whose weight gradient is summed over `tp_group`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(input, self.normalized_shape, self._summed(self.weight), self.eps)


class ZeroCenteredLayerNorm(_GradSumOverTp, torch.nn.LayerNorm):
    """LayerNorm whose scale is `1 + weight`, the weight initialised to zero (Megatron-LM's
    `apply_layernorm_1p`): weight decay then pulls the scale towards 1 rather than 0. Gradients
    are summed over `tp_group` when one is given."""

    def reset_parameters(self) -> None:
        """Weight and bias zero: the norm starts as the identity scale."""
        torch.nn.init.zeros_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self._summed(self.weight), self._summed(self.bias)
        return F.layer_norm(input, self.normalized_shape, weight + 1, bias, self.eps)


class ZeroCenteredRMSNorm(_GradSumOverTp, torch.nn.RMSNorm):
    """RMSNorm whose scale is `1 + weight`, the weight initialised to zero (as TE's
    `zero_centered_gamma`). Gradients are summed over `tp_group` when one is given."""

    def reset_parameters(self) -> None:
        """Weight zero: the norm starts as the identity scale."""
        torch.nn.init.zeros_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self._summed(self.weight)
        return F.rms_norm(input, self.normalized_shape, weight + 1, self.eps)


class L2Norm(torch.nn.Module):
    """Scales the last dimension to unit root-mean-square, with no weight (Llama 4's QK norm,
    Megatron-LM's `L2Norm`); computed in fp32 and cast back.

    Args:
        hidden_size: Size of the normalised (last) dimension (for the repr only).
        eps: Added to the mean square.
        **kwargs: The other arguments a norm spec passes (`config`), unused.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs: object):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
