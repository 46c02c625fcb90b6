"""Parallelism and precision settings shared by every model-building class.

`ModelParallelConfig` is the base of `TransformerConfig` (as in Megatron-LM), so one config object
tells a module both its shape and how it is parallelised and stored. Data parallelism (and the
FSDP engine built on it), tensor and sequence parallelism and expert parallelism are implemented;
pipeline parallelism is configured here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_positive_int(name: str, value: object) -> None:
    """Raises `ValueError` naming config field `name` unless `value` is an integer >= 1."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}; set {name}.")


@dataclass
class ModelParallelConfig:
    """How a model is split across ranks and in which dtype its parameters live.

    Attributes:
        tensor_model_parallel_size: Tensor (intra-layer) parallel degree (TP): attention heads,
            the MLP width and the vocabulary are split over this many ranks.
        pipeline_model_parallel_size: Pipeline (inter-layer) parallel degree: the decoder layers
            are split over this many stages (`megatron.core.pipeline_parallel`).
        virtual_pipeline_model_parallel_size: Model chunks (virtual stages) per pipeline rank,
            for the interleaved schedule; None: one.
        microbatch_group_size_per_vp_stage: Microbatches the interleaved schedule runs through
            one virtual stage before the next; None: the pipeline size (Megatron-LM's default).
        overlap_p2p_comm: The interleaved schedule overlaps its transfers between stages with
            its passes (a rank waits for a received tensor only when a pass needs it, for its
            sends at the end of the iteration); results are the same. Megatron-core's name
            and default (the training flags turn it on with virtual stages, as Megatron-LM's
            `--no-overlap-p2p-communication` default); the 1F1B schedule does not read it.
        context_parallel_size: Degree of sequence splitting across ranks. The process groups
            may use it; attention itself does not implement it yet.
        sequence_parallel: Megatron sequence parallelism: outside the tensor-parallel GEMMs
            (norms, dropout, residuals) each TP rank keeps 1/TP of the sequence; it needs
            `tensor_model_parallel_size > 1`.
        params_dtype: dtype the parameters are created in; the only setting that decides the
            training precision.
        fp16: Megatron's `--fp16` flag, which also sets `params_dtype=torch.float16`. Here it
            sets nothing: it requires `params_dtype=torch.float16` (`ValueError` otherwise), so a
            config asking for fp16 cannot silently train in another dtype.
        bf16: Megatron's `--bf16` flag; likewise requires `params_dtype=torch.bfloat16`.
        expert_model_parallel_size: Expert parallel degree (EP): the ranks that split the experts
            of each MoE layer among them; `num_moe_experts` must be divisible by it.
        expert_tensor_parallel_size: Tensor parallel degree of the experts (ETP): the ranks
            that split each expert's weights; None means `tensor_model_parallel_size`, as in
            Megatron-core (set so by `__post_init__`).
        gradient_accumulation_fusion: Linear layers add their weight gradients straight into
            the `main_grad` a data-parallel engine keeps (fp32 under `grad_reduce_in_fp32`), in
            the GEMM, instead of handing autograd a gradient in the parameters' dtype for the
            engine to add (`megatron.core.tensor_parallel.grad_accumulation`). The DDP engine
            honours it, and Megatron-FSDP where it sums whole gradients across microbatches
            (`megatron_fsdp_accumulate_unsharded_grads`).
        pipeline_dtype: The dtype of the tensors pipeline stages exchange; None: `params_dtype`.
        perform_initialization, use_cpu_initialization: Megatron-core's, accepted with no
            effect (upstream's minimal examples pass them): parameters are always initialised,
            on the device they are built on.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None
    overlap_p2p_comm: bool = False
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    fp16: bool = False
    bf16: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    gradient_accumulation_fusion: bool = False
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    pipeline_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            check_positive_int(name, getattr(self, name))
        if self.virtual_pipeline_model_parallel_size is not None:
            check_positive_int(
                "virtual_pipeline_model_parallel_size", self.virtual_pipeline_model_parallel_size
            )
            if self.pipeline_model_parallel_size == 1:
                raise ValueError(
                    "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1 "
                    "(virtual stages interleave pipeline stages); set it to None."
                )
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        check_positive_int("expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_model_parallel_size > 1; set "
                "sequence_parallel=False or raise tensor_model_parallel_size."
            )
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are both set; choose at most one of them.")
        if self.params_dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"params_dtype must be a floating-point torch.dtype, got {self.params_dtype!r}."
            )
        # Nothing else reads the flags, so a flag whose dtype is missing would train in fp32.
        for flag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            if getattr(self, flag) and self.params_dtype != dtype:
                raise ValueError(
                    f"{flag}=True needs params_dtype={dtype} (Megatron's --{flag} sets both); "
                    f"got params_dtype={self.params_dtype}."
                )
