"""Thin Transformer Engine (TE) wrappers with the constructor contract of the local modules.

`get_gpt_layer_with_transformer_engine_spec()` puts `TELayerNormLinear` (the norm fused into the
QKV projection and into fc1) and `TELinear` (attention output and fc2) in the layer spec;
`get_gpt_decoder_block_spec(config, use_transformer_engine=True)` adds `TENorm` as the decoder's
final norm. The linear wrappers take the arguments of the local `Linear` and return
`(output, bias)` like it, and `TENorm` takes those of `WrappedTorchNorm`, so `SelfAttention`,
`MLP`, `TransformerLayer` and `TransformerBlock` do not know which backend they run on. The import
of TE is guarded; without TE, `HAVE_TE` is False and building any of these raises `ImportError`
with install instructions.

TE allocates parameters on the current CUDA device (or on `meta` when built under
`with torch.device("meta")`), and its modules' `reset_parameters()` apply the given init method.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.core.transformer.torch_norm import resolve_normalization
from megatron.core.transformer.transformer_config import TransformerConfig

try:
    import transformer_engine.pytorch as te

    HAVE_TE = True
    _TE_IMPORT_ERROR: BaseException | None = None
except (ImportError, OSError) as error:  # OSError: TE installed but its CUDA libraries missing
    te = None
    HAVE_TE = False
    _TE_IMPORT_ERROR = error

TE_MISSING_MESSAGE = (
    "transformer-engine is not installed (or failed to import), so the Transformer Engine layer "
    "spec is unavailable. Install it with "
    "`pip install --no-build-isolation transformer-engine[pytorch]` (needs CUDA), or use the "
    "torch-only spec instead: get_gpt_layer_local_spec() / `--transformer-impl local`."
)


def require_te() -> None:
    """Raises `ImportError` with install instructions when TE cannot be imported."""
    if not HAVE_TE:
        raise ImportError(TE_MISSING_MESSAGE) from _TE_IMPORT_ERROR


def _te_device() -> torch.device:
    # TE ignores torch's default-device context and allocates on the current CUDA device unless
    # told otherwise; forwarding `meta` (or an explicit cuda:N) keeps that context meaningful.
    default = torch.get_default_device()
    if default.type == "meta" or (default.type == "cuda" and default.index is not None):
        return default
    return torch.device("cuda", torch.cuda.current_device())


class TENorm:
    """Factory returning TE's `LayerNorm` or `RMSNorm` as `config.normalization` asks.

    Args:
        config: The transformer configuration.
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
        require_te()
        kind = resolve_normalization(config, normalization)
        norm_cls = te.LayerNorm if kind == "LayerNorm" else te.RMSNorm
        return norm_cls(
            hidden_size,
            eps=eps,
            params_dtype=config.params_dtype,
            device=_te_device(),
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
        )


class TELinear(te.Linear if HAVE_TE else torch.nn.Module):
    """`te.pytorch.Linear` with the constructor and `(output, bias)` return of local `Linear`.

    Args:
        input_size: Size of the last input dimension.
        output_size: Size of the last output dimension.
        config: The transformer configuration (for `params_dtype`).
        init_method: In-place initialiser of the weight.
        bias: Whether the layer has a bias.
        skip_bias_add: Return the bias instead of adding it.
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
    ):
        require_te()
        te_return_bias = skip_bias_add and bias
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            return_bias=te_return_bias,
            init_method=init_method,
            params_dtype=config.params_dtype,
            device=_te_device(),
        )
        self.te_return_bias = te_return_bias

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        output = super().forward(x)
        # With return_bias TE already returns (output, bias).
        return output if self.te_return_bias else (output, None)


class TELayerNormLinear(te.LayerNormLinear if HAVE_TE else torch.nn.Module):
    """`te.pytorch.LayerNormLinear`: `config.normalization` fused with the projection.

    Used for the QKV projection and fc1, whose specs then hold `IdentityOp` as the norm. Same
    arguments and return as local `Linear`; the norm's epsilon and kind come from `config`.

    Args:
        input_size: Size of the last input dimension.
        output_size: Size of the last output dimension.
        config: The transformer configuration.
        init_method: In-place initialiser of the weight.
        bias: Whether the layer has a bias.
        skip_bias_add: Return the bias instead of adding it.
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
    ):
        require_te()
        te_return_bias = skip_bias_add and bias
        super().__init__(
            input_size,
            output_size,
            eps=config.layernorm_epsilon,
            bias=bias,
            normalization=config.normalization,
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            return_bias=te_return_bias,
            init_method=init_method,
            params_dtype=config.params_dtype,
            device=_te_device(),
        )
        self.te_return_bias = te_return_bias

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        output = super().forward(x)
        return output if self.te_return_bias else (output, None)
