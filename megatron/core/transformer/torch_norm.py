"""Normalisation layers built from plain PyTorch (`torch.nn.LayerNorm` / `torch.nn.RMSNorm`).

This is the norm of the torch-only ("local") layer spec, used whenever neither apex nor
Transformer Engine provides a fused one. It also holds the zero-centred-gamma variants
(`--apply-layernorm-1p`) and the weightless `L2Norm` of `qk_l2_norm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

    It returns the torch module itself (not a wrapper), so parameter names are `weight` and
    `bias` and the module's own `reset_parameters()` (weight one, bias zero) is Megatron's init.

    Args:
        config: The transformer configuration (`normalization`, `params_dtype`).
        hidden_size: Size of the normalised (last) dimension.
        eps: Epsilon added to the variance.
        normalization: Normalisation the spec expects; must match `config.normalization`.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        normalization: str | None = None,
    ) -> torch.nn.Module:
        kind = resolve_normalization(config, normalization)
        assert kind in NORMALIZATIONS
        if config.layernorm_zero_centered_gamma:
            norm_cls = ZeroCenteredLayerNorm if kind == "LayerNorm" else ZeroCenteredRMSNorm
        else:
            norm_cls = torch.nn.LayerNorm if kind == "LayerNorm" else torch.nn.RMSNorm
        return norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm whose scale is `1 + weight`, the weight initialised to zero (Megatron-LM's
    `apply_layernorm_1p`): weight decay then pulls the scale towards 1 rather than 0."""

    def reset_parameters(self) -> None:
        """Weight and bias zero: the norm starts as the identity scale."""
        torch.nn.init.zeros_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm whose scale is `1 + weight`, the weight initialised to zero (as TE's
    `zero_centered_gamma`)."""

    def reset_parameters(self) -> None:
        """Weight zero: the norm starts as the identity scale."""
        torch.nn.init.zeros_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(input, self.normalized_shape, self.weight + 1, self.eps)


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
