"""DeepSeek-V3's Hugging Face `config.json` (`DeepseekV3ForCausalLM`) <-> the flags of this
project's GPT model with multi-latent attention, DeepSeek-V3's routing and multi-token prediction.

What transformers computes from the config, in this project's flags:

- **Attention**: `--multi-latent-attention` with `q_lora_rank`, `kv_lora_rank`,
  `qk_nope_head_dim` (`--qk-head-dim`), `qk_rope_head_dim` (`--qk-pos-emb-head-dim`) and
  `v_head_dim`, and the two latent norms (`--qk-layernorm`). With `rope_interleave` (DeepSeek's
  layout, transformers' default) the rotated channels are rotated in adjacent pairs, as this
  project's multi-latent attention rotates them, so the weights convert unchanged; without it
  transformers pairs channel i with i + d/2, and the rotated rows of the query up-projection and
  of the key/value down-projection are permuted into adjacent pairs (`tensors.py`, layouts
  "mla_q" and "mla_kv_down").
- **RoPE**: "default" is `--rope-type rope`; "yarn" is `--rope-type yarn` with `factor`
  (`--rotary-scaling-factor`), `original_max_position_embeddings`, `beta_fast`, `beta_slow`,
  `mscale` and `mscale_all_dim` (the `--yarn-*` and `--mscale*` flags).
- **MLP**: the first `first_k_dense_replace` layers are dense (`intermediate_size`), the others
  MoE layers (`--moe-layer-freq`) of `n_routed_experts` experts of `moe_intermediate_size` and
  one ungated shared MLP `n_shared_experts` times as wide. Routing: sigmoid scores
  (`--moe-router-score-function sigmoid`), shifted by `e_score_correction_bias` for the choice
  only (`--moe-router-enable-expert-bias`: DeepSeek-V3's auxiliary-loss-free balancing, its
  bias updated in training at `--moe-router-bias-update-rate`), the top `num_experts_per_tok`
  among the experts of the `topk_group` best of `n_group` groups (`--moe-router-num-groups`,
  `--moe-router-group-topk`; a group scores the sum of its best two experts), the chosen
  scores renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`
  (`--moe-router-topk-scaling-factor`); the router's logits in fp32, as transformers keeps them
  (`--moe-router-dtype fp32`).
- **Multi-token prediction**: `num_nextn_predict_layers` depths, stored after the decoder's
  layers as `model.layers.<num_hidden_layers + i>` (`--mtp-num-layers`, where the weights hold
  them: `mtp_depths`).

Every function takes or gives the flags' values by `argparse` destination, as
`config.model_args_from_hf_config` does, and reads a config with its left-out fields filled in
(`config_fields.with_defaults`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from megatron.core.transformer.transformer_config import yarn_mscale
from megatron.training.checkpointing import GPT_OSS_MODEL_ARGS
from megatron.training.configs_from_args import flag
from megatron.training.flag_groups.mla import MLA_VALUE_FLAGS
from megatron.training.flag_groups.yarn import YARN_DEFAULTS, YARN_VALUE_FLAGS
from megatron.training.hf_conversion.config_fields import (
    HFConversionError,
    aliased_field,
    check_not_quantized,
    integer_field,
)
from megatron.training.hf_conversion.moe import DENSE_MOE_ARGS, moe_layers

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"

DEEPSEEK_V3_ARGS: dict[str, Any] = {
    "position_embedding_type": "rope",
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "normalization": "RMSNorm",
    "swiglu": True,
    "squared_relu": False,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "qk_layernorm": True,
    "qk_l2_norm": False,
    "layernorm_zero_centered_gamma": False,
    "apply_residual_connection_post_layernorm": False,
    "transformer_impl": "local",
    "multi_latent_attention": True,
    "group_query_attention": False,
    "use_rope_scaling": False,
    "rotary_seq_len_interpolation_factor": None,
    **GPT_OSS_MODEL_ARGS,
}
"""The model flags' values every DeepSeek-V3 model has (`rotary_interleaved` and the RoPE
scalings are standard attention's flags: multi-latent attention always rotates adjacent pairs,
by its own --rope-type; `qk_layernorm` gives it its latent norms)."""

_YARN_DEFAULTS = dict(YARN_DEFAULTS)
"""The YaRN flags' values when they are not given (as validation fills them for multi-latent
attention): what `--rope-type rope` leaves unread."""

_ROUTER_DTYPE = "fp32"
"""transformers computes DeepSeek-V3's router logits in fp32 (its weight kept in fp32)."""

_TRANSFORMERS_GROUP_SCORE_EXPERTS = 2
"""transformers scores a DeepSeek-V3 expert group by the sum of its best two experts' scores;
this project by its best `moe_router_topk // moe_router_group_topk` (Megatron-core's)."""

_LATENT_NORM_EPSILON = 1e-6
"""The epsilon of transformers' DeepSeek-V3 query and key/value latent norms (fixed)."""

_STATED_BY_REMOTE_CODE = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
"""Fields of DeepSeek's own `config.json` (for its remote code) that transformers does not read,
with the values transformers computes: a config stating others describes another model."""


def model_args_from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The values of `pretrain_gpt.py`'s model flags (by destination) for this DeepSeek-V3
    config (its left-out fields filled in), without multi-token prediction (`mtp_depths` tells
    whether the weights hold it).

    Raises:
        HFConversionError: a feature this project does not compute, or a config transformers
            reads as another model (named, with the fix).
    """
    check_not_quantized(
        config,
        DEEPSEEK_V3,
        "DeepSeek-V3's release stores FP8 blocks with weight_scale_inv scales; DeepSeek's "
        "inference/fp8_cast_bf16.py writes a bf16 copy",
    )
    _check_computed_as_stated(config)
    rope_interleaved(config)  # refused before the weights are read
    heads = integer_field(config, "num_attention_heads")
    hidden = integer_field(config, "hidden_size")
    layers = integer_field(config, "num_hidden_layers")
    kv_heads = config["num_key_value_heads"]
    if kv_heads not in (None, heads):
        raise HFConversionError(
            f"{DEEPSEEK_V3} with num_key_value_heads {kv_heads} and num_attention_heads "
            f"{heads}: multi-latent attention gives every head its own key and value (transformers "
            "fails on fewer key/value heads); set num_key_value_heads to num_attention_heads."
        )
    q_lora_rank = config["q_lora_rank"]
    if q_lora_rank is not None:
        q_lora_rank = integer_field(config, "q_lora_rank")
    rotated = integer_field(config, "qk_rope_head_dim")
    if rotated % 2:
        raise HFConversionError(
            f"qk_rope_head_dim {rotated}: RoPE rotates channel pairs; it must be even."
        )
    widths = {
        "qk_head_dim": integer_field(config, "qk_nope_head_dim"),
        "qk_pos_emb_head_dim": rotated,
        "v_head_dim": integer_field(config, "v_head_dim"),
    }
    epsilon = float(config["rms_norm_eps"])
    if epsilon != _LATENT_NORM_EPSILON:
        raise HFConversionError(
            f"{DEEPSEEK_V3} with rms_norm_eps {epsilon}: transformers normalises the query and "
            f"key/value latents with epsilon {_LATENT_NORM_EPSILON} whatever rms_norm_eps says, "
            "and this project with --norm-epsilon in every norm; only rms_norm_eps "
            f"{_LATENT_NORM_EPSILON} (DeepSeek-V3's) converts."
        )
    max_positions = integer_field(config, "max_position_embeddings")
    args = {
        **DEEPSEEK_V3_ARGS,
        "num_layers": layers,
        "hidden_size": hidden,
        "ffn_hidden_size": integer_field(config, "intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": heads,
        # Not read by multi-latent attention: the flag's default where it has one, else the
        # query heads' width.
        "kv_channels": (
            hidden // heads if hidden % heads == 0 else widths["qk_head_dim"] + rotated
        ),
        "max_position_embeddings": max_positions,
        "layernorm_epsilon": epsilon,
        "untie_embeddings_and_output_weights": not config["tie_word_embeddings"],
        "attention_dropout": float(config["attention_dropout"]),
        "hidden_dropout": 0.0,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": integer_field(config, "kv_lora_rank"),
        **widths,
        "mtp_num_layers": None,
    }
    args.update(_rope_args(config, max_positions))
    args.update(_moe_args(config, layers))
    return args


def mla_flags(args: Mapping[str, Any]) -> list[str]:
    """The multi-latent attention flags for the values `model_args_from_hf_config` gives (none
    without multi-latent attention)."""
    if not args.get("multi_latent_attention"):
        return []
    flags: list[Any] = ["--multi-latent-attention"]
    for value_flag in MLA_VALUE_FLAGS:
        if args[value_flag.dest] is not None:
            flags += [value_flag.option, args[value_flag.dest]]
    flags += ["--rope-type", args["rope_type"]]
    if args["rope_type"] == "yarn":
        flags += [item for each in YARN_VALUE_FLAGS for item in (each.option, args[each.dest])]
    return [str(value) for value in flags]


def rope_interleaved(config: Mapping[str, Any]) -> bool:
    """Whether the config's weights rotate adjacent channel pairs (`rope_interleave`, read as
    transformers reads it: true where it is left out).

    Raises:
        HFConversionError: `rope_interleave` is not a boolean.
    """
    value = config.get("rope_interleave", True)
    if not isinstance(value, bool):
        raise HFConversionError(
            f"config.json's rope_interleave is {value!r}; true or false is needed."
        )
    return value


def mtp_depths(config: Mapping[str, Any], names: Iterable[str]) -> int | None:
    """The multi-token prediction depths the weights `names` hold: `num_nextn_predict_layers`
    when each depth's layer `model.layers.<num_hidden_layers + i>` is there, None when none is
    (transformers' `save_pretrained` leaves them out) or the config has none.

    Raises:
        HFConversionError: the weights hold some depths but not all.
    """
    depths = aliased_field(config, "num_nextn_predict_layers", "num_mtp_layers") or 0
    if not isinstance(depths, int) or isinstance(depths, bool) or depths < 0:
        raise HFConversionError(
            f"config.json's num_nextn_predict_layers is {depths!r}; a non-negative integer is "
            "needed."
        )
    layers = integer_field(config, "num_hidden_layers")
    prefixes = [f"model.layers.{layers + depth}." for depth in range(depths)]
    names = list(names)
    present = [any(name.startswith(prefix) for name in names) for prefix in prefixes]
    if not any(present):
        return None
    if not all(present):
        missing = [prefix + "*" for prefix, held in zip(prefixes, present) if not held]
        raise HFConversionError(
            f"config.json's num_nextn_predict_layers {depths}, but the weights hold only some of "
            f"the multi-token prediction layers (missing {missing}); pass a directory that holds "
            "all of them, or none."
        )
    return depths


def with_mtp_depths(config: Mapping[str, Any], depths: int | None) -> dict[str, Any]:
    """The config stating `depths` multi-token prediction layers; a checkpoint without them
    keeps the config's count (transformers saves models so)."""
    if depths is None:
        return dict(config)
    return {**config, "num_nextn_predict_layers": depths}


def hf_config_from_model_args(
    args: Mapping[str, Any], vocab_size: int, dtype: str
) -> dict[str, Any]:
    """A DeepSeek-V3 `config.json` for weights of the model the flag values `args` describe
    (a checkpoint's saved arguments), in the keys transformers 4 and 5 both read.

    Raises:
        HFConversionError: no DeepSeek-V3 config computes that model (the flags named).
    """
    differ = [
        f"{flag(name)} {args[name]} (DeepSeek-V3's: {value})"
        for name, value in DEEPSEEK_V3_ARGS.items()
        if name in args and args[name] != value
    ]
    differ += _moe_differences(args)
    differ += _yarn_differences(args)
    if differ:
        raise HFConversionError(
            f"the checkpoint's multi-latent attention model is not DeepSeek-V3's: "
            f"{'; '.join(differ)}. Only models that DeepseekV3ForCausalLM computes export."
        )
    pattern = moe_layers(args)
    width = args["moe_ffn_hidden_size"] or args["ffn_hidden_size"]
    yarn = args["rope_type"] == "yarn"
    return {
        "architectures": [DEEPSEEK_V3],
        "model_type": "deepseek_v3",
        "hidden_size": args["hidden_size"],
        "intermediate_size": args["ffn_hidden_size"],
        "moe_intermediate_size": width,
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": args["num_attention_heads"],
        "num_key_value_heads": args["num_attention_heads"],
        "n_shared_experts": args["moe_shared_expert_intermediate_size"] // width,
        "n_routed_experts": args["num_experts"],
        "routed_scaling_factor": args["moe_router_topk_scaling_factor"] or 1.0,
        "kv_lora_rank": args["kv_lora_rank"],
        "q_lora_rank": args["q_lora_rank"],
        "qk_rope_head_dim": args["qk_pos_emb_head_dim"],
        "qk_nope_head_dim": args["qk_head_dim"],
        "v_head_dim": args["v_head_dim"],
        "n_group": args["moe_router_num_groups"] or 1,
        "topk_group": args["moe_router_group_topk"] or 1,
        "num_experts_per_tok": args["moe_router_topk"],
        "first_k_dense_replace": pattern.index(True),
        "norm_topk_prob": args["moe_router_topk"] > 1,
        "hidden_act": "silu",
        "max_position_embeddings": args["max_position_embeddings"],
        "rms_norm_eps": args["layernorm_epsilon"],
        "rope_theta": float(args["rotary_base"]),
        "rope_scaling": _yarn_scaling(args) if yarn else None,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": args.get("attention_dropout", 0.0),
        "tie_word_embeddings": not args["untie_embeddings_and_output_weights"],
        "vocab_size": vocab_size,
        "num_nextn_predict_layers": args.get("mtp_num_layers") or 0,
        "torch_dtype": dtype,
    }


def _check_computed_as_stated(config: Mapping[str, Any]) -> None:
    """Refuses the fields transformers' DeepSeek-V3 does not compute, and those of DeepSeek's
    own config that transformers ignores but state another model."""
    problems = [
        f"{key} {config[key]!r} (transformers computes {value!r})"
        for key, value in _STATED_BY_REMOTE_CODE.items()
        if key in config and config[key] != value
    ]
    if config["hidden_act"] not in ("silu", "swish"):
        problems.append(f"hidden_act {config['hidden_act']!r} (only SiLU, SwiGLU's gate, is built)")
    if config["attention_bias"]:
        problems.append("attention_bias true (biases in the attention projections)")
    if config.get("mtp_hidden_states_first"):
        problems.append("mtp_hidden_states_first true (this project's depths embed first)")
    if problems:
        raise HFConversionError(
            f"{DEEPSEEK_V3} with {'; '.join(problems)}: not converted; only DeepSeek-V3 as "
            "transformers computes it is."
        )


def _rope_args(config: Mapping[str, Any], max_positions: int) -> dict[str, Any]:
    """The RoPE and YaRN flags' values, read as transformers 5 reads them (the block
    `rope_parameters`, or transformers 4's `rope_theta` and `rope_scaling`)."""
    parameters = config.get("rope_parameters")
    if parameters and any(isinstance(value, Mapping) for value in parameters.values()):
        raise HFConversionError(
            "rope_parameters per layer type are not converted (every layer must share one RoPE)."
        )
    block = parameters or config.get("rope_scaling") or {}
    theta = block.get("rope_theta", config["rope_theta"])
    if not isinstance(theta, (int, float)) or theta <= 0 or theta != int(theta):
        raise HFConversionError(
            f"rope_theta {theta!r}: --rotary-base takes a positive integer; this one is not."
        )
    partial = block.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFConversionError(
            f"partial_rotary_factor {partial}: only full-width RoPE is converted."
        )
    kind = block.get("rope_type", block.get("type", "default"))
    args = {**_YARN_DEFAULTS, "rotary_base": int(theta), "rope_type": "rope"}
    if kind == "yarn":
        args.update(_yarn_args(config, block, max_positions))
    elif kind != "default":
        raise HFConversionError(
            f"{DEEPSEEK_V3} with rope_type {kind!r}: only RoPE (default) and YaRN (yarn) are "
            "built for multi-latent attention."
        )
    return args


def _yarn_args(
    config: Mapping[str, Any], block: Mapping[str, Any], max_positions: int
) -> dict[str, Any]:
    """YaRN's flags for a "yarn" block, with transformers' defaults and its reading of
    `mscale` and `mscale_all_dim` (`_compute_yarn_parameters`, `yarn_apply_mscale`)."""
    factor = block.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise HFConversionError(
            f"yarn rope_scaling factor {factor!r}: a positive number is needed (transformers "
            "needs it to load the model)."
        )
    if block.get("truncate", True) is not True:
        raise HFConversionError(
            "yarn rope_scaling with truncate false: this project's YaRN rounds the band of "
            "blended frequencies to whole channel pairs (transformers' default, truncate true), "
            "as Megatron-core's multi-latent attention does."
        )
    key = "original_max_position_embeddings"
    # transformers 5 takes a top-level value over the block's, and the context where both
    # leave it out.
    original = config.get(key, block.get(key)) or max_positions
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise HFConversionError(f"yarn {key} {original!r}: a positive integer is needed.")
    if max_positions / original not in (1, factor):
        raise HFConversionError(
            f"yarn rope_scaling factor {factor}, but max_position_embeddings {max_positions} / "
            f"{key} {original} is {max_positions / original:g}: transformers warns that it "
            "may then behave unexpectedly and its versions read the two differently; state "
            f"max_position_embeddings = factor x {key}."
        )
    mscale, mscale_all_dim = block.get("mscale"), block.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise HFConversionError(
            f"yarn rope_scaling with mscale_all_dim {mscale_all_dim} and mscale {mscale!r}: "
            "transformers then scales the rotated channels as if both were unset and the "
            "softmax by mscale_all_dim, which this project's YaRN (one pair of coefficients for "
            "both) does not compute; state mscale too."
        )
    if not (mscale and mscale_all_dim):
        # transformers' rotary scale is then yarn_mscale(factor), whatever mscale says.
        mscale, mscale_all_dim = 1.0, 0.0
    stated = block.get("attention_factor")
    computed = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    if stated is not None and not math.isclose(stated, computed, rel_tol=1e-12):
        raise HFConversionError(
            f"yarn rope_scaling attention_factor {stated}: this project's YaRN scales the "
            f"rotated channels by yarn_mscale(factor, mscale) / yarn_mscale(factor, "
            f"mscale_all_dim) = {computed:g} only; leave attention_factor out."
        )
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": float(factor),
        "mscale": float(mscale),
        "mscale_all_dim": float(mscale_all_dim),
        "yarn_original_max_position_embeddings": original,
        "yarn_beta_fast": float(block.get("beta_fast") or 32),
        "yarn_beta_slow": float(block.get("beta_slow") or 1),
    }


def _moe_args(config: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """The MoE flags' values (`moe.MOE_ARGS`)."""
    experts = integer_field(
        {"n_routed_experts": aliased_field(config, "n_routed_experts", "num_local_experts")},
        "n_routed_experts",
    )
    width = integer_field(config, "moe_intermediate_size")
    topk = integer_field(config, "num_experts_per_tok")
    shared = integer_field(config, "n_shared_experts")
    groups = integer_field(config, "n_group")
    group_topk = integer_field(config, "topk_group")
    dense = config["first_k_dense_replace"]
    if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
        raise HFConversionError(
            f"config.json's first_k_dense_replace is {dense!r}; a non-negative integer is needed."
        )
    if dense >= layers:
        raise HFConversionError(
            f"{DEEPSEEK_V3} whose first_k_dense_replace {dense} leaves none of its {layers} "
            "layers an MoE layer is not converted (its multi-token prediction layer would be "
            "an MoE layer still)."
        )
    if topk > experts:
        raise HFConversionError(
            f"num_experts_per_tok {topk} exceeds the {experts} experts of config.json."
        )
    if experts % groups or group_topk > groups:
        raise HFConversionError(
            f"n_group {groups} and topk_group {group_topk} with {experts} experts: the groups "
            "must divide the experts and topk_group must not exceed n_group."
        )
    grouped = group_topk < groups  # choosing every group limits nothing
    if grouped and topk // group_topk != _TRANSFORMERS_GROUP_SCORE_EXPERTS:
        raise HFConversionError(
            f"num_experts_per_tok {topk} and topk_group {group_topk}: transformers scores each "
            f"group by its best {_TRANSFORMERS_GROUP_SCORE_EXPERTS} experts, this project by its "
            f"best num_experts_per_tok // topk_group ({topk // group_topk}); only models where "
            "the two agree (DeepSeek-V3's 8 // 4) convert."
        )
    if experts // groups < _TRANSFORMERS_GROUP_SCORE_EXPERTS:
        raise HFConversionError(
            f"n_group {groups} with {experts} experts: transformers needs at least two experts "
            "per group."
        )
    renormalised = config["norm_topk_prob"]
    if renormalised != (topk > 1):
        raise HFConversionError(
            f"{DEEPSEEK_V3} with norm_topk_prob {renormalised} and num_experts_per_tok {topk}: "
            "this project's sigmoid routing renormalises the chosen scores exactly when more "
            "than one expert is chosen."
        )
    scaling = config["routed_scaling_factor"]
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or scaling <= 0:
        raise HFConversionError(f"routed_scaling_factor {scaling!r}: a positive number is needed.")
    return {
        **DENSE_MOE_ARGS,
        "num_experts": experts,
        "moe_ffn_hidden_size": width,
        "moe_router_topk": topk,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": None if scaling == 1 else float(scaling),
        "moe_router_num_groups": groups if grouped else None,
        "moe_router_group_topk": group_topk if grouped else None,
        "moe_shared_expert_intermediate_size": width * shared,
        "moe_layer_freq": [0] * dense + [1] * (layers - dense) if dense else 1,
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": _ROUTER_DTYPE,
    }


def _moe_differences(args: Mapping[str, Any]) -> list[str]:
    """The MoE flags of `args` (saved arguments) that no DeepSeek-V3 config computes."""
    if args.get("num_experts") is None:
        return ["no --num-experts (DeepSeek-V3 has MoE layers)"]
    built = {
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_pre_softmax": False,
        "moe_shared_expert_gate": False,
    }
    differ = [
        f"{flag(name)} {args.get(name)} (DeepSeek-V3's: {value})"
        for name, value in built.items()
        if args.get(name) != value
    ]
    width = args["moe_ffn_hidden_size"] or args["ffn_hidden_size"]
    shared = args["moe_shared_expert_intermediate_size"]
    if shared is None or shared % width:
        differ.append(
            f"{flag('moe_shared_expert_intermediate_size')} {shared} (DeepSeek-V3's: a multiple "
            f"of the experts' {width})"
        )
    pattern = moe_layers(args)
    first = pattern.index(True) if any(pattern) else len(pattern)
    if first == len(pattern) or not all(pattern[first:]):
        differ.append(
            f"{flag('moe_layer_freq')} {args['moe_layer_freq']} (DeepSeek-V3's: dense layers "
            "first, then MoE layers)"
        )
    group_topk = args.get("moe_router_group_topk")
    if group_topk and args["moe_router_topk"] // group_topk != _TRANSFORMERS_GROUP_SCORE_EXPERTS:
        differ.append(
            f"{flag('moe_router_topk')} {args['moe_router_topk']} // "
            f"{flag('moe_router_group_topk')} {group_topk} (transformers scores groups by "
            f"{_TRANSFORMERS_GROUP_SCORE_EXPERTS} experts)"
        )
    return differ


def _yarn_differences(args: Mapping[str, Any]) -> list[str]:
    """YaRN settings of `args` that transformers reads otherwise (it uses `mscale` only together
    with a non-zero `mscale_all_dim`) or that the import refuses (a context that is not the
    factor times the original one)."""
    if args["rope_type"] != "yarn":
        return []
    differ = []
    mscale, mscale_all_dim = args["mscale"], args["mscale_all_dim"]
    if not ((mscale and mscale_all_dim) or (mscale == 1 and not mscale_all_dim)):
        differ.append(
            f"--mscale {mscale} with --mscale-all-dim {mscale_all_dim} (transformers uses mscale "
            "only with a non-zero mscale_all_dim)"
        )
    context = args["max_position_embeddings"] / args["yarn_original_max_position_embeddings"]
    if context not in (1, args["rotary_scaling_factor"]):
        differ.append(
            f"--max-position-embeddings {args['max_position_embeddings']} (YaRN's: "
            f"--rotary-scaling-factor {args['rotary_scaling_factor']} x "
            f"--yarn-original-max-position-embeddings "
            f"{args['yarn_original_max_position_embeddings']})"
        )
    return differ


def _yarn_scaling(args: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "rope_type": "yarn",
        "factor": args["rotary_scaling_factor"],
        "original_max_position_embeddings": args["yarn_original_max_position_embeddings"],
        "beta_fast": args["yarn_beta_fast"],
        "beta_slow": args["yarn_beta_slow"],
        "mscale": args["mscale"],
        "mscale_all_dim": args["mscale_all_dim"],
    }
