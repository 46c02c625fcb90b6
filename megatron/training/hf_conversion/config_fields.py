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
