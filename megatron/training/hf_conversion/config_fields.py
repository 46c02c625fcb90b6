"""The conversion's error, and reading the fields of a Hugging Face `config.json`: what the
dense (`config.py`) and MoE (`moe.py`) parts of the conversion share.

A `config.json` may leave fields out (hand-written ones, and those of older transformers
versions); transformers then takes its config class's default, which differs by architecture
(Mixtral's RoPE base is 1e6, Llama's 1e4). `with_defaults` fills them in the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron.training.checkpoint_layout import CheckpointError


class HFConversionError(CheckpointError):
    """A Hugging Face checkpoint or config this project cannot convert; the message says why
    and what to do."""


_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "sliding_window": None,
    "num_key_value_heads": None,  # None: as many as the attention heads
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}
"""transformers' defaults of the fields the conversion reads, for Llama and where an
architecture has no default of its own."""

ARCHITECTURE_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": _DEFAULTS,
    "MistralForCausalLM": {**_DEFAULTS, "sliding_window": 4096, "num_key_value_heads": 8},
    "Qwen2ForCausalLM": {
        **_DEFAULTS,
        "num_key_value_heads": 32,
        "use_sliding_window": False,
        "qkv_bias": True,  # Qwen2's projections always have one: no field of its own
    },
    "MixtralForCausalLM": {
        **_DEFAULTS,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-5,
        "num_key_value_heads": 8,
        "router_jitter_noise": 0.0,
    },
    "Qwen2MoeForCausalLM": {
        **_DEFAULTS,
        "num_key_value_heads": 16,
        "use_sliding_window": False,
        "qkv_bias": True,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "Qwen3ForCausalLM": {
        **_DEFAULTS,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "use_sliding_window": False,
        "attention_bias": False,
    },
    "Qwen3MoeForCausalLM": {
        **_DEFAULTS,
        "num_key_value_heads": 4,
        "use_sliding_window": False,
        "attention_bias": False,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "DeepseekV3ForCausalLM": {
        **_DEFAULTS,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "rope_interleave": True,
        "attention_bias": False,
        "num_nextn_predict_layers": 1,
    },
    "GptOssForCausalLM": {
        **_DEFAULTS,
        "rope_theta": 150000.0,
        "rms_norm_eps": 1e-5,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": None,  # None: windows on alternate layers, from the first
        "attention_bias": True,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "router_aux_loss_coef": 0.001,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
}
"""Per converted architecture, the value transformers' config class gives each field the
conversion reads with a default, where `config.json` leaves it out."""


def with_defaults(config: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The config, with transformers' defaults for `architecture` where it leaves fields out."""
    return {**ARCHITECTURE_DEFAULTS[architecture], **config}


def integer_field(config: Mapping[str, Any], key: str) -> int:
    """The config's `key`, a positive integer.

    Raises:
        HFConversionError: it is missing or not a positive integer.
    """
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HFConversionError(f"config.json's {key} is {value!r}; a positive integer is needed.")
    return value


def aliased_field(config: Mapping[str, Any], key: str, alias: str) -> Any:
    """The config's `key`, which transformers also reads under the name `alias` (its config
    class's `attribute_map`: transformers 5 writes Qwen3-MoE's `num_experts` as
    `num_local_experts`, for one); None where neither is stated.

    Raises:
        HFConversionError: both are stated, with different values.
    """
    if key in config and alias in config and config[key] != config[alias]:
        raise HFConversionError(
            f"config.json states {key} {config[key]!r} and {alias} {config[alias]!r}, which "
            f"transformers reads as one field; keep the value the model has under {key} and "
            f"delete {alias}."
        )
    return config.get(key, config.get(alias))


def check_not_quantized(config: Mapping[str, Any], name: str, how_to_dequantize: str) -> None:
    """Refuses a config with a `quantization_config`: its weights are stored quantised (in
    integer or FP8 dtypes, with scales), which this converter does not read.

    Args:
        config: The `config.json`.
        name: Its architecture.
        how_to_dequantize: Where the user gets a floating-point copy (part of the message).
    """
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
        raise HFConversionError(
            f"{name} with quantization_config (quant_method {method!r}): its weights are stored "
            f"quantised, which this converter does not read; convert a bf16 copy with "
            f"quantization_config removed ({how_to_dequantize})."
        )
