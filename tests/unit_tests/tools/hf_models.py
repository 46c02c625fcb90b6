"""Tiny random Hugging Face models (dense and MoE), saved as `save_pretrained()` saves them (no
download), and this project's model built from `tools/convert_hf.py`'s flags as
`pretrain_gpt.py` builds it.

The weights are drawn wide (std 0.2, norm scales around 1, random biases) so that attention is
far from uniform: a RoPE or QKV layout error then moves the logits by far more than the parity
tolerance, which `test_convert_hf.py` checks as well.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import pretrain_gpt
from megatron.core.models.gpt import GPTModel
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import build_tokenizer, set_args, unset_tokenizer

TRAINING_FLAGS = (
    "--micro-batch-size 2 --lr 1e-4 --train-iters 1 --mock-data "
    "--num-workers 0 --eval-iters 0 --distributed-backend gloo"
).split()
"""Training flags `pretrain_gpt.py` needs besides the model's."""

SEQ_LENGTH = 256
"""Tokens per test sequence (a later `--seq-length` overrides the printed one): long enough for
Llama 3's RoPE scaling to turn the slow channel pairs by a large angle."""

_SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=256,
)

MODELS: dict[str, dict[str, Any]] = {
    # Llama 2: one key/value head per query head, untied, no tokenizer in the directory.
    "llama2": dict(
        architecture="LlamaForCausalLM", num_key_value_heads=4, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Llama 3: GQA, RoPE base 500000 and scaling, a tokenizer with fewer ids than the
    # embedding's 120 rows (padded to them by --make-vocab-size-divisible-by 24).
    "llama3": dict(
        architecture="LlamaForCausalLM", vocab_size=120,
        rope_theta=500000.0, max_position_embeddings=16384, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tokenizer_ids=100,
    ),
    # Mistral: heads wider than hidden / heads (--kv-channels), no sliding window, sharded.
    "mistral": dict(
        architecture="MistralForCausalLM", head_dim=32, sliding_window=None,
        rope_theta=1000000.0, tie_word_embeddings=False, max_shard_size="40KB",
    ),
    # Qwen2: QKV bias, tied embeddings, a tokenizer with more ids than the embedding has rows
    # (the embedding is padded with zero rows).
    "qwen2": dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=True, tokenizer_ids=100),
    # Mixtral: 4 experts, top-2 with renormalised weights, in several files.
    "mixtral": dict(
        architecture="MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
        sliding_window=None, tie_word_embeddings=False, max_shard_size="60KB",
    ),
    # Qwen2-MoE: top-2 without renormalisation, a gated shared expert, QKV bias, and layer 0
    # dense (decoder_sparse_step 2) with its own width.
    "qwen2_moe": dict(
        architecture="Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, shared_expert_intermediate_size=80, decoder_sparse_step=2,
        norm_topk_prob=False, tie_word_embeddings=False,
    ),
}  # fmt: skip
"""Each architecture's test model: `_SMALL` with these config fields; `tokenizer_ids` saves a
tokenizer of that many ids, `max_shard_size` several safetensors files."""


def hf_config(name: str, **overrides: Any):
    """The transformers config of test model `name`."""
    import transformers

    fields = {**_SMALL, **MODELS[name], **overrides}
    architecture = fields.pop("architecture")
    fields.pop("tokenizer_ids", None)
    fields.pop("max_shard_size", None)
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    return config_class(**fields, architectures=[architecture])


def save_hf_model(name: str, directory: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Saves random test model `name` (with the config fields `overrides`) and its tokenizer
    into `directory`; returns it."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(name, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.2)
            if parameter_name.endswith("norm.weight"):
                parameter.add_(1.0)
    model.save_pretrained(directory, max_shard_size=MODELS[name].get("max_shard_size", "5GB"))
    if "tokenizer_ids" in MODELS[name]:
        save_tokenizer(directory, MODELS[name]["tokenizer_ids"])
    return model


def save_tokenizer(directory: Path, ids: int) -> None:
    """A word-level tokenizer of `ids` ids (two of them special) saved into `directory`."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, ids)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>"
    )
    wrapped.save_pretrained(str(directory))


def parse_flags(flags: list[str], world_size: int = 1) -> argparse.Namespace:
    """`pretrain_gpt.py`'s validated arguments for the model `flags` on `world_size` ranks
    (the tokenizer's padded vocabulary set, as `initialize_megatron()` sets it)."""
    batch = ["--global-batch-size", str(2 * world_size)]  # a micro-batch of 2 per rank
    args = parse_args(args=[*flags, *TRAINING_FLAGS, *batch, "--seq-length", str(SEQ_LENGTH)])
    validate_args(args, world_size=world_size)
    build_tokenizer(args)
    unset_tokenizer()
    return args


def project_model(flags: list[str], world_size: int = 1) -> GPTModel:
    """This project's model for the model `flags`, built by `pretrain_gpt.model_provider` (on
    each of `world_size` ranks: its expert-parallel groups initialised by the caller)."""
    set_args(parse_flags(flags, world_size))
    try:
        return pretrain_gpt.model_provider().eval()
    finally:
        set_args(None)


def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def load_hf_model(directory: Path) -> torch.nn.Module:
    """The model in `directory`, as a user loads it (local files only)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True
    ).eval()


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `directory`."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
