"""The configs the validated flags describe, and config errors spelled as flags.

`core_transformer_config_from_args`, `get_megatron_ddp_config`, `get_megatron_optimizer_config`
and `get_parallel_state_kwargs` build what the library takes from flags `validate_args()` has
checked; `megatron.training.arguments` re-exports them. A config's own `ValueError` names its
fields; `ddp_config_from_flags`, `optimizer_config_from_flags` and
`transformer_config_from_flags` (for the MoE, FP8, multi-token prediction, sliding-window,
softmax and GLU fields) re-raise it naming the flags that set them, as the user typed them.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.activations import quick_gelu, squared_relu
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.distributed.fsdp.mixed_precision import PRECISION_DTYPES
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.training.flag_groups.cuda_graphs import full_iteration_cuda_graph
from megatron.training.flag_groups.mla import mla_config_fields
from megatron.training.flag_groups.precision import FP8_FIELDS, grad_reduce_in_fp32
from megatron.training.flag_groups.yarn import (
    MLA_YARN_FIELDS,
    YARN_CONFIG_FIELDS,
    yarn_config_fields,
)
from megatron.training.flag_spelling import flag, given

FSDP_DTYPES: dict[str, torch.dtype | None] = {
    **{name: dtype for dtype, name in PRECISION_DTYPES.items()},
    "auto": None,
}
"""Values of the `--megatron-fsdp-*-dtype` flags: the dtypes `MixedPrecisionPolicy` takes, by
their short names; "auto" (None) lets the engine derive it."""

_DDP_FIELD_DESTS = {
    "bucket_size": "ddp_bucket_size",
    "average_in_collective": "ddp_average_in_collective",
}
"""`DistributedDataParallelConfig` fields whose flag has another name; the others share theirs
(`check_for_nan_in_grad` has none: see `get_megatron_ddp_config`)."""

_FLAG_VALUES: dict[str, Any] = {
    "True": True,
    "False": False,
    "None": "auto",  # only the dtype fields show None in the config's messages
    **{str(dtype): name for name, dtype in FSDP_DTYPES.items() if dtype is not None},
}
"""How a value the config's messages print (`repr`) is spelled on the command line."""


def ddp_config_from_flags(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """`get_megatron_ddp_config(args)`; its `ValueError` is re-raised naming flags, not fields."""
    try:
        return get_megatron_ddp_config(args)
    except ValueError as error:
        raise ValueError(_spell_as_flags(str(error), args)) from error


def _spell_as_flags(message: str, args: argparse.Namespace) -> str:
    """`message` with each `DistributedDataParallelConfig` field that has a flag written as that
    flag, and `field=value` as the flag and its value (`--outer-dp-sharding-strategy optim`)."""
    dests = {
        field.name: _DDP_FIELD_DESTS.get(field.name, field.name)
        for field in dataclasses.fields(DistributedDataParallelConfig)
    }
    dests = {field: dest for field, dest in dests.items() if hasattr(args, dest)}
    if getattr(args, "accumulate_allreduce_grads_in_fp32", False):
        # Megatron-LM's name of --grad-reduce-in-fp32 sets the field too: name the one typed.
        dests["grad_reduce_in_fp32"] = "accumulate_allreduce_grads_in_fp32"
    fields = "|".join(dests)
    pattern = rf"(?:DistributedDataParallelConfig\.)?\b({fields})\b(?:=('[^']*'|[\w.]*\w))?"

    def spell(match: re.Match) -> str:
        dest, value = dests[match[1]], match[2]
        if value is None:
            return flag(dest)
        return given(dest, _FLAG_VALUES.get(value, value.strip("'")))

    message = re.sub(pattern, spell, message)
    for text, value in _FLAG_VALUES.items():
        if text.startswith("torch."):
            message = message.replace(text, value)
    return message


def optimizer_config_from_flags(args: argparse.Namespace) -> OptimizerConfig:
    """`get_megatron_optimizer_config(args)`; its `ValueError` re-raised naming the flags."""
    try:
        return get_megatron_optimizer_config(args)
    except ValueError as error:
        dests = {"weight_decay": "start_weight_decay"}  # the field the other flags feed

        def spell(match: re.Match) -> str:
            return given(dests.get(match[1], match[1]), match[2])

        message = re.sub(r"OptimizerConfig\.(\w+)=(\S+?)(?=[ ,;:)]|$)", spell, str(error))
        raise ValueError(message) from error


def transformer_config_from_flags(args: argparse.Namespace) -> TransformerConfig:
    """`core_transformer_config_from_args(args)`; its `ValueError` is re-raised naming the MoE,
    FP8, multi-latent attention, multi-token prediction, sliding-window, softmax, GLU,
    attention-backend and (expert and tensor) parallel-size flags instead of the config fields
    they set."""
    try:
        return core_transformer_config_from_args(args)
    except ValueError as error:
        fields = "|".join(_FIELD_DESTS) + "|" + _FIELD_PATTERNS

        def spell(match: re.Match) -> str:
            dest = _FIELD_DESTS.get(match[1], match[1])
            if match[2] is None:
                return flag(dest)
            value = match[2].strip("'")
            return given(dest, {"True": True, "False": False}.get(value, value))

        pattern = rf"\b({fields})\b(?:=('[^']*'|-?[\w.]*\w))?"
        raise ValueError(re.sub(pattern, spell, str(error))) from error


_FIELD_DESTS = {
    "num_moe_experts": "num_experts",
    "expert_model_parallel_size": "expert_model_parallel_size",
    "expert_tensor_parallel_size": "expert_tensor_parallel_size",
    "tensor_model_parallel_size": "tensor_model_parallel_size",
    "fp8": "fp8_format",
    **{field: dest for dest, field in MLA_YARN_FIELDS.items()},
    **{field: dest for dest, field in YARN_CONFIG_FIELDS.items()},
}
"""The MoE, FP8 and YaRN (multi-latent attention's and standard attention's) `TransformerConfig`
fields whose flag is not `--<field>` with dashes, or that `_FIELD_PATTERNS` does not match; a
value maps to the flag of that name."""

_FIELD_PATTERNS = (
    r"moe_\w+|fp8_\w+|mtp_\w+|first_last_layers_bf16|num_layers_at_(?:start|end)_in_bf16|"
    r"window_size|window_attn_skip_freq|softmax_type|glu_linear_offset|"
    r"activation_func_clamp_value|attention_backend|"
    r"q_lora_rank|kv_lora_rank|qk_head_dim|qk_pos_emb_head_dim|v_head_dim|rope_type|"
    r"rotary_scaling_factor|mscale_all_dim|mscale|rotary_percent|rotary_interleaved|qk_l2_norm"
)
"""The other MoE, FP8, multi-latent attention and multi-token prediction fields, and the
sliding-window, softmax, GLU and attention-backend ones, each set by `--<field>` with dashes
(`fp8_wgrad=False` by `--no-fp8-wgrad`)."""


def core_transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """The `TransformerConfig` the flags describe.

    Args:
        args: Validated by `validate_args` (it fills `params_dtype` and the derived widths).

    Returns:
        The model's config: an `MLATransformerConfig` with `--multi-latent-attention`.
    """
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    return config_class(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        overlap_p2p_comm=args.overlap_p2p_comm,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        context_parallel_size=args.context_parallel_size,
        params_dtype=args.params_dtype,
        fp16=args.fp16,
        bf16=args.bf16,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.layernorm_epsilon,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu or args.quick_geglu,
        activation_func=mlp_activation_func(args),
        glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_func_clamp_value,
        # SwiGLU is the activation with a fused kernel here (Megatron-LM's other activations
        # read --no-bias-gelu-fusion, a no-op here).
        bias_activation_fusion=args.swiglu and args.bias_swiglu_fusion,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        init_method_std=args.init_method_std,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=args.recompute_modules,
        layernorm_zero_centered_gamma=args.layernorm_zero_centered_gamma,
        qk_layernorm=args.qk_layernorm,
        qk_l2_norm=args.qk_l2_norm,
        rotary_interleaved=args.rotary_interleaved,
        apply_rope_fusion=args.apply_rope_fusion,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        attention_backend=args.attention_backend,
        cp_comm_type=args.cp_comm_type[0],
        softmax_type=args.softmax_type,
        window_size=args.window_size,
        window_attn_skip_freq=args.window_attn_skip_freq,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        compile_layers=args.compile_layers,
        compile_backend=args.compile_backend,
        compile_cpp_wrapper=args.compile_cpp_wrapper,
        cuda_graph_impl="full_iteration" if full_iteration_cuda_graph(args) else "none",
        seq_length=args.seq_length,
        num_moe_experts=args.num_experts,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        # Read by the routers: their auxiliary losses keep their weight against a summed loss.
        calculate_per_token_loss=args.calculate_per_token_loss,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_dtype=args.moe_router_dtype,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_input_jitter_eps=args.moe_input_jitter_eps,
        moe_router_force_load_balancing=args.moe_router_force_load_balancing,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_pad_dispatch_to_worst_case=args.moe_pad_dispatch_to_worst_case,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_layer_freq=args.moe_layer_freq,
        moe_per_layer_logging=args.moe_per_layer_logging,
        **{name: getattr(args, name) for name in FP8_FIELDS},
        **mla_config_fields(args),
        **yarn_config_fields(args),
    )


def mlp_activation_func(args: argparse.Namespace) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation the flags name (upstream's): SiLU for `--swiglu`, quick GELU for
    `--quick-geglu` (both gated), relu^2 for `--squared-relu`, else GELU."""
    if args.swiglu:
        return F.silu
    if args.quick_geglu:
        return quick_gelu
    return squared_relu if args.squared_relu else F.gelu


def get_megatron_ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The `DistributedDataParallelConfig` the flags describe (for DDP or Megatron-FSDP).

    Args:
        args: Validated by `validate_args`.

    Returns:
        The data-parallel config; `use_megatron_fsdp` selects the engine. Its
        `check_for_nan_in_grad` is off whatever `--check-for-nan-in-loss-and-grad` says: the
        training loop checks the global gradient norm instead (see `train_step`).
    """
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32(args),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        # Not --check-for-nan-in-loss-and-grad: the engine checks each rank's gradients before
        # the all-reduce, so one rank would raise while the others wait in the all-reduce until
        # the timeout. train_step checks the global grad norm instead, the same on every rank.
        check_for_nan_in_grad=False,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
        use_megatron_fsdp=args.use_megatron_fsdp,
        # Megatron-LM's parser default (optim_grads_params) is read by Megatron-FSDP only.
        data_parallel_sharding_strategy=(
            args.data_parallel_sharding_strategy if args.use_megatron_fsdp else "no_shard"
        ),
        outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
        fsdp_all_gather_in_start_param_sync=args.fsdp_all_gather_in_start_param_sync,
        use_symm_mem=args.use_symm_mem,
        suggested_communication_unit_size=args.suggested_communication_unit_size,
        megatron_fsdp_main_params_dtype=FSDP_DTYPES[args.megatron_fsdp_main_params_dtype],
        megatron_fsdp_main_grads_dtype=FSDP_DTYPES[args.megatron_fsdp_main_grads_dtype],
        megatron_fsdp_grad_comm_dtype=FSDP_DTYPES[args.megatron_fsdp_grad_comm_dtype],
        megatron_fsdp_keep_unsharded_params=args.megatron_fsdp_keep_unsharded_params,
        megatron_fsdp_accumulate_unsharded_grads=args.megatron_fsdp_accumulate_unsharded_grads,
        fp8_param_gather=args.fp8_param_gather,
        keep_fp8_transpose_cache=args.keep_fp8_transpose_cache,
    )


def get_megatron_optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """The `OptimizerConfig` the flags describe (weight decay: the schedule's start value)."""
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.start_weight_decay,
        apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        fp16=args.fp16,
        bf16=args.bf16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
    )


def get_parallel_state_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of `parallel_state.initialize_model_parallel()` the flags describe.

    Args:
        args: Validated by `validate_args`.

    Returns:
        `initialize_model_parallel(**kwargs)`'s arguments.
    """
    return dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        create_all_gather_group=args.create_all_gather_group,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
