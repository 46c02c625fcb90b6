"""Tiny random Hugging Face models (dense and MoE), saved as `save_pretrained()` saves them (no
download), and this project's model built from `tools/convert_hf.py`'s flags as
`pretrain_gpt.py` builds it.

The weights are drawn wide (std 0.2, norm scales around 1, random biases, DeepSeek-V3's expert
score correction too) so that attention is far from uniform and the routing depends on every
routing parameter: a RoPE, QKV or routing error then moves the logits by far more than the
parity tolerance, which `test_convert_hf.py` checks as well.

transformers' DeepSeek-V3 model has no multi-token prediction layers (its `save_pretrained`
leaves them out); `save_hf_model` adds them to the directory as DeepSeek-V3's checkpoints hold
them (`model.layers.<num_hidden_layers + i>`, `save_mtp_layers`), which transformers'
`MtpModel` reads (`load_hf_mtp_model`).
"""

from __future__ import annotations

import argparse
import json
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

TRANSFORMERS_MIN_VERSION = "5.24"
"""The transformers release the tests that compare against its DeepSeek-V3 multi-token prediction
layers (`MtpModel`) and gpt-oss models need, as the test extras pin it (`setup.py`): 5.17 has
no `MtpModel.forward_layer`, and its gpt-oss experts clamp at 7.0 whatever the config's
`swiglu_limit` (the tests set 1.0, so that the clamp bites)."""

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
    # Qwen3: query-key norms over heads wider than hidden / heads, tied embeddings.
    "qwen3": dict(
        architecture="Qwen3ForCausalLM", head_dim=32, rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    # Qwen3-MoE: query-key norms, top-2 renormalised, layer 0 dense (mlp_only_layers).
    "qwen3_moe": dict(
        architecture="Qwen3MoeForCausalLM", head_dim=24, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0],
        tie_word_embeddings=False,
    ),
    # DeepSeek-V3: multi-latent attention with YaRN acting within the sequence (both mscales),
    # a dense first layer, 8 experts in 4 groups (top 4 of the best 2 groups), 2 shared experts,
    # a routed scaling factor and one multi-token prediction layer, in several files.
    "deepseek_v3": dict(
        architecture="DeepseekV3ForCausalLM", num_hidden_layers=3, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
        moe_intermediate_size=16, routed_scaling_factor=2.5, first_k_dense_replace=1,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.9,
                             mscale_all_dim=0.7, original_max_position_embeddings=64,
                             beta_fast=32, beta_slow=1),
        num_nextn_predict_layers=1, tie_word_embeddings=False, max_shard_size="100KB",
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


def save_hf_model(
    name: str, directory: Path, seed: int = 0, *, mtp_layers: bool = True, **overrides: Any
) -> torch.nn.Module:
    """Saves random test model `name` (with the config fields `overrides`) and its tokenizer
    into `directory`, and the multi-token prediction layers its config states unless not
    `mtp_layers` (as transformers saves DeepSeek-V3); returns it."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(name, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for tensor_name, tensor in _random_tensors(model):
            _draw(tensor_name, tensor)
    model.save_pretrained(directory, max_shard_size=MODELS[name].get("max_shard_size", "5GB"))
    if "tokenizer_ids" in MODELS[name]:
        save_tokenizer(directory, MODELS[name]["tokenizer_ids"])
    if mtp_layers and getattr(config, "num_nextn_predict_layers", 0):
        save_mtp_layers(directory, config, seed)
    return model


def _random_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and DeepSeek-V3's expert score corrections (buffers)."""
    buffers = [
        (name, buffer)
        for name, buffer in model.named_buffers()
        if name.endswith("e_score_correction_bias")
    ]
    return [*model.named_parameters(), *buffers]


def _draw(name: str, tensor: torch.Tensor, generator: torch.Generator | None = None) -> None:
    tensor.normal_(0.0, 0.2, generator=generator)
    if name.endswith("norm.weight"):
        tensor.add_(1.0)


def save_mtp_layers(directory: Path, config: Any, seed: int) -> None:
    """Adds random multi-token prediction layers to a saved DeepSeek-V3 directory, as
    DeepSeek-V3's checkpoints hold them: depth i is `model.layers.<num_hidden_layers + i>`, a
    decoder layer shaped as the last one (an MoE layer) with `enorm`, `hnorm`, `eh_proj`,
    `shared_head.norm`, and copies of the embedding (`embed_tokens`) and output layer
    (`shared_head.head`). They go into a file of their own, named by the index."""
    from safetensors.torch import save_file

    saved = safetensors_of(directory)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    last = f"model.layers.{layers - 1}."
    generator = torch.Generator().manual_seed(seed + 1)
    added: dict[str, torch.Tensor] = {}
    for depth in range(config.num_nextn_predict_layers):
        prefix = f"model.layers.{layers + depth}."
        shapes = {
            prefix + name[len(last) :]: tensor.shape
            for name, tensor in saved.items()
            if name.startswith(last)
        }
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            shapes[prefix + name] = (hidden,)
        shapes[prefix + "eh_proj.weight"] = (hidden, 2 * hidden)
        for name, shape in shapes.items():
            added[name] = torch.empty(shape)
            _draw(name, added[name], generator)
        added[prefix + "embed_tokens.weight"] = saved["model.embed_tokens.weight"].clone()
        head = "lm_head.weight" if "lm_head.weight" in saved else "model.embed_tokens.weight"
        added[prefix + "shared_head.head.weight"] = saved[head].clone()
    save_file(added, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        contents = json.loads(index.read_text())
    else:  # transformers reads a lone model.safetensors without an index: rename it
        (directory / "model.safetensors").rename(directory / "model-main.safetensors")
        contents = {"metadata": {}, "weight_map": dict.fromkeys(saved, "model-main.safetensors")}
    contents["weight_map"].update(dict.fromkeys(added, "model-mtp.safetensors"))
    index.write_text(json.dumps(contents, indent=2))


def load_hf_mtp_model(directory: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The DeepSeek-V3 model in `directory` and its multi-token prediction layers, as
    transformers reads them (`MtpModel.from_pretrained`, local files only)."""
    import transformers
    from transformers.modeling_layers import MtpModel

    config = json.loads((directory / "config.json").read_text())
    layers, depths = config["num_hidden_layers"], config["num_nextn_predict_layers"]

    class SmallDeepseekV3(transformers.DeepseekV3ForCausalLM):
        # transformers finds the depths by these patterns, written for DeepSeek-V3's 61 layers.
        _keys_to_ignore_on_load_unexpected = [
            rf"model\.layers\.{layers + depth}\..*" for depth in range(depths)
        ]

    main = SmallDeepseekV3.from_pretrained(directory, local_files_only=True).eval()
    return main, MtpModel.from_pretrained(main).eval()


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
