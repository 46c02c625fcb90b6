"""Which Hugging Face tensors make each tensor of this project's GPT model, and how.

Most tensors are the same matrix under another name. Two are fused here: the attention's
`linear_qkv` holds, for each of the `num_query_groups` key/value heads in turn, that group's
query heads, then its key head, then its value head (Megatron's layout, which
`SelfAttention.get_query_key_value_tensors` reads), and the MLP's `linear_fc1` holds SwiGLU's
gate projection followed by its up projection (`MLP.forward` chunks it in two). The word
embedding and output layer have `padded_vocab_size` rows; rows past the Hugging Face
vocabulary are zeros (`to_megatron`) and are dropped again (`to_hf`).

Every function takes the model's flag values (`config.model_args_from_hf_config`'s, or a
checkpoint's saved arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Hugging Face entries that are not weights (buffers some older checkpoints hold)."""


@dataclass(frozen=True)
class Conversion:
    """One tensor of this project's model and the Hugging Face tensors it is made of.

    Attributes:
        name: Its name in `GPTModel.state_dict()`.
        hf_names: The Hugging Face tensors, in the order the layout concatenates them.
        layout: "same" (one tensor, renamed), "qkv", "fc1" (fused, see the module docstring)
            or "vocab" (one tensor with the rows padded to `padded_vocab_size`).
        group: What export writes into one file: "embedding", "layer N" or "output".
    """

    name: str
    hf_names: tuple[str, ...]
    layout: str
    group: str


_LAYER_TENSORS = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "same"),
    ("self_attention.linear_qkv.weight", tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    ("self_attention.linear_qkv.bias", tuple(f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "same"),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "same"),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "same"),
)
"""Each layer's tensors: the name below `decoder.layers.N.`, those below `model.layers.N.`, the
layout."""


def conversions(args: Mapping[str, Any]) -> list[Conversion]:
    """Every tensor of the model `args` describes, embedding first, then layer by layer."""
    result = [
        Conversion(
            "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "embedding"
        )
    ]
    for index in range(args["num_layers"]):
        for ours, theirs, layout in _LAYER_TENSORS:
            if ours.endswith(".bias") and not args["add_qkv_bias"]:
                continue
            result.append(
                Conversion(
                    f"decoder.layers.{index}.{ours}",
                    tuple(f"model.layers.{index}.{name}" for name in theirs),
                    layout,
                    f"layer {index}",
                )
            )
    result.append(
        Conversion("decoder.final_layernorm.weight", ("model.norm.weight",), "same", "output")
    )
    if args["untie_embeddings_and_output_weights"]:
        result.append(Conversion("output_layer.weight", ("lm_head.weight",), "vocab", "output"))
    return result


def hf_shapes(args: Mapping[str, Any], vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor of the model `args` describes, with
    `vocab_size` embedding rows."""
    hidden, ffn = args["hidden_size"], args["ffn_hidden_size"]
    queries = args["num_attention_heads"] * args["kv_channels"]
    keys = args["num_query_groups"] * args["kv_channels"]
    by_suffix = {
        "embed_tokens.weight": (vocab_size, hidden),
        "lm_head.weight": (vocab_size, hidden),
        "norm.weight": (hidden,),
        "layernorm.weight": (hidden,),
        "q_proj.weight": (queries, hidden),
        "k_proj.weight": (keys, hidden),
        "v_proj.weight": (keys, hidden),
        "q_proj.bias": (queries,),
        "k_proj.bias": (keys,),
        "v_proj.bias": (keys,),
        "o_proj.weight": (hidden, queries),
        "gate_proj.weight": (ffn, hidden),
        "up_proj.weight": (ffn, hidden),
        "down_proj.weight": (hidden, ffn),
    }
    shapes = {}
    for conversion in conversions(args):
        for name in conversion.hf_names:
            suffix = next(key for key in by_suffix if name.endswith(key))
            shapes[name] = by_suffix[suffix]
    return shapes


def to_megatron(
    conversion: Conversion, tensors: list[torch.Tensor], args: Mapping[str, Any]
) -> torch.Tensor:
    """This project's tensor from the Hugging Face `tensors` (`conversion.hf_names` order).

    Works on meta tensors too (to learn the result's shape and dtype without data).
    """
    if conversion.layout == "same":
        (tensor,) = tensors
        return tensor
    if conversion.layout == "vocab":
        (tensor,) = tensors
        padding = args["padded_vocab_size"] - tensor.shape[0]
        if padding == 0:
            return tensor
        return torch.cat([tensor, tensor.new_zeros(padding, *tensor.shape[1:])])
    if conversion.layout == "fc1":
        return torch.cat(tensors)
    query, key, value = tensors
    groups, head_dim = args["num_query_groups"], args["kv_channels"]
    rest = query.shape[1:]  # (hidden,) for the weight, () for the bias
    per_group = [
        query.reshape(groups, -1, *rest),
        key.reshape(groups, head_dim, *rest),
        value.reshape(groups, head_dim, *rest),
    ]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def to_hf(
    conversion: Conversion, tensor: torch.Tensor, args: Mapping[str, Any], vocab_size: int
) -> list[torch.Tensor]:
    """The Hugging Face tensors (`conversion.hf_names` order) of this project's `tensor`,
    each contiguous and owning its memory (as safetensors writes them), with `vocab_size`
    rows for the embedding and output layer."""
    if conversion.layout == "same":
        return [tensor]
    if conversion.layout == "vocab":
        return [tensor if tensor.shape[0] == vocab_size else tensor[:vocab_size].clone()]
    if conversion.layout == "fc1":
        return [part.clone() for part in tensor.chunk(2)]
    groups, head_dim = args["num_query_groups"], args["kv_channels"]
    heads_per_group = args["num_attention_heads"] // groups
    rest = tensor.shape[1:]
    per_group = tensor.reshape(groups, (heads_per_group + 2) * head_dim, *rest)
    parts = per_group.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return [part.reshape(-1, *rest).clone() for part in parts]
