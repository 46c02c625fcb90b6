"""The Mixture-of-Experts part of the Hugging Face conversion: Mixtral's and Qwen2-MoE's
`config.json` fields <-> the MoE model flags (`--num-experts`, `--moe-*`).

Both models route like this project's `TopKRouter` with a softmax score function:

- Mixtral takes the softmax over all experts' logits, keeps the top k and divides them by
  their sum. That is the softmax of the top-k logits, the router's default (softmax after the
  top-k, `--moe-router-pre-softmax` off).
- Qwen2-MoE does the same with `norm_topk_prob` true; with it false (Qwen1.5-MoE, Qwen2-57B)
  the top-k probabilities of the softmax over all experts are used as they are, which is
  `--moe-router-pre-softmax`. Its shared expert is `--moe-shared-expert-intermediate-size`,
  scaled per token by `sigmoid(x g)` (`--moe-shared-expert-gate`), and its dense layers
  (`decoder_sparse_step`, `mlp_only_layers`) are the 0s of a `--moe-layer-freq` list.

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
from megatron.training.hf_conversion.config_fields import HFConversionError, integer_field

MIXTRAL = "MixtralForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN2_MOE)

MOE_ARGS = (*MOE_MODEL_ARGS, "moe_aux_loss_coeff")
"""The MoE flags an import sets: those that fix the model, and the load-balancing weight."""

DENSE_MOE_ARGS: dict[str, Any] = {name: MOE_FLAG_DEFAULTS[name] for name in MOE_ARGS}
"""`MOE_ARGS` of a dense model: the flags' defaults."""

_BUILT_ROUTING = {
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": False,
}
"""The routing flags' values both Hugging Face models have."""


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
        experts = integer_field(config, "num_local_experts")
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
        experts = integer_field(config, "num_experts")
        width = integer_field(config, "moe_intermediate_size")
        renormalised = bool(config["norm_topk_prob"])
        shared = integer_field(config, "shared_expert_intermediate_size")
        pattern = qwen2_moe_layer_pattern(config)
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


def qwen2_moe_layer_pattern(config: Mapping[str, Any]) -> list[int]:
    """1 for each Qwen2-MoE layer that is sparse, 0 for a dense one: a layer i is sparse when
    (i + 1) is a multiple of `decoder_sparse_step` and i is not in `mlp_only_layers` (a config
    with its left-out fields filled in).

    Raises:
        HFConversionError: no layer is sparse.
    """
    step = integer_field(config, "decoder_sparse_step")
    dense = set(config["mlp_only_layers"] or [])
    layers = integer_field(config, "num_hidden_layers")
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise HFConversionError(
            f"Qwen2MoeForCausalLM whose decoder_sparse_step {step} and mlp_only_layers "
            f"{sorted(dense)} leave no sparse layer: it is a dense model; convert it as "
            "Qwen2ForCausalLM."
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


def moe_hf_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields of a `config.json` for the MoE model the flag values `args` describe
    (a checkpoint's saved arguments), and its `architectures` and `model_type`: Qwen2-MoE's
    with shared experts, else Mixtral's.

    Raises:
        HFConversionError: no Mixtral or Qwen2-MoE config computes that model (the flags
            named).
    """
    differ = [
        f"{flag(name)} {args[name]}"
        for name, value in _BUILT_ROUTING.items()
        if args.get(name, value) != value
    ]
    shared = args["moe_shared_expert_intermediate_size"]
    pattern = moe_layers(args)
    if shared is None:
        differ += [f"{flag('moe_layer_freq')} {args['moe_layer_freq']}"] if not all(pattern) else []
        differ += [f"{flag('add_qkv_bias')}"] if args["add_qkv_bias"] else []
        differ += ["--moe-router-pre-softmax"] if args["moe_router_pre_softmax"] else []
    elif not args["moe_shared_expert_gate"] or not args["add_qkv_bias"]:
        differ.append("shared experts without --moe-shared-expert-gate and --add-qkv-bias")
    if differ:
        raise HFConversionError(
            f"the checkpoint's MoE model is neither Mixtral's nor Qwen2-MoE's: {'; '.join(differ)}."
            " Only MoE models that MixtralForCausalLM or Qwen2MoeForCausalLM compute export."
        )
    common = {
        "num_experts_per_tok": args["moe_router_topk"],
        "router_aux_loss_coef": args.get("moe_aux_loss_coeff", 0.0),
        "output_router_logits": False,
    }
    if shared is None:
        return {
            **common,
            "architectures": [MIXTRAL],
            "model_type": "mixtral",
            "num_local_experts": args["num_experts"],
            "intermediate_size": args["moe_ffn_hidden_size"],
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    return {
        **common,
        "architectures": [QWEN2_MOE],
        "model_type": "qwen2_moe",
        "num_experts": args["num_experts"],
        "moe_intermediate_size": args["moe_ffn_hidden_size"],
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": not args["moe_router_pre_softmax"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [index for index, sparse in enumerate(pattern) if not sparse],
        "qkv_bias": True,
        "use_sliding_window": False,
    }
