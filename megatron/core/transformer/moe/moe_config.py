"""Validation of the Mixture of Experts fields of `TransformerConfig`.

The fields themselves live on `TransformerConfig` (Megatron-core's names and defaults); this
module checks them once, in `TransformerConfig.__post_init__`, so that a bad value fails when the
config is built, with a message naming the field and the fix, rather than inside the first
forward. Upstream values that are not built here are refused by name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron.core.model_parallel_config import check_positive_int

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = (None, "fp32", "fp64")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
TOKEN_DISPATCHER_TYPES = ("allgather", "alltoall")
TOKEN_DROP_POLICIES = ("probs", "position")

_UNBUILT_VALUES = {
    "moe_router_score_function": {"sqrtsoftplus": "the sqrt-softplus score function"},
    "moe_router_load_balancing_type": {
        "sinkhorn": "Sinkhorn routing",
        "global_aux_loss": "the global-batch auxiliary loss",
        "quantile_balancing": "quantile-balancing routing",
    },
    "moe_token_dispatcher_type": {
        "flex": "the DeepEP / HybridEP dispatcher",
        "alltoall_seq": "the alltoall_seq dispatcher (removed upstream too)",
    },
}


def _choice(config: TransformerConfig, name: str, choices: tuple) -> None:
    value = getattr(config, name)
    unbuilt = _UNBUILT_VALUES.get(name, {})
    if isinstance(value, str) and value in unbuilt:
        raise ValueError(
            f"{name}={value!r} ({unbuilt[value]}) is not built; choose among {choices}."
        )
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


def check_moe_config(config: TransformerConfig) -> None:
    """Checks the MoE fields of `config` and fills `moe_ffn_hidden_size`.

    Raises:
        ValueError: a field has a bad or unbuilt value, or fields contradict each other; the
            message names the field and the fix.
    """
    if config.num_moe_experts is None:
        if config.expert_model_parallel_size > 1:
            raise ValueError(
                f"expert_model_parallel_size={config.expert_model_parallel_size} needs MoE "
                "layers; set num_moe_experts or expert_model_parallel_size=1."
            )
        return
    check_positive_int("num_moe_experts", config.num_moe_experts)
    if config.num_moe_experts % config.expert_model_parallel_size:
        raise ValueError(
            f"num_moe_experts ({config.num_moe_experts}) must be divisible by "
            f"expert_model_parallel_size ({config.expert_model_parallel_size}): each "
            "expert-parallel rank holds the same number of experts; change one of them."
        )
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    check_positive_int("moe_ffn_hidden_size", config.moe_ffn_hidden_size)
    _check_router(config)
    _check_dispatch(config)
    _check_shared_experts(config)
    _check_layer_freq(config)


def _check_router(config: TransformerConfig) -> None:
    experts, topk = config.num_moe_experts, config.moe_router_topk
    check_positive_int("moe_router_topk", topk)
    if topk > experts:
        raise ValueError(
            f"moe_router_topk ({topk}) exceeds num_moe_experts ({experts}); choose at most "
            f"{experts}."
        )
    _choice(config, "moe_router_score_function", SCORE_FUNCTIONS)
    _choice(config, "moe_router_dtype", ROUTER_DTYPES)
    if isinstance(config.moe_router_load_balancing_type, list):
        raise ValueError(
            "moe_router_load_balancing_type as a list of types is not built; give one of "
            f"{LOAD_BALANCING_TYPES}."
        )
    _choice(config, "moe_router_load_balancing_type", LOAD_BALANCING_TYPES)
    if topk == 1 and config.moe_router_score_function == "softmax":
        if not config.moe_router_pre_softmax:
            raise ValueError(
                "moe_router_topk=1 with the softmax score function needs "
                "moe_router_pre_softmax=True (a softmax over one score is 1, whose gradient "
                "is 0, so the router would not learn)."
            )
    _check_groups(config)
    if config.moe_router_enable_expert_bias:
        if config.moe_router_score_function != "sigmoid":
            raise ValueError(
                "moe_router_enable_expert_bias needs moe_router_score_function='sigmoid' (as "
                "in Megatron-core); set it, or disable the expert bias."
            )
        if not 0 < config.moe_router_bias_update_rate < math.inf:
            raise ValueError(
                "moe_router_bias_update_rate must be finite and > 0 with the expert bias, got "
                f"{config.moe_router_bias_update_rate}."
            )
    if config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type == "none":
        raise ValueError(
            f"moe_aux_loss_coeff={config.moe_aux_loss_coeff} has no effect with "
            "moe_router_load_balancing_type='none'; choose 'aux_loss' or 'seq_aux_loss', or set "
            "moe_aux_loss_coeff=0."
        )


def _check_groups(config: TransformerConfig) -> None:
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        raise ValueError(
            "group-limited routing needs both moe_router_num_groups and moe_router_group_topk "
            f"(got {groups!r} and {group_topk!r}); set both or neither."
        )
    check_positive_int("moe_router_num_groups", groups)
    check_positive_int("moe_router_group_topk", group_topk)
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if experts % groups:
        raise ValueError(
            f"num_moe_experts ({experts}) must be divisible by moe_router_num_groups "
            f"({groups}); choose a divisor of {experts}."
        )
    if group_topk > groups:
        raise ValueError(
            f"moe_router_group_topk ({group_topk}) exceeds moe_router_num_groups ({groups})."
        )
    # A group is scored by the sum of its best topk // group_topk experts, and the selected
    # groups must hold at least topk experts.
    if group_topk > topk or topk // group_topk > experts // groups:
        raise ValueError(
            f"moe_router_group_topk ({group_topk}) must be <= moe_router_topk ({topk}) and "
            f"moe_router_topk // moe_router_group_topk <= experts per group "
            f"({experts // groups}); change moe_router_group_topk or moe_router_num_groups."
        )


def _check_dispatch(config: TransformerConfig) -> None:
    _choice(config, "moe_token_dispatcher_type", TOKEN_DISPATCHER_TYPES)
    _choice(config, "moe_token_drop_policy", TOKEN_DROP_POLICIES)
    if config.moe_pad_expert_input_to_capacity and config.moe_expert_capacity_factor is None:
        raise ValueError(
            "moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (the capacity to "
            "pad to); set it, or disable the padding."
        )
    if config.moe_pad_dispatch_to_worst_case:
        if config.moe_expert_capacity_factor is not None:
            raise ValueError(
                "moe_pad_dispatch_to_worst_case pads dropless token exchanges, but "
                f"moe_expert_capacity_factor is {config.moe_expert_capacity_factor}; drop one "
                "of them."
            )
        why = None
        if not config.moe_grouped_gemm:
            why = "without moe_grouped_gemm"
        elif config.fp8 is not None and not config.fp8_wgrad:
            why = f"in FP8 ({config.fp8}) with fp8_wgrad=False"
        if why is not None:
            raise ValueError(
                "moe_pad_dispatch_to_worst_case spares the host read of the token counts, but "
                f"the experts {why} read them on the host anyway; use moe_grouped_gemm (in FP8 "
                "with FP8 weight gradients), or drop moe_pad_dispatch_to_worst_case."
            )


def _check_shared_experts(config: TransformerConfig) -> None:
    size = config.moe_shared_expert_intermediate_size
    if size is None:
        for name in ("moe_shared_expert_gate", "moe_shared_expert_overlap"):
            if getattr(config, name):
                raise ValueError(
                    f"{name} needs shared experts; set moe_shared_expert_intermediate_size."
                )
        return
    check_positive_int("moe_shared_expert_intermediate_size", size)
    if config.add_bias_linear:
        raise ValueError(
            "shared experts have no biases (as in Megatron-core); set add_bias_linear=False "
            "(--disable-bias-linear) or drop moe_shared_expert_intermediate_size."
        )
    if config.moe_shared_expert_overlap:
        raise ValueError(
            "moe_shared_expert_overlap is not built (the shared experts run after the routed "
            "ones); set it to False."
        )


def _check_layer_freq(config: TransformerConfig) -> None:
    freq = config.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != config.num_layers or any(v not in (0, 1) for v in freq):
            raise ValueError(
                f"moe_layer_freq as a list needs one 0 (dense) or 1 (MoE) per layer "
                f"({config.num_layers}), got {freq}."
            )
        return
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ValueError(
            f"moe_layer_freq must be an integer >= 1 (every N-th layer is an MoE layer) or a "
            f"list of 0/1 per layer, got {freq!r}; expand a pattern string such as "
            "'([1]*3+[0])*2' into its list first."
        )


def layer_pattern(
    num_layers: int, num_moe_experts: int | None, moe_layer_freq: int | list[int]
) -> list[bool]:
    """Whether each layer (0-based) is an MoE layer: all False without experts, else per
    `moe_layer_freq` (an int N: layers 0, N, 2N, ...; a list: its 1s)."""
    if num_moe_experts is None:
        return [False] * num_layers
    if isinstance(moe_layer_freq, list):
        return [bool(v) for v in moe_layer_freq]
    return [i % moe_layer_freq == 0 for i in range(num_layers)]


def moe_layer_pattern(config: TransformerConfig) -> list[bool]:
    """`layer_pattern` of a config."""
    return layer_pattern(config.num_layers, config.num_moe_experts, config.moe_layer_freq)
