"""Hugging Face `config.json` <-> the flags of this project's GPT model, for Llama-family models
(and their Mixture-of-Experts kin, Mixtral, Qwen2-MoE and Qwen3-MoE, whose MoE fields `moe.py`
converts, and gpt-oss, whose own fields `gpt_oss.py` converts), and for DeepSeek-V3
(`deepseek_v3.py`, which this module hands its configs and checkpoints to).

`model_args_from_hf_config` reads a `config.json` (as transformers 4 or 5 writes it) of one of
`SUPPORTED_ARCHITECTURES` into the values `pretrain_gpt.py`'s flags give (their `argparse`
destinations: `num_layers`, `rotary_base`, ...), refusing by name what this model does not
compute; `model_flags` spells those values as the flags to train with, and
`hf_config_from_model_args` goes back, for a checkpoint that has no Hugging Face config.

A Llama-family model here is: RoPE in the rotate-half layout (Megatron's default), RMSNorm
before attention and MLP, a SwiGLU MLP (or SwiGLU experts), no biases except Qwen2's (and
Qwen2-MoE's) on the query, key and value projections, Qwen3's (and Qwen3-MoE's) RMSNorm of each
query and key head (`--qk-layernorm`), optionally grouped-query attention, Llama 3's RoPE
frequency scaling, YaRN RoPE (`--position-embedding-type yarn`, `yarn.py`) and tied embeddings.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from typing import Any

from megatron.core.models.common.embeddings.rotary_pos_embedding import llama3_inv_freq
from megatron.training.checkpointing import GPT_OSS_MODEL_ARGS, MODEL_ARGS
from megatron.training.configs_from_args import flag
from megatron.training.hf_conversion import deepseek_v3
from megatron.training.hf_conversion.config_fields import (
    HFConversionError,
    check_not_quantized,
    integer_field,
    with_defaults,
)
from megatron.training.hf_conversion.deepseek_v3 import DEEPSEEK_V3, mla_flags
from megatron.training.hf_conversion.gpt_oss import (
    GPT_OSS,
    gpt_oss_args,
    gpt_oss_flags,
    gpt_oss_hf_config,
    is_gpt_oss,
)
from megatron.training.hf_conversion.moe import (
    MOE_ARCHITECTURES,
    MOE_MODEL_ARGS,
    QWEN2_MOE,
    QWEN3_MOE,
    moe_args_from_hf_config,
    moe_flags,
    moe_hf_config,
)
from megatron.training.hf_conversion.yarn import yarn_args, yarn_flags, yarn_rope_scaling

QWEN3 = "Qwen3ForCausalLM"

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    QWEN3,
    *MOE_ARCHITECTURES,
    DEEPSEEK_V3,
    GPT_OSS,
)
"""What `import` converts: Llama 2 and 3 (and other Llama-architecture models), Mistral, Qwen2,
Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and gpt-oss."""

_QKV_BIAS = ("Qwen2ForCausalLM", QWEN2_MOE)
"""The architectures whose query, key and value projections have biases."""

_QK_NORM = (QWEN3, QWEN3_MOE)
"""The architectures that normalise each query and key head (`--qk-layernorm`)."""

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": QWEN3,
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": QWEN2_MOE,
    "qwen3_moe": QWEN3_MOE,
    "deepseek_v3": DEEPSEEK_V3,
    "gpt_oss": GPT_OSS,
}
"""`model_type` -> architecture, for a `config.json` without `architectures`."""

CONFIG_FILENAME = "config.json"

DEFAULT_SEQ_LENGTH = 4096
"""`--seq-length` printed for models whose context is longer (a later flag overrides it)."""

_NOT_FUNCTION_ARGS = ("padded_vocab_size", "max_position_embeddings")
"""Checkpoint model flags that do not change what a RoPE model computes (the vocabulary rows
are checked against the config on their own)."""

LLAMA_FAMILY_ARGS: dict[str, Any] = {
    "position_embedding_type": "rope",
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "normalization": "RMSNorm",
    "swiglu": True,
    "squared_relu": False,
    "add_bias_linear": False,
    "qk_l2_norm": False,
    "layernorm_zero_centered_gamma": False,
    "apply_residual_connection_post_layernorm": False,
    "transformer_impl": "local",
    "multi_latent_attention": False,
    **GPT_OSS_MODEL_ARGS,
}
"""The model flags' values every Llama-family model has (`transformer_impl`: the local layers'
tensor names are the ones converted)."""

ARCHITECTURE_ARGS = tuple(
    dict.fromkeys(
        [
            *(name for name in MODEL_ARGS if name not in _NOT_FUNCTION_ARGS),
            *MOE_MODEL_ARGS,
            *LLAMA_FAMILY_ARGS,
            "use_rope_scaling",
            "rotary_seq_len_interpolation_factor",
            "layernorm_epsilon",
        ]
    )
)
"""The flags that decide the function the weights compute (with `rope_scaling_factor` under
`use_rope_scaling`): a checkpoint exported with a Hugging Face config must agree on them."""

_LLAMA3_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(llama3_inv_freq).parameters.items()
    if name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
}
"""Llama 3's RoPE scaling parameters the model uses; only the factor is a flag."""


_ROPE_KEYS_ALSO_AT_TOP_LEVEL = {
    "rope_theta": ("the block's", "the top-level one"),
    "partial_rotary_factor": ("the block's", "the top-level one"),
    "original_max_position_embeddings": ("the top-level one", "the block's"),
}
"""RoPE parameters a `config.json` may state at its top level and in its `rope_parameters`
or `rope_scaling` block -> the one transformers 5 reads and the one transformers 4 reads,
where both are stated."""


def read_hf_config(path: str) -> dict[str, Any]:
    """The `config.json` of the Hugging Face model directory `path` (or the file itself).

    Raises:
        HFConversionError: no such directory or file, or it is not a JSON object.
    """
    file = os.path.join(path, CONFIG_FILENAME) if os.path.isdir(path) else path
    if not os.path.exists(path):
        raise HFConversionError(
            f"{path}: no such directory. Pass a Hugging Face model directory (as "
            "save_pretrained() writes it: config.json and *.safetensors)."
        )
    if not os.path.isfile(file):
        raise HFConversionError(
            f"{path} has no {CONFIG_FILENAME}: pass a Hugging Face model directory (as "
            "save_pretrained() writes it: config.json and *.safetensors)."
        )
    try:
        with open(file, encoding="utf-8") as stream:
            config = json.load(stream)
    except (OSError, ValueError) as error:
        raise HFConversionError(f"{file} is not readable JSON ({error}).") from error
    if not isinstance(config, dict):
        raise HFConversionError(f"{file} holds a {type(config).__name__}, not a JSON object.")
    return config


def architecture(config: Mapping[str, Any]) -> str:
    """The config's architecture, one of `SUPPORTED_ARCHITECTURES`.

    Raises:
        HFConversionError: another architecture (named), or none stated.
    """
    names = config.get("architectures") or []
    name = names[0] if len(names) == 1 else _MODEL_TYPES.get(config.get("model_type", ""))
    if name not in SUPPORTED_ARCHITECTURES:
        stated = name or names or config.get("model_type") or "no architecture"
        raise HFConversionError(
            f"{stated} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    return name


def model_args_from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The values of `pretrain_gpt.py`'s model flags (by destination) for this config.

    Returns:
        `LLAMA_FAMILY_ARGS` and the model's sizes, attention, RoPE and norm values,
        `max_position_embeddings`, `attention_dropout`, `hidden_dropout` and the MoE flags'
        (`moe.MOE_ARGS`, their defaults for a dense model); the vocabulary's are
        `vocab_args`'s.

    Raises:
        HFConversionError: an unsupported architecture or a feature this project does not
            compute (named, with the supported alternative).
    """
    name = architecture(config)
    _check_rope_stated_once(config, name)
    config = with_defaults(config, name)
    if name == DEEPSEEK_V3:
        return deepseek_v3.model_args_from_hf_config(config)
    check_not_quantized(config, name, "the model's publisher usually releases one")
    heads = integer_field(config, "num_attention_heads")
    hidden = integer_field(config, "hidden_size")
    groups = (
        heads
        if config["num_key_value_heads"] is None
        else integer_field(config, "num_key_value_heads")
    )
    head_dim = integer_field(config, "head_dim") if config.get("head_dim") else hidden // heads
    if heads % groups:
        raise HFConversionError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}."
        )
    if name == GPT_OSS:  # its experts' activation is its own; windows, biases: its own fields
        family_args = gpt_oss_args(config)
    else:
        if config["hidden_act"] not in ("silu", "swish"):
            raise HFConversionError(
                f"hidden_act {config['hidden_act']!r}: only SiLU (SwiGLU's gate) is built."
            )
        _check_biases(config, name)
        _check_full_attention(config, name)
        family_args = moe_args_from_hf_config(config, name)
    max_positions = integer_field(config, "max_position_embeddings")
    args = {
        **LLAMA_FAMILY_ARGS,
        "num_layers": integer_field(config, "num_hidden_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": integer_field(config, "intermediate_size"),
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "kv_channels": head_dim,
        "max_position_embeddings": max_positions,
        "layernorm_epsilon": float(config["rms_norm_eps"]),
        "add_qkv_bias": name in _QKV_BIAS and bool(config["qkv_bias"]),
        "qk_layernorm": name in _QK_NORM,
        "untie_embeddings_and_output_weights": not config["tie_word_embeddings"],
        "attention_dropout": float(config["attention_dropout"]),
        "hidden_dropout": 0.0,
    }
    args.update(_rope_args(config))
    args.update(family_args)
    return args


def hf_vocab_size(config: Mapping[str, Any]) -> int:
    """The config's `vocab_size`: the embedding's rows.

    Raises:
        HFConversionError: it is missing or not a positive integer.
    """
    return integer_field(config, "vocab_size")


def vocab_args(
    model_vocab: int,
    tokenizer_vocab: int | None,
    tokenizer_dir: str | None,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """The vocabulary flags' values: the tokenizer's (or `--vocab-size`) and the padding that
    makes the model's vocabulary exactly the embedding's `model_vocab` rows.

    `pretrain_gpt.py` pads the tokenizer's `tokenizer_vocab` ids (all of `model_vocab` without
    a tokenizer) to a multiple of `--make-vocab-size-divisible-by` times the tensor-parallel
    size (`tensor_parallel`, which must divide `model_vocab`); the divisor chosen makes that
    `model_vocab`. A tokenizer with more ids than the embedding has rows pads the
    embedding instead (`padded_vocab_size` > `model_vocab`; the added rows are zeros).

    Returns:
        `make_vocab_size_divisible_by`, `padded_vocab_size` and either `tokenizer_type` and
        `tokenizer_model` (`tokenizer_dir`) or `vocab_size`.
    """
    ids = tokenizer_vocab or model_vocab
    tp = tensor_parallel
    if ids > model_vocab:
        divisor = 128  # the flag's default
        padded = -(-ids // (divisor * tp)) * divisor * tp
    else:
        # A power of two where one fits (GEMM-friendly shapes), else the smallest divisor of
        # the vocabulary that pads the tokenizer's ids to it (model_vocab / tp at worst).
        candidates = [2**k for k in range(7, -1, -1)]
        candidates += [d for d in range(1, model_vocab + 1) if model_vocab % d == 0]
        divisor = next(d for d in candidates if -(-ids // (d * tp)) * d * tp == model_vocab)
        padded = model_vocab
    args: dict[str, Any] = {"make_vocab_size_divisible_by": divisor, "padded_vocab_size": padded}
    if tokenizer_vocab is None:
        args["vocab_size"] = model_vocab
    else:
        args.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_dir)
    return args


def model_flags(args: Mapping[str, Any]) -> list[str]:
    """`pretrain_gpt.py`'s flags for the values `model_args_from_hf_config` and `vocab_args`
    give (the flags that are at their defaults are left out), and a `--seq-length` of at most
    `DEFAULT_SEQ_LENGTH`."""
    flags = [
        "--num-layers", args["num_layers"],
        "--hidden-size", args["hidden_size"],
        "--ffn-hidden-size", args["ffn_hidden_size"],
        "--num-attention-heads", args["num_attention_heads"],
    ]  # fmt: skip
    if args["group_query_attention"]:
        flags += ["--group-query-attention", "--num-query-groups", args["num_query_groups"]]
    if args["kv_channels"] * args["num_attention_heads"] != args["hidden_size"]:
        flags += ["--kv-channels", args["kv_channels"]]
    flags += [
        "--seq-length", min(args["max_position_embeddings"], DEFAULT_SEQ_LENGTH),
        "--max-position-embeddings", args["max_position_embeddings"],
        "--position-embedding-type", args["position_embedding_type"],
        "--rotary-base", args["rotary_base"],
    ]  # fmt: skip
    if args["position_embedding_type"] == "yarn":
        flags += yarn_flags(args)
    if args["use_rope_scaling"]:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", args["rope_scaling_factor"]]
    if args["rotary_seq_len_interpolation_factor"] is not None:
        flags += ["--rotary-seq-len-interpolation-factor"]
        flags += [args["rotary_seq_len_interpolation_factor"]]
    flags += ["--normalization", "RMSNorm", "--norm-epsilon", args["layernorm_epsilon"]]
    if args["swiglu"]:
        flags.append("--swiglu")
    if not args["add_bias_linear"]:
        flags.append("--disable-bias-linear")
    if args["add_qkv_bias"]:
        flags.append("--add-qkv-bias")
    flags += mla_flags(args)
    if args["qk_layernorm"]:
        flags.append("--qk-layernorm")
    if args["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    flags += moe_flags(args)
    if args.get("mtp_num_layers") is not None:
        flags += ["--mtp-num-layers", args["mtp_num_layers"]]
    flags += gpt_oss_flags(args)
    flags += ["--attention-dropout", args["attention_dropout"]]
    flags += ["--hidden-dropout", args["hidden_dropout"]]
    if "tokenizer_type" in args:
        flags += ["--tokenizer-type", args["tokenizer_type"]]
        flags += ["--tokenizer-model", args["tokenizer_model"]]
    else:
        flags += ["--vocab-size", args["vocab_size"]]
    flags += ["--make-vocab-size-divisible-by", args["make_vocab_size_divisible_by"]]
    return [str(flag) for flag in flags]


def hf_config_from_model_args(
    args: Mapping[str, Any], vocab_size: int, dtype: str
) -> dict[str, Any]:
    """A `config.json` for weights of the model the flag values `args` describe: DeepSeek-V3's
    with multi-latent attention (`deepseek_v3.hf_config_from_model_args`); gpt-oss's with
    learnable softmax sinks (`gpt_oss.gpt_oss_hf_config`); for a dense model Qwen2's with a QKV
    bias, Qwen3's with query-key norms, else Llama's; for an MoE model Qwen2-MoE's, Qwen3-MoE's
    or Mixtral's (`moe.moe_hf_config`); in the keys transformers 4 and 5 both read.

    Args:
        args: The model's flag values (a checkpoint's saved arguments).
        vocab_size: The embedding's rows.
        dtype: The weights' dtype ("bfloat16", ...).

    Raises:
        HFConversionError: the flags describe a model none of those configs computes.
    """
    if args.get("multi_latent_attention"):
        return deepseek_v3.hf_config_from_model_args(args, vocab_size, dtype)
    if is_gpt_oss(args):
        return gpt_oss_hf_config(args, vocab_size, dtype)
    check_llama_family(args)
    moe = args.get("num_experts") is not None
    qwen2, qwen3 = args["add_qkv_bias"], args["qk_layernorm"]
    if qwen2 and qwen3:
        raise HFConversionError(
            "the checkpoint's model has both --add-qkv-bias and --qk-layernorm, which no "
            "Llama-family Hugging Face model has (Qwen2 the bias, Qwen3 the norms)."
        )
    name, model_type = (
        (QWEN3, "qwen3") if qwen3 else ("Qwen2ForCausalLM", "qwen2") if qwen2 else
        ("LlamaForCausalLM", "llama")
    )  # fmt: skip
    config: dict[str, Any] = {
        "architectures": [name],
        "model_type": model_type,
        "hidden_size": args["hidden_size"],
        "intermediate_size": args["ffn_hidden_size"],
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": args["num_attention_heads"],
        "num_key_value_heads": args["num_query_groups"],
        "head_dim": args["kv_channels"],
        "hidden_act": "silu",
        "max_position_embeddings": args["max_position_embeddings"],
        "rms_norm_eps": args["layernorm_epsilon"],
        "rope_theta": float(args["rotary_base"]),
        "rope_scaling": None,
        "tie_word_embeddings": not args["untie_embeddings_and_output_weights"],
        "vocab_size": vocab_size,
        "attention_dropout": args.get("attention_dropout", 0.0),
        "torch_dtype": dtype,
    }
    if moe:
        config.update(moe_hf_config(args))
    elif qwen3:
        config.update(attention_bias=False, use_sliding_window=False)
    elif not qwen2:
        config.update(attention_bias=False, mlp_bias=False)
    if args["position_embedding_type"] == "yarn":
        config["rope_scaling"] = yarn_rope_scaling(args)
    elif args["use_rope_scaling"]:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args["rope_scaling_factor"],
            **_LLAMA3_DEFAULTS,
        }
    elif args["rotary_seq_len_interpolation_factor"] is not None:
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(args["rotary_seq_len_interpolation_factor"]),
        }
    return config


def check_llama_family(args: Mapping[str, Any]) -> None:
    """Raises `HFConversionError` naming the flags of `args` (saved arguments) that no
    Llama-family Hugging Face model has."""
    differ = [
        f"{flag(name)} {args[name]} (Llama's: {value})"
        for name, value in LLAMA_FAMILY_ARGS.items()
        if name in args and args[name] != value and (name, args[name]) not in _LLAMA_ALSO
    ]
    if differ:
        raise HFConversionError(
            f"the checkpoint's model is not of the Llama family: {'; '.join(differ)}. Only "
            "Llama-family models (as `import` writes them) are exported."
        )


_LLAMA_ALSO = {("position_embedding_type", "yarn")}
"""Flag values other than `LLAMA_FAMILY_ARGS`' a Llama-family config also states."""


def _check_biases(config: Mapping[str, Any], name: str) -> None:
    if name in _QKV_BIAS:
        return  # a QKV bias (or not: qkv_bias), never another
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise HFConversionError(
                f"{name} with {key}=true: biases in the attention output or MLP projections "
                f"of a {name} are not converted (--add-qkv-bias covers Qwen2's only)."
            )


def _check_full_attention(config: Mapping[str, Any], name: str) -> None:
    """Refuses sliding-window attention, which this converter does not map to `--window-size`
    (`config` with its left-out fields filled in)."""
    layer_types = config.get("layer_types") or []
    windowed = any(kind != "full_attention" for kind in layer_types)
    window = config["sliding_window"]
    if name in (*_QKV_BIAS, *_QK_NORM):  # Qwen's window applies with use_sliding_window
        windowed = windowed or bool(config["use_sliding_window"])
    elif window is not None and window < config.get("max_position_embeddings", 0):
        windowed = True
    if windowed:
        raise HFConversionError(
            f"{name} with sliding-window attention (sliding_window {window}, "
            f"max_position_embeddings {config.get('max_position_embeddings')}): converting "
            "windowed attention is not built; only models attending to the whole sequence "
            "convert (sliding_window null or >= max_position_embeddings)."
        )


def _check_rope_stated_once(config: Mapping[str, Any], name: str) -> None:
    """Refuses a `config.json` (as written, before defaults) that states its RoPE twice with
    different values: transformers takes one statement, transformers 4 and 5 mostly different
    ones, and which one the model was trained with is not in the file.

    transformers 5 renamed `rope_scaling` to `rope_parameters`, which also holds `rope_theta`
    and `partial_rotary_factor`: of a config holding both blocks transformers 5 reads
    `rope_scaling` (as 4 does, which ignores `rope_parameters`), where this conversion read
    `rope_parameters`; a parameter stated both at the top level and in the block is read from
    one place by transformers 5 and from the other by transformers 4
    (`_ROPE_KEYS_ALSO_AT_TOP_LEVEL`). Statements that agree are accepted.
    """
    blocks = {key: config.get(key) for key in ("rope_parameters", "rope_scaling")}
    for key, block in blocks.items():
        if block is not None and not isinstance(block, Mapping):
            raise HFConversionError(
                f"config.json's {key} {block!r} is not understood: a JSON object (or null) is."
            )
    parameters, scaling = blocks["rope_parameters"], blocks["rope_scaling"]
    if parameters and scaling:
        theta = with_defaults(config, name)["rope_theta"]
        if _rope_block(parameters, theta) != _rope_block(scaling, theta):
            raise HFConversionError(
                f"config.json states RoPE twice, differently: rope_parameters {dict(parameters)} "
                f"and rope_scaling {dict(scaling)}. transformers 5 reads rope_scaling, the older "
                "name of rope_parameters, and ignores rope_parameters; keep the one the model was "
                "trained with (transformers 5 writes rope_parameters alone) and delete the other."
            )
    block_name = "rope_parameters" if parameters else "rope_scaling"
    block = parameters or scaling or {}
    for key, (newer_reads, older_reads) in _ROPE_KEYS_ALSO_AT_TOP_LEVEL.items():
        if key in config and key in block and config[key] != block[key]:
            raise HFConversionError(
                f"config.json states {key} twice, differently: {config[key]!r} at the top level "
                f"and {block[key]!r} in {block_name}. transformers 5 reads {newer_reads}, "
                f"transformers 4 {older_reads}; state it once: keep the value the model was "
                f"trained with in {block_name} and delete the top-level {key}."
            )


def _rope_block(block: Mapping[str, Any], theta: Any) -> dict[str, Any]:
    """A RoPE block as transformers 5 completes it: its kind named `rope_type` (older configs
    say `type`, default RoPE where neither is stated) and the top-level base (`theta`) where
    the block states none."""
    completed = {key: value for key, value in block.items() if key != "type"}
    completed["rope_type"] = block.get("rope_type", block.get("type", "default"))
    completed.setdefault("rope_theta", theta)
    return completed


def _rope_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE flags' values: from `rope_parameters` (transformers 5) or `rope_theta` and
    `rope_scaling` (transformers 4); the RoPE base is the top-level `rope_theta` (or the
    architecture's default) where `rope_parameters` leaves it out, as transformers 5 reads it
    (`_check_rope_stated_once` has refused the configs where the two ways differ)."""
    parameters = config.get("rope_parameters")
    if parameters and any(isinstance(value, Mapping) for value in parameters.values()):
        raise HFConversionError(
            "rope_parameters per layer type are not converted (every layer must share one RoPE)."
        )
    scaling = parameters or config.get("rope_scaling") or {}
    theta = scaling.get("rope_theta", config["rope_theta"])
    partial = scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFConversionError(
            f"partial_rotary_factor {partial}: only full-width RoPE is converted."
        )
    if not isinstance(theta, (int, float)) or theta <= 0 or theta != int(theta):
        raise HFConversionError(
            f"rope_theta {theta!r}: --rotary-base takes a positive integer; this one is not."
        )
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    args = {
        "rotary_base": int(theta),
        "use_rope_scaling": False,
        "rope_scaling_factor": 8.0,  # the flag's default, read only with --use-rope-scaling
        "rotary_seq_len_interpolation_factor": None,
    }
    if kind == "llama3":
        args.update(use_rope_scaling=True, rope_scaling_factor=_llama3_factor(config, scaling))
    elif kind == "linear":
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or factor < 1 or factor != int(factor):
            raise HFConversionError(
                f"linear rope_scaling factor {factor!r}: --rotary-seq-len-interpolation-factor "
                "takes an integer >= 1."
            )
        args["rotary_seq_len_interpolation_factor"] = int(factor)
    elif kind == "yarn":
        original = "original_max_position_embeddings"
        # As transformers 5 and as for Llama 3: a top-level original context takes precedence.
        block = {**scaling, original: config.get(original, scaling.get(original))}
        max_positions = integer_field(config, "max_position_embeddings")
        args.update(position_embedding_type="yarn", **yarn_args(block, max_positions))
    elif kind != "default":
        raise HFConversionError(
            f"rope_scaling of rope_type {kind!r} is not built; Llama 3's (llama3), linear "
            "interpolation (linear) and YaRN (yarn) are."
        )
    return args


def _llama3_factor(config: Mapping[str, Any], scaling: Mapping[str, Any]) -> float:
    """Llama 3's RoPE scaling factor, once its other parameters are checked to be the ones
    this project builds (`--use-rope-scaling` takes the factor alone).

    As transformers 5 does, a top-level `original_max_position_embeddings` takes precedence
    over the scaling's, and `max_position_embeddings` stands in where both leave it out.
    """
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise HFConversionError(
            f"llama3 rope_scaling factor {factor!r}: a positive number is needed."
        )
    original = "original_max_position_embeddings"
    stated = {
        "low_freq_factor": scaling.get("low_freq_factor"),
        "high_freq_factor": scaling.get("high_freq_factor"),
        original: config.get(original, scaling.get(original)),
    }
    if stated[original] is None:
        stated[original] = integer_field(config, "max_position_embeddings")
        note = f" (config.json leaves {original} out: transformers takes max_position_embeddings)"
    else:
        note = ""
    for key, value in stated.items():
        if value is None:
            raise HFConversionError(
                f"llama3 rope_scaling without {key}: transformers needs it to load the model; "
                "add it to config.json."
            )
        if value != _LLAMA3_DEFAULTS[key]:
            raise HFConversionError(
                f"llama3 rope_scaling {key} {value}{note if key == original else ''}: Llama 3's "
                f"RoPE scaling is built with {key} {_LLAMA3_DEFAULTS[key]} only "
                "(--use-rope-scaling takes the factor alone)."
            )
    return float(factor)
