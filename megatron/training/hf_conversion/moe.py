"""The Mixture-of-Experts part of the Hugging Face conversion: Mixtral's, Qwen2-MoE's and
Qwen3-MoE's `config.json` fields <-> the MoE model flags (`--num-experts`, `--moe-*`), and the
spelling of every MoE flag an import sets (DeepSeek-V3's routing flags too, whose values
`deepseek_v3.py` reads).

The three models route like this project's `TopKRouter` with a softmax score function:

- Mixtral takes the softmax over all experts' logits, keeps the top k and divides them by
  their sum. That is the softmax of the top-k logits, the router's default (softmax after the
  top-k, `--moe-router-pre-softmax` off).
- Qwen2-MoE does the same with `norm_topk_prob` true; with it false (Qwen1.5-MoE, Qwen2-57B)
  the top-k probabilities of the softmax over all experts are used as they are, which is
  `--moe-router-pre-softmax`. Its shared expert is `--moe-shared-expert-intermediate-size`,
  scaled per token by `sigmoid(x g)` (`--moe-shared-expert-gate`), and its dense layers
  (`decoder_sparse_step`, `mlp_only_layers`) are the 0s of a `--moe-layer-freq` list.
- Qwen3-MoE routes and places its sparse layers as Qwen2-MoE, without a shared expert.

Every function takes or gives the flags' values by `argparse` destination, as
`config.model_args_from_hf_config` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron.core.transformer.moe.moe_config import layer_pattern
from megatron.training.checkpointing import MOE_MODEL_ARGS
from megatron.training.configs_from_args import flag
from megatron.training.flag_groups.moe import DEFAULTS as MOE_FLAG_DEFAULTS
from megatron.training.hf_conversion.config_fields import (
    HFConversionError,
    aliased_field,
    integer_field,
)

MIXTRAL = "MixtralForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)

MOE_ARGS = (*MOE_MODEL_ARGS, "moe_aux_loss_coeff", "moe_router_dtype")
"""The MoE flags an import sets: those that fix the model, the load-balancing weight and the
precision of the router's logits."""

DENSE_MOE_ARGS: dict[str, Any] = {name: MOE_FLAG_DEFAULTS[name] for name in MOE_ARGS}
"""`MOE_ARGS` of a dense model: the flags' defaults."""

_BUILT_ROUTING = {
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": False,
}
"""The routing flags' values Mixtral, Qwen2-MoE and Qwen3-MoE have."""


def moe_args_from_hf_config(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The values of `MOE_ARGS` for a config of architecture `name` (the dense defaults for a
    dense architecture), its left-out fields filled in (`config_fields.with_defaults`).

    Raises:
        HFConversionError: a field this project's MoE layer does not compute (named).
    """
    if name not in MOE_ARCHITECTURES:
        return dict(DENSE_MOE_ARGS)
    layers = integer_field(config, "num_hidden_layers")
    topk = integer_field(config, "num_experts_per_tok")
    if name == MIXTRAL:
        experts = _experts(config, "num_local_experts", "num_experts")
        width = integer_field(config, "intermediate_size")
        renormalised, shared, pattern = True, None, [1] * layers
        jitter = config["router_jitter_noise"] or 0.0
        if jitter:
            raise HFConversionError(
                f"{name} with router_jitter_noise {jitter}: transformers multiplies the "
                "input of the router and of the experts by noise during training, which is not "
                "built (--moe-input-jitter-eps jitters the router's input only); convert a "
                "config with router_jitter_noise 0."
            )
    else:
        experts = _experts(config, "num_experts", "num_local_experts")
        width = integer_field(config, "moe_intermediate_size")
        renormalised = bool(config["norm_topk_prob"])
        shared = (
            integer_field(config, "shared_expert_intermediate_size") if name == QWEN2_MOE else None
        )
        pattern = sparse_layer_pattern(config, name)
    if topk > experts:
        raise HFConversionError(
            f"num_experts_per_tok {topk} exceeds the {experts} experts of config.json."
        )
    if topk == 1 and renormalised:
        raise HFConversionError(
            f"{name} with num_experts_per_tok 1 and renormalised routing weights (each token's "
            "weight is 1) is not built: the router's top-1 softmax needs "
            "--moe-router-pre-softmax, whose weight is the probability itself."
        )
    return {
        **DENSE_MOE_ARGS,
        "num_experts": experts,
        "moe_ffn_hidden_size": width,
        "moe_router_topk": topk,
        "moe_router_pre_softmax": not renormalised,
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": shared is not None,
        "moe_layer_freq": 1 if all(pattern) else pattern,
        "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef") or 0.0),
    }


def _experts(config: Mapping[str, Any], key: str, alias: str) -> int:
    """The number of experts, stated as `key` or (transformers' other name) `alias`."""
    return integer_field({key: aliased_field(config, key, alias)}, key)


def sparse_layer_pattern(config: Mapping[str, Any], name: str) -> list[int]:
    """1 for each layer of a Qwen2-MoE or Qwen3-MoE (`name`) that is sparse, 0 for a dense
    one: a layer i is sparse when (i + 1) is a multiple of `decoder_sparse_step` and i is not
    in `mlp_only_layers` (a config with its left-out fields filled in).

    Raises:
        HFConversionError: no layer is sparse.
    """
    step = integer_field(config, "decoder_sparse_step")
    dense = set(config["mlp_only_layers"] or [])
    layers = integer_field(config, "num_hidden_layers")
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise HFConversionError(
            f"{name} whose decoder_sparse_step {step} and mlp_only_layers "
            f"{sorted(dense)} leave no sparse layer: it is a dense model; convert it as "
            f"{name.replace('Moe', '')}."
        )
    return pattern


def moe_layers(args: Mapping[str, Any]) -> list[bool]:
    """Whether each layer of the model `args` describes is an MoE layer (`--moe-layer-freq`)."""
    return layer_pattern(args["num_layers"], args.get("num_experts"), args.get("moe_layer_freq", 1))


def moe_flags(args: Mapping[str, Any]) -> list[str]:
    """The MoE flags for the values `moe_args_from_hf_config` gives (none for a dense model)."""
    if args.get("num_experts") is None:
        return []
    flags = [
        "--num-experts", args["num_experts"],
        "--moe-ffn-hidden-size", args["moe_ffn_hidden_size"],
        "--moe-router-topk", args["moe_router_topk"],
    ]  # fmt: skip
    if args["moe_router_pre_softmax"]:
        flags.append("--moe-router-pre-softmax")
    if args["moe_router_score_function"] != "softmax":
        flags += ["--moe-router-score-function", args["moe_router_score_function"]]
    if args["moe_router_enable_expert_bias"]:
        flags.append("--moe-router-enable-expert-bias")
    if args["moe_router_topk_scaling_factor"] is not None:
        flags += ["--moe-router-topk-scaling-factor", args["moe_router_topk_scaling_factor"]]
    if args["moe_router_num_groups"] is not None:
        flags += ["--moe-router-num-groups", args["moe_router_num_groups"]]
        flags += ["--moe-router-group-topk", args["moe_router_group_topk"]]
    if args["moe_router_dtype"] is not None:
        flags += ["--moe-router-dtype", args["moe_router_dtype"]]
    if args["moe_shared_expert_intermediate_size"] is not None:
        flags += ["--moe-shared-expert-intermediate-size"]
        flags += [args["moe_shared_expert_intermediate_size"]]
    if args["moe_shared_expert_gate"]:
        flags.append("--moe-shared-expert-gate")
    if args["moe_layer_freq"] != 1:
        flags += ["--moe-layer-freq", "[" + ",".join(map(str, args["moe_layer_freq"])) + "]"]
    if args["moe_aux_loss_coeff"]:
        flags += ["--moe-aux-loss-coeff", args["moe_aux_loss_coeff"]]
    return [str(value) for value in flags]


def moe_architecture(args: Mapping[str, Any]) -> str:
    """The Hugging Face architecture whose MoE layers the flag values `args` describe, by what
    tells the three apart: Qwen2-MoE's shared expert, Qwen3-MoE's query-key norms, else
    Mixtral's (`moe_hf_config` checks the rest)."""
    if args["moe_shared_expert_intermediate_size"] is not None:
        return QWEN2_MOE
    return QWEN3_MOE if args["qk_layernorm"] else MIXTRAL


def moe_hf_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields of a `config.json` for the MoE model the flag values `args` describe
    (a checkpoint's saved arguments), and its `architectures` and `model_type`: those of
    `moe_architecture(args)`.

    Raises:
        HFConversionError: no Mixtral, Qwen2-MoE or Qwen3-MoE config computes that model (the
            flags named).
    """
    differ = [
        f"{flag(name)} {args[name]}"
        for name, value in _BUILT_ROUTING.items()
        if args.get(name, value) != value
    ]
    name = moe_architecture(args)
    pattern = moe_layers(args)
    if name == MIXTRAL:
        differ += [f"{flag('moe_layer_freq')} {args['moe_layer_freq']}"] if not all(pattern) else []
        differ += [f"{flag('add_qkv_bias')}"] if args["add_qkv_bias"] else []
        differ += ["--moe-router-pre-softmax"] if args["moe_router_pre_softmax"] else []
    elif name == QWEN2_MOE and (
        not args["moe_shared_expert_gate"] or not args["add_qkv_bias"] or args["qk_layernorm"]
    ):
        differ.append(
            "shared experts without --moe-shared-expert-gate and --add-qkv-bias, or with "
            "--qk-layernorm"
        )
    if differ:
        raise HFConversionError(
            f"the checkpoint's MoE model is not one of {', '.join(MOE_ARCHITECTURES)}: "
            f"{'; '.join(differ)}. Only MoE models that one of them computes export."
        )
    common = {
        "num_experts_per_tok": args["moe_router_topk"],
        "router_aux_loss_coef": args.get("moe_aux_loss_coeff", 0.0),
        "output_router_logits": False,
    }
    if name == MIXTRAL:
        return {
            **common,
            "architectures": [MIXTRAL],
            "model_type": "mixtral",
            "num_local_experts": args["num_experts"],
            "intermediate_size": args["moe_ffn_hidden_size"],
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    qwen = {
        **common,
        "num_experts": args["num_experts"],
        "moe_intermediate_size": args["moe_ffn_hidden_size"],
        "norm_topk_prob": not args["moe_router_pre_softmax"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [index for index, sparse in enumerate(pattern) if not sparse],
        "use_sliding_window": False,
    }
    if name == QWEN3_MOE:
        return {**qwen, "architectures": [QWEN3_MOE], "model_type": "qwen3_moe"}
    return {
        **qwen,
        "architectures": [QWEN2_MOE],
        "model_type": "qwen2_moe",
        "shared_expert_intermediate_size": args["moe_shared_expert_intermediate_size"],
        "qkv_bias": True,
    }
