"""gpt-oss (`GptOssForCausalLM`) in the Hugging Face conversion: its `config.json` fields <-> the
flags of the model they describe, and its tensors' names and layouts.

gpt-oss is the Llama-family model (`config.py`) with, in this project's flags:

- biases in every linear layer but the output layer (`attention_bias`; the router's and the
  experts' always): the default `--add-bias-linear`, where Llama has `--disable-bias-linear`;
- a learnt sink logit per head in the softmax (`self_attn.sinks`): `--softmax-type learnable`,
  whose parameter is the core attention's `softmax_offset`;
- sliding windows on the layers `layer_types` marks "sliding_attention": transformers' window of
  `sliding_window` W lets a query see itself and the W - 1 positions before it, so
  `--window-size W-1,0`, with `--window-attn-skip-freq` the layers that attend fully (2 for
  gpt-oss's alternation from a windowed first layer, else a 0/1 list);
- YaRN RoPE (`rope_type` "yarn", `hf_conversion/yarn.py`);
- an MoE layer in every layer, routed as the router's default (the top-k logits, then their
  softmax), its experts computing the clamped GLU (up + 1) * g sigmoid(1.702 g), g =
  min(gate, L) and up clamped to [-L, L] for `swiglu_limit` L: `--quick-geglu
  --glu-linear-offset 1.0 --activation-func-clamp-value L`.

The experts are stored as stacks, `gate_up_proj` [E, hidden, 2 I] (multiplied as x @ W) with the
gate and up projections interleaved in its columns (gate at even ones) and `down_proj`
[E, I, hidden]; this project's `linear_fc1.weight` [E, 2 I, hidden] holds the gate rows and then
the up rows, `linear_fc2.weight` [E, hidden, I] (`tensors.py`'s "experts_gate_up" and
"experts_down" layouts; the fc1 bias is de-interleaved as the weight's columns).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron.core.activations import QUICK_GELU_ALPHA
from megatron.core.transformer.attention_window import is_layer_window_attention
from megatron.training.hf_conversion.config_fields import HFConversionError, integer_field
from megatron.training.hf_conversion.moe import DENSE_MOE_ARGS
from megatron.training.hf_conversion.yarn import yarn_rope_scaling

GPT_OSS = "GptOssForCausalLM"

SLIDING, FULL = "sliding_attention", "full_attention"
"""gpt-oss's `layer_types`."""

GPT_OSS_LAYER_TENSORS = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "same"),
    ("self_attention.linear_qkv.weight", tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    ("self_attention.linear_qkv.bias", tuple(f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    ("self_attention.core_attention.softmax_offset", ("self_attn.sinks",), "same"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "same"),
    ("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), "same"),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "same"),
    ("mlp.router.weight", ("mlp.router.weight",), "same"),
    ("mlp.router.bias", ("mlp.router.bias",), "same"),
    ("mlp.experts.linear_fc1.weight", ("mlp.experts.gate_up_proj",), "experts_gate_up"),
    ("mlp.experts.linear_fc1.bias", ("mlp.experts.gate_up_proj_bias",), "experts_gate_up"),
    ("mlp.experts.linear_fc2.weight", ("mlp.experts.down_proj",), "experts_down"),
    ("mlp.experts.linear_fc2.bias", ("mlp.experts.down_proj_bias",), "same"),
)
"""Each layer's tensors: the name below `decoder.layers.N.`, those below `model.layers.N.`, the
layout (`tensors.to_megatron`)."""


def is_gpt_oss(args: Mapping[str, Any]) -> bool:
    """Whether the model flag values `args` are of gpt-oss's kind: learnable softmax sinks, which
    of the converted architectures only gpt-oss has (`gpt_oss_hf_config` checks the rest)."""
    return args.get("softmax_type") == "learnable"


def gpt_oss_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the model flags in which gpt-oss differs from the Llama family, for a
    `config.json` with its left-out fields filled in (`config_fields.with_defaults`): biases,
    sinks, windows, the clamped GLU and the MoE flags (`moe.MOE_ARGS`).

    Raises:
        HFConversionError: a field this project does not compute (named).
    """
    if config["swiglu_alpha"] != QUICK_GELU_ALPHA:
        raise HFConversionError(
            f"{GPT_OSS} with swiglu_alpha {config['swiglu_alpha']}: --quick-geglu's gate is "
            f"x * sigmoid({QUICK_GELU_ALPHA} x), gpt-oss's; other gains are not built."
        )
    limit = config["swiglu_limit"]
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit > 0:
        raise HFConversionError(
            f"{GPT_OSS} with swiglu_limit {limit!r}: --activation-func-clamp-value takes a "
            "number above 0."
        )
    if not config["attention_bias"]:
        raise HFConversionError(
            f"{GPT_OSS} with attention_bias false: without the attention's biases but with the "
            "router's and the experts' (which gpt-oss always has) is not built; --add-bias-linear "
            "gives every linear layer one."
        )
    return {
        "swiglu": False,
        "quick_geglu": True,
        "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(limit),
        "add_bias_linear": True,
        "softmax_type": "learnable",
        **_window_args(config),
        **_moe_args(config),
    }


def _window_args(config: Mapping[str, Any]) -> dict[str, Any]:
    layers = integer_field(config, "num_hidden_layers")
    kinds = config["layer_types"] or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= {SLIDING, FULL}:
        raise HFConversionError(
            f"{GPT_OSS}'s layer_types {kinds}: one of {SLIDING!r} or {FULL!r} per layer "
            f"({layers}) is needed."
        )
    window = config["sliding_window"]
    if window is None or SLIDING not in kinds:
        return {"window_size": None, "window_attn_skip_freq": None}
    window = integer_field(config, "sliding_window")
    windowed = [int(kind == SLIDING) for kind in kinds]
    size = (window - 1, 0)
    if all(windowed):
        return {"window_size": size, "window_attn_skip_freq": None}
    for every in range(2, layers + 1):
        if [is_layer_window_attention(size, every, i + 1) for i in range(layers)] == windowed:
            return {"window_size": size, "window_attn_skip_freq": every}
    return {"window_size": size, "window_attn_skip_freq": windowed}


def _moe_args(config: Mapping[str, Any]) -> dict[str, Any]:
    experts = integer_field(config, "num_local_experts")
    topk = integer_field(config, "num_experts_per_tok")
    if topk > experts:
        raise HFConversionError(
            f"num_experts_per_tok {topk} exceeds the {experts} experts of config.json."
        )
    if topk == 1:
        raise HFConversionError(
            f"{GPT_OSS} with num_experts_per_tok 1 (each token's routing weight the softmax of "
            "its one logit, 1) is not built: the router's top-1 softmax needs "
            "--moe-router-pre-softmax, whose weight is the probability itself."
        )
    return {
        **DENSE_MOE_ARGS,
        "num_experts": experts,
        "moe_ffn_hidden_size": integer_field(config, "intermediate_size"),
        "moe_router_topk": topk,
        "moe_layer_freq": 1,
        "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef") or 0.0),
    }


def gpt_oss_flags(args: Mapping[str, Any]) -> list[str]:
    """The flags of gpt-oss's attention and MLP options (those not at their defaults) for the
    flag values `args`."""
    flags: list[Any] = []
    if args["quick_geglu"]:
        flags.append("--quick-geglu")
    if args["glu_linear_offset"]:
        flags += ["--glu-linear-offset", args["glu_linear_offset"]]
    if args["activation_func_clamp_value"] is not None:
        flags += ["--activation-func-clamp-value", args["activation_func_clamp_value"]]
    if args["softmax_type"] != "vanilla":
        flags += ["--softmax-type", args["softmax_type"]]
    if args["window_size"] is not None:
        flags += ["--window-size", ",".join(map(str, args["window_size"]))]
    skip = args["window_attn_skip_freq"]
    if skip is not None:
        flags += ["--window-attn-skip-freq", skip if isinstance(skip, int) else _list(skip)]
    return [str(flag) for flag in flags]


def _list(values: list[int]) -> str:
    return "[" + ",".join(map(str, values)) + "]"


_GPT_OSS_ARGS = {
    "quick_geglu": True,
    "glu_linear_offset": 1.0,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "swiglu": False,
    "squared_relu": False,
    "normalization": "RMSNorm",
    "qk_layernorm": False,
    "qk_l2_norm": False,
    "layernorm_zero_centered_gamma": False,
    "apply_residual_connection_post_layernorm": False,
    "rotary_interleaved": False,
    "rotary_percent": 1.0,
    "use_rope_scaling": False,
    "rotary_seq_len_interpolation_factor": None,
    "transformer_impl": "local",
    "multi_latent_attention": False,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": False,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
}
"""The flag values every gpt-oss model has (besides `is_gpt_oss`'s sinks)."""


def gpt_oss_hf_config(args: Mapping[str, Any], vocab_size: int, dtype: str) -> dict[str, Any]:
    """A gpt-oss `config.json` for the weights of the model the flag values `args` describe (a
    checkpoint's saved arguments), in the keys transformers 4 and 5 both read.

    Raises:
        HFConversionError: the flags describe a model `GptOssForCausalLM` does not compute.
    """
    differ = [
        f"--{name.replace('_', '-')} {args.get(name)} (gpt-oss's: {value})"
        for name, value in _GPT_OSS_ARGS.items()
        if args.get(name, value) != value
    ]
    if args.get("num_experts") is None:
        differ.append("no --num-experts (gpt-oss's layers are MoE layers)")
    elif args.get("moe_layer_freq", 1) not in (1, [1] * args["num_layers"]):
        differ.append(f"--moe-layer-freq {args['moe_layer_freq']} (gpt-oss's: every layer MoE)")
    if args.get("activation_func_clamp_value") is None:
        differ.append("no --activation-func-clamp-value (gpt-oss's experts clamp)")
    window = args.get("window_size")
    if window is not None and (window[1] not in (0, -1) or window[0] < 0):
        differ.append(f"--window-size {window} (gpt-oss's: a finite left side)")
    if args.get("position_embedding_type") not in ("rope", "yarn"):
        differ.append(f"--position-embedding-type {args.get('position_embedding_type')}")
    if differ:
        raise HFConversionError(
            f"the checkpoint's model is not gpt-oss's: {'; '.join(differ)}. Only models that "
            f"{GPT_OSS} computes export with learnable softmax sinks."
        )
    layers = args["num_layers"]
    skip = args.get("window_attn_skip_freq")
    config: dict[str, Any] = {
        "architectures": [GPT_OSS],
        "model_type": "gpt_oss",
        "hidden_size": args["hidden_size"],
        "intermediate_size": args["moe_ffn_hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": args["num_attention_heads"],
        "num_key_value_heads": args["num_query_groups"],
        "head_dim": args["kv_channels"],
        "max_position_embeddings": args["max_position_embeddings"],
        "rms_norm_eps": args["layernorm_epsilon"],
        "rope_theta": float(args["rotary_base"]),
        "rope_scaling": None,
        "sliding_window": None if window is None else window[0] + 1,
        "layer_types": [
            SLIDING if is_layer_window_attention(window, skip, i + 1) else FULL
            for i in range(layers)
        ],
        "attention_bias": True,
        "attention_dropout": args.get("attention_dropout", 0.0),
        "num_local_experts": args["num_experts"],
        "num_experts_per_tok": args["moe_router_topk"],
        "router_aux_loss_coef": args.get("moe_aux_loss_coeff", 0.0),
        "output_router_logits": False,
        "swiglu_alpha": QUICK_GELU_ALPHA,
        "swiglu_limit": args["activation_func_clamp_value"],
        "tie_word_embeddings": not args["untie_embeddings_and_output_weights"],
        "vocab_size": vocab_size,
        "torch_dtype": dtype,
    }
    if args["position_embedding_type"] == "yarn":
        config["rope_scaling"] = yarn_rope_scaling(args)
    else:
        config["rope_scaling"] = {"rope_type": "default"}
    return config
