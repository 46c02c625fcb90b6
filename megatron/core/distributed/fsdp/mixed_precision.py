"""`MixedPrecisionPolicy`: the dtypes of Megatron-FSDP's main weights, gradients and communication.

Three dtypes are in play per parameter group. The *compute* weights keep the dtype the module
was built in, the model dtype (bf16 for a bf16 model); the *main* weights, which the optimizer
steps, are kept in `main_params_dtype` (fp32 by default, so small updates are not lost to bf16
rounding); gradients accumulate across microbatches in `main_grads_dtype` and travel over the
network in `grad_comm_dtype`. With `fp8_param_gather` the compute weights of FP8 linear layers
(`megatron.core.fp8`) are kept and all-gathered as FP8 bytes with one scale each, instead of in
the model dtype (`fp8_gather.py`); `keep_fp8_transpose_cache` keeps their transposed copies
from one change of the main weights to the next.

The policy is the only check of these rules: `DistributedDataParallelConfig` builds one from its
`megatron_fsdp_*_dtype`, `fp8_param_gather` and `keep_fp8_transpose_cache` fields, and reports
its errors under those names (the training flags, under theirs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PRECISION_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}
"""The dtypes a policy takes (besides None), with their short names (the values of the
`--megatron-fsdp-*-dtype` flags)."""


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of main weights, gradient accumulation and gradient communication.

    Attributes:
        main_params_dtype: dtype of the sharded main weights the optimizer steps. None: the
            model (compute) dtype, so no separate copy is kept.
        main_grads_dtype: dtype gradients accumulate in across microbatches. None: the model
            dtype.
        grad_comm_dtype: dtype of gradient reductions. None: `main_grads_dtype`.
        fp8_param_gather: the weights of linear layers that compute in FP8 are cast to FP8 once
            per change of the main weights and travel (and stay whole) as FP8; the other
            parameters are unaffected (Megatron-LM's `fp8_param_gather`).
        keep_fp8_transpose_cache: with `fp8_param_gather`, the transposed copy of each FP8
            weight that the input-gradient GEMM uses is made once per change of the main
            weights and kept until the next, instead of made in each backward that gathers the
            weight (ZeRO-3) and freed with it: 1 byte per element of the whole FP8 weights held
            for the whole step (Megatron-LM's `keep_fp8_transpose_cache`). Weights that stay
            whole (ZeRO-0/1/2) keep their transposes that long anyway.
    """

    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None
    fp8_param_gather: bool = False
    keep_fp8_transpose_cache: bool = False

    def __post_init__(self) -> None:
        for name in ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, name)
            if value is not None and value not in PRECISION_DTYPES:
                raise ValueError(
                    f"MixedPrecisionPolicy.{name}={value!r} is not supported: use one of "
                    f"{', '.join(map(str, PRECISION_DTYPES))} or None."
                )
        if self.main_params_dtype == torch.float16:
            raise ValueError(
                "MixedPrecisionPolicy.main_params_dtype=fp16 is not supported: fp16 main "
                "weights lose small updates and overflow without loss scaling, so training "
                "diverges; use torch.float32 (the default) or torch.bfloat16."
            )
        if self.keep_fp8_transpose_cache and not self.fp8_param_gather:
            raise ValueError(
                "MixedPrecisionPolicy.keep_fp8_transpose_cache=True keeps the transposes of the "
                "FP8 weights that fp8_param_gather=True keeps, and without it there are none "
                "(each FP8 layer casts its weight after the gather, and transposes the copy, "
                "itself): add fp8_param_gather=True or drop keep_fp8_transpose_cache."
            )

    def resolve(self, model_dtype: torch.dtype) -> ResolvedPrecision:
        """The concrete dtypes for a parameter group whose compute weights are `model_dtype`."""
        main_grads = self.main_grads_dtype or model_dtype
        return ResolvedPrecision(
            main_params=self.main_params_dtype or model_dtype,
            main_grads=main_grads,
            grad_comm=self.grad_comm_dtype or main_grads,
        )


@dataclass(frozen=True)
class ResolvedPrecision:
    """The dtypes of one parameter group's main weights and gradients, with no None left."""

    main_params: torch.dtype
    main_grads: torch.dtype
    grad_comm: torch.dtype
