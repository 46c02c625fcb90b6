"""Normalisation layers built from plain PyTorch (`torch.nn.LayerNorm` / `torch.nn.RMSNorm`).

This is the norm of the torch-only ("local") layer spec, used whenever neither apex nor
Transformer Engine provides a fused one.
"""

from __future__ import annotations

import torch

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
        norm_cls = torch.nn.LayerNorm if kind == "LayerNorm" else torch.nn.RMSNorm
        return norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
