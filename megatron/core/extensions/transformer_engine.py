"""Thin Transformer Engine (TE) wrappers with the constructor contract of the local modules.

`get_gpt_layer_with_transformer_engine_spec()` puts `TELayerNormLinear` (the norm fused into the
QKV projection and into fc1) and `TELinear` (attention output and fc2) in the layer spec;
`get_gpt_decoder_block_spec(config, use_transformer_engine=True)` adds `TENorm` as the decoder's
final norm. The linear wrappers take the arguments of the local spec's `ColumnParallelLinear` /
`RowParallelLinear` and return `(output, bias)` like them, and `TENorm` takes those of
`WrappedTorchNorm`, so `SelfAttention`, `MLP`, `TransformerLayer` and `TransformerBlock` do not
know which backend they run on. Tensor parallelism is not built with these wrappers: a
tensor-parallel group of more than one rank is refused. The import of TE is guarded; without TE,
`HAVE_TE` is False and building any of these raises `ImportError` with install instructions.

TE allocates parameters on the current CUDA device (or on `meta` when built under
`with torch.device("meta")`), and its modules' `reset_parameters()` apply the given init method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import (
    get_tensor_model_parallel_group_if_none,
    group_size,
)
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


def refuse_tensor_parallel(module: str, tp_group: dist.ProcessGroup | None) -> None:
    """Raises `ValueError` when `tp_group` (or parallel_state's, for None) has several ranks:
    the Transformer Engine wrappers do not split their weights."""
    size = group_size(get_tensor_model_parallel_group_if_none(tp_group))
    if size > 1:
        raise ValueError(
            f"{module} with tensor parallelism (a tensor-parallel group of {size} ranks) is not "
            "built; use the local spec (--transformer-impl local, get_gpt_layer_local_spec()) "
            "or tensor_model_parallel_size=1."
        )


PARALLEL_ARGUMENTS = (
    "gather_output",
    "input_is_parallel",
    "stride",
    "is_expert",
    "tp_comm_buffer_name",
    "tp_group",
)
"""Keywords the local spec's `ColumnParallelLinear` / `RowParallelLinear` take beyond the
wrappers' own; with one tensor-parallel rank they change nothing."""


def _check_parallel_arguments(module: str, parallel_kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(parallel_kwargs) - set(PARALLEL_ARGUMENTS))
    if unknown:
        raise TypeError(f"{module} got unexpected keyword arguments {unknown}.")
    refuse_tensor_parallel(module, parallel_kwargs.get("tp_group"))


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
        tp_group: The tensor-parallel group of a norm on sequence-parallel activations or on a
            rank's heads; a group of more than one rank is refused (not built).
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        normalization: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> torch.nn.Module:
        require_te()
        refuse_tensor_parallel("TENorm", tp_group)
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
    """`te.pytorch.Linear` with the constructor and `(output, bias)` return of the local linears.

    Args:
        input_size: Size of the last input dimension.
        output_size: Size of the last output dimension.
        config: The transformer configuration (for `params_dtype`).
        init_method: In-place initialiser of the weight.
        bias: Whether the layer has a bias.
        skip_bias_add: Return the bias instead of adding it.
        **parallel_kwargs: The local linears' tensor-parallel arguments (`PARALLEL_ARGUMENTS`),
            accepted for a tensor-parallel size of 1 only.

    Raises:
        ValueError: a tensor-parallel group of more than one rank.
        TypeError: a keyword that is neither the wrappers' nor in `PARALLEL_ARGUMENTS`.
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
        **parallel_kwargs: Any,
    ):
        require_te()
        _check_parallel_arguments("TELinear", parallel_kwargs)
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
    arguments and return as the local linears; the norm's epsilon and kind come from `config`.

    Args:
        input_size: Size of the last input dimension.
        output_size: Size of the last output dimension.
        config: The transformer configuration.
        init_method: In-place initialiser of the weight.
        bias: Whether the layer has a bias.
        skip_bias_add: Return the bias instead of adding it.
        **parallel_kwargs: The local linears' tensor-parallel arguments (`PARALLEL_ARGUMENTS`),
            accepted for a tensor-parallel size of 1 only.

    Raises:
        ValueError: a tensor-parallel group of more than one rank.
        TypeError: a keyword that is neither the wrappers' nor in `PARALLEL_ARGUMENTS`.
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
        **parallel_kwargs: Any,
    ):
        require_te()
        _check_parallel_arguments("TELayerNormLinear", parallel_kwargs)
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
