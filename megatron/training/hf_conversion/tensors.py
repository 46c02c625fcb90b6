"""Which Hugging Face tensors make each tensor of this project's GPT model, and how.

Most tensors are the same matrix under another name. Two are fused here: the attention's
`linear_qkv` holds, for each of the `num_query_groups` key/value heads in turn, that group's
query heads, then its key head, then its value head (Megatron's layout, which
`SelfAttention.get_query_key_value_tensors` reads), and the MLP's `linear_fc1` holds SwiGLU's
gate projection followed by its up projection (`MLP.forward` chunks it in two). The word
embedding and output layer have `padded_vocab_size` rows; rows past the Hugging Face
vocabulary are zeros (`to_megatron`) and are dropped again (`to_hf`).

An MoE layer's experts are stacked: `mlp.experts.linear_fc1.weight` is the global
[num_experts, 2 * moe_ffn_hidden_size, hidden] tensor whose row e is expert e's gate then up
projection (Mixtral's `w1` and `w3`), `linear_fc2.weight` the [num_experts, hidden,
moe_ffn_hidden_size] stack of the down projections (`w2`), as checkpoints hold expert tensors
at any expert-parallel size. The router and Qwen2-MoE's shared expert and its gate are renamed
(the shared expert's `linear_fc1` fused as the dense MLP's), and so are Qwen3's per-head query
and key norms. gpt-oss's layers have tensors of their own (`gpt_oss.GPT_OSS_LAYER_TENSORS`): its
experts are already stacked, transposed (x @ W) and with the gate and up columns interleaved
("experts_gate_up", "experts_down").

DeepSeek-V3's tensors are listed by `deepseek_v3_tensors.py`, with two layouts of its own:
"mla_q" and "mla_kv_down" permute the rotated rows of multi-latent attention's query
up-projection (per head) and key/value down-projection from transformers' rotate-half pairing
(channel i with i + d/2, a config without `rope_interleave`) into adjacent pairs, as this
project rotates them; "copy" is a Hugging Face copy of the embedding or output layer (written
on export, not read on import).

Every function takes the model's flag values (`config.model_args_from_hf_config`'s, or a
checkpoint's saved arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron.training.hf_conversion.gpt_oss import GPT_OSS_LAYER_TENSORS, is_gpt_oss
from megatron.training.hf_conversion.moe import MIXTRAL, moe_architecture, moe_layers

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Hugging Face entries that are not weights (buffers some older checkpoints hold)."""


@dataclass(frozen=True)
class Conversion:
    """One tensor of this project's model and the Hugging Face tensors it is made of.

    Attributes:
        name: Its name in `GPTModel.state_dict()`.
        hf_names: The Hugging Face tensors, in the order the layout concatenates them.
        layout: "same" (one tensor, renamed), "qkv", "fc1", "experts_fc1", "experts_fc2"
            (fused or stacked, see the module docstring), "experts_gate_up" (one stack with
            interleaved gate and up columns -> the gate then up rows; for a [E, 2 I] bias, its
            entries the same way), "experts_down" (one stack, transposed), "vocab" (one tensor
            with the rows padded to `padded_vocab_size`), or DeepSeek-V3's "mla_q",
            "mla_kv_down" and "copy".
        group: What export writes into one file: "embedding", "layer N", "output" or
            "mtp N".
    """

    name: str
    hf_names: tuple[str, ...]
    layout: str
    group: str


_ATTENTION_TENSORS = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "same"),
    ("self_attention.linear_qkv.weight", tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    ("self_attention.linear_qkv.bias", tuple(f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "same"),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "same"),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "same"),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "same"),
)
"""Each layer's tensors up to its MLP: the name below `decoder.layers.N.`, those below
`model.layers.N.`, the layout."""

_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
"""The per-head query and key norms among `_ATTENTION_TENSORS` (`--qk-layernorm`: Qwen3's)."""

_DENSE_MLP_TENSORS = (
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "same"),
)
"""A dense layer's MLP tensors, named as `_ATTENTION_TENSORS`."""

_SHARED_EXPERT_TENSORS = (
    (
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        "fc1",
    ),
    ("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_expert.down_proj.weight",), "same"),
)
"""Qwen2-MoE's shared expert, named as `_ATTENTION_TENSORS`."""


def _moe_tensors(args: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], str]]:
    """An MoE layer's MLP tensors, named as `_ATTENTION_TENSORS`: Mixtral's names, or Qwen2-MoE's
    and Qwen3-MoE's (`moe.moe_architecture`)."""
    experts = range(args["num_experts"])
    shared = args["moe_shared_expert_intermediate_size"] is not None
    block, gate, up, down = (
        ("block_sparse_moe", "w1", "w3", "w2")
        if moe_architecture(args) == MIXTRAL
        else ("mlp", "gate_proj", "up_proj", "down_proj")
    )
    tensors = [
        ("mlp.router.weight", (f"{block}.gate.weight",), "same"),
        (
            "mlp.experts.linear_fc1.weight",
            tuple(f"{block}.experts.{e}.{p}.weight" for e in experts for p in (gate, up)),
            "experts_fc1",
        ),
        (
            "mlp.experts.linear_fc2.weight",
            tuple(f"{block}.experts.{e}.{down}.weight" for e in experts),
            "experts_fc2",
        ),
    ]
    if shared:
        tensors += _SHARED_EXPERT_TENSORS
    if args["moe_shared_expert_gate"]:
        tensors.append(
            ("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",), "same")
        )
    return tensors


def _layer_tensors(args: Mapping[str, Any], moe: bool) -> list[tuple[str, tuple[str, ...], str]]:
    """A layer's tensors, named as `_ATTENTION_TENSORS`: gpt-oss's, or the attention's and the
    (MoE, with `moe`) MLP's of a Llama-family model, the QKV bias only with `add_qkv_bias`."""
    if is_gpt_oss(args):
        return list(GPT_OSS_LAYER_TENSORS)
    tensors = [*_ATTENTION_TENSORS, *(_moe_tensors(args) if moe else _DENSE_MLP_TENSORS)]
    return [t for t in tensors if args["add_qkv_bias"] or not t[0].endswith(".bias")]


def _layer_tensors(args: Mapping[str, Any], moe: bool) -> list[tuple[str, tuple[str, ...], str]]:
    """A layer's tensors, named as `_ATTENTION_TENSORS`: gpt-oss's, or the attention's and the
    (MoE, with `moe`) MLP's of a Llama-family model, the QKV bias only with `add_qkv_bias` and
    the query-key norms only with `qk_layernorm`."""
    if is_gpt_oss(args):
        return list(GPT_OSS_LAYER_TENSORS)
    tensors = [*_ATTENTION_TENSORS, *(_moe_tensors(args) if moe else _DENSE_MLP_TENSORS)]
    return [
        (ours, theirs, layout)
        for ours, theirs, layout in tensors
        if (args["add_qkv_bias"] or not ours.endswith(".bias"))
        and (args["qk_layernorm"] or ours not in _QK_NORMS)
    ]


def conversions(args: Mapping[str, Any]) -> list[Conversion]:
    """Every tensor of the model `args` describes, embedding first, then layer by layer."""
    result = [
        Conversion(
            "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "embedding"
        )
    ]
    for index, moe in enumerate(moe_layers(args)):
        for ours, theirs, layout in _layer_tensors(args, moe):
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
    return {
        name: _hf_shape(name, args, vocab_size)
        for conversion in conversions(args)
        for name in conversion.hf_names
    }


def _hf_shape(name: str, args: Mapping[str, Any], vocab_size: int) -> tuple[int, ...]:
    hidden = args["hidden_size"]
    queries = args["num_attention_heads"] * args["kv_channels"]
    keys = args["num_query_groups"] * args["kv_channels"]
    if ".shared_expert." in name:
        ffn = args["moe_shared_expert_intermediate_size"]
    elif ".experts." in name:
        ffn = args["moe_ffn_hidden_size"]
    else:
        ffn = args["ffn_hidden_size"]
    experts = args["num_experts"]
    by_suffix = {
        # gpt-oss's (before Llama's: "o_proj.bias" ends like no Llama name; the experts' stacks)
        "self_attn.o_proj.bias": (hidden,),
        "self_attn.sinks": (args["num_attention_heads"],),
        "mlp.router.weight": (experts, hidden),
        "mlp.router.bias": (experts,),
        "experts.gate_up_proj": (experts, hidden, 2 * ffn),
        "experts.gate_up_proj_bias": (experts, 2 * ffn),
        "experts.down_proj": (experts, ffn, hidden),
        "experts.down_proj_bias": (experts, hidden),
        "embed_tokens.weight": (vocab_size, hidden),
        "lm_head.weight": (vocab_size, hidden),
        "q_norm.weight": (args["kv_channels"],),  # before the norms', whose suffix they have
        "k_norm.weight": (args["kv_channels"],),
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
        "w1.weight": (ffn, hidden),
        "w3.weight": (ffn, hidden),
        "w2.weight": (hidden, ffn),
        "shared_expert_gate.weight": (1, hidden),  # before the router's, whose suffix it has
        "gate.weight": (args["num_experts"], hidden),
    }
    return by_suffix[next(key for key in by_suffix if name.endswith(key))]


def to_megatron(
    conversion: Conversion, tensors: list[torch.Tensor], args: Mapping[str, Any]
) -> torch.Tensor:
    """This project's tensor from the Hugging Face `tensors` (`conversion.hf_names` order).

    Works on meta tensors too (to learn the result's shape and dtype without data).
    """
    if conversion.layout == "same":
        (tensor,) = tensors
        return tensor
    if conversion.layout in ("vocab", "copy"):
        (tensor,) = tensors
        padding = args["padded_vocab_size"] - tensor.shape[0]
        if padding == 0:
            return tensor
        return torch.cat([tensor, tensor.new_zeros(padding, *tensor.shape[1:])])
    if conversion.layout == "fc1":
        return torch.cat(tensors)
    if conversion.layout == "experts_fc1":  # (gate, up) per expert
        return torch.stack([torch.cat(tensors[i : i + 2]) for i in range(0, len(tensors), 2)])
    if conversion.layout == "experts_fc2":
        return torch.stack(tensors)
    if conversion.layout in ("mla_q", "mla_kv_down"):
        (tensor,) = tensors
        return _mla_rotated_rows(tensor, conversion.layout, args, to_pairs=True)
    if conversion.layout == "experts_gate_up":  # [E, hidden, 2I] x @ W, or its [E, 2I] bias
        (tensor,) = tensors
        halves = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
        return halves.transpose(1, 2).contiguous() if halves.dim() == 3 else halves
    if conversion.layout == "experts_down":
        (tensor,) = tensors
        return tensor.transpose(1, 2).contiguous()
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
    if conversion.layout == "copy":  # of a tensor written under another name too
        return [tensor[:vocab_size].clone()]
    if conversion.layout == "fc1":
        return [part.clone() for part in tensor.chunk(2)]
    if conversion.layout == "experts_fc1":
        return [part.clone() for expert in tensor for part in expert.chunk(2)]
    if conversion.layout == "experts_fc2":
        return [expert.clone() for expert in tensor]
    if conversion.layout in ("mla_q", "mla_kv_down"):
        return [_mla_rotated_rows(tensor, conversion.layout, args, to_pairs=False)]
    if conversion.layout == "experts_gate_up":
        halves = tensor.transpose(1, 2) if tensor.dim() == 3 else tensor
        gate, up = halves.chunk(2, dim=-1)
        return [torch.stack([gate, up], dim=-1).flatten(-2)]
    if conversion.layout == "experts_down":
        return [tensor.transpose(1, 2).contiguous()]
    groups, head_dim = args["num_query_groups"], args["kv_channels"]
    heads_per_group = args["num_attention_heads"] // groups
    rest = tensor.shape[1:]
    per_group = tensor.reshape(groups, (heads_per_group + 2) * head_dim, *rest)
    parts = per_group.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return [part.reshape(-1, *rest).clone() for part in parts]


def _mla_rotated_rows(
    tensor: torch.Tensor, layout: str, args: Mapping[str, Any], *, to_pairs: bool
) -> torch.Tensor:
    """Multi-latent attention's query up-projection ("mla_q": per head, [unrotated, rotated]
    rows) or key/value down-projection ("mla_kv_down": [latent, rotated] rows) with its rotated
    rows permuted from transformers' rotate-half pairing to adjacent pairs (`to_pairs`), or
    back: pair i's channels are rows i and i + d/2 there, rows 2i and 2i + 1 here."""
    rotated = args["qk_pos_emb_head_dim"]
    if layout == "mla_q":
        rows = tensor.unflatten(0, (args["num_attention_heads"], -1))
        dim = 1
    else:
        rows, dim = tensor, 0
    kept, rope = rows.split([rows.shape[dim] - rotated, rotated], dim=dim)
    pairs = (2, rotated // 2) if to_pairs else (rotated // 2, 2)
    rope = rope.unflatten(dim, pairs).transpose(dim, dim + 1).flatten(dim, dim + 1)
    return torch.cat([kept, rope], dim=dim).reshape(tensor.shape)
