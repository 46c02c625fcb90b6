"""apex's fused LayerNorm / RMSNorm CUDA kernels, used by the local spec when apex is installed.

The import is guarded: without apex (or with apex built without its CUDA extensions) `HAVE_APEX`
is False and the layer specs fall back to `WrappedTorchNorm`. On CPU tensors apex's modules fall
back to PyTorch's own implementation, so a model built with them still runs anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron.core.tensor_parallel.utils import group_size

if TYPE_CHECKING:
    import torch.distributed as dist

    from megatron.core.transformer.transformer_config import TransformerConfig

try:
    # apex's norm modules import their CUDA extension lazily, in __init__; importing it here
    # turns "apex installed without --cuda_ext" into HAVE_APEX=False instead of a failure at
    # model construction.
    import fused_layer_norm_cuda  # noqa: F401
    from apex.normalization import FusedLayerNorm as ApexFusedLayerNorm
    from apex.normalization import FusedRMSNorm as ApexFusedRMSNorm

    HAVE_APEX = True
except ImportError:
    HAVE_APEX = False


class FusedLayerNorm:
    """Factory returning apex's `FusedLayerNorm` or `FusedRMSNorm` as `config` asks.

    Same constructor contract as `WrappedTorchNorm`; parameter names are `weight` (and `bias`
    for LayerNorm), and apex's `reset_parameters()` sets weight one and bias zero.

    Args:
        config: The transformer configuration (`normalization`, `params_dtype`).
        hidden_size: Size of the normalised (last) dimension.
        eps: Epsilon added to the variance.
        normalization: Normalisation the spec expects; must match `config.normalization`.
        tp_group: The tensor-parallel group over which the parameters' gradients are summed
            (sequence parallelism, QK norms on a rank's heads). apex's modules cannot route
            their parameters through that sum, so with a group of more than one rank this
            returns `WrappedTorchNorm`'s norm (PyTorch's kernels, the same maths) instead.

    Raises:
        ImportError: apex (with its CUDA extensions) is not installed.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        normalization: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> torch.nn.Module:
        if not HAVE_APEX:
            raise ImportError(
                "FusedLayerNorm needs apex built with --cuda_ext; use WrappedTorchNorm instead."
            )
        # Imported here: megatron.core.transformer imports this module, so a module-level import
        # would be circular.
        from megatron.core.transformer.torch_norm import WrappedTorchNorm, resolve_normalization

        if config.layernorm_zero_centered_gamma or group_size(tp_group) > 1:
            # apex's modules have no zero-centred weight and use their parameters directly (no
            # gradient sum over tp); PyTorch's kernels do the same maths.
            return WrappedTorchNorm(config, hidden_size, eps, normalization, tp_group)

        kind = resolve_normalization(config, normalization)
        norm_cls = ApexFusedLayerNorm if kind == "LayerNorm" else ApexFusedRMSNorm
        # apex allocates its parameters in the default dtype and has no dtype argument.
        return norm_cls(hidden_size, eps=eps).to(dtype=config.params_dtype)
