"""Which Hugging Face tensors make each tensor of this project's DeepSeek-V3 model, and their
shapes (`deepseek_v3.py` converts the config).

Multi-latent attention's tensors are transformers' under Megatron-core's names
(`q_a_proj` -> `linear_q_down_proj`, `q_a_layernorm` -> `q_layernorm`, `q_b_proj` ->
`linear_q_up_proj`, or `q_proj` -> `linear_q_proj` without `q_lora_rank`;
`kv_a_proj_with_mqa` -> `linear_kv_down_proj`, `kv_a_layernorm` -> `kv_layernorm`, `kv_b_proj`
-> `linear_kv_up_proj`, `o_proj` -> `linear_proj`): both lay out the query up-projection's rows
per head as [unrotated, rotated], the key/value down-projection's as [latent, shared rotated
key], and `kv_b_proj`'s per head as [key, value], so only a config without `rope_interleave`
changes rows (its rotated channels permuted into adjacent pairs: the "mla_q" and "mla_kv_down"
layouts of `tensors.py`).

An MoE layer's router is `mlp.gate` (its `e_score_correction_bias` the router's `expert_bias`),
its experts stacked as `tensors.py` describes, its shared experts `mlp.shared_experts` (fc1
fused as a dense MLP's). Multi-token prediction depth i is transformers' layer
`num_hidden_layers + i`: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` (the depth's
`final_layernorm`) and a decoder layer (`transformer_layer`); its `embed_tokens` and
`shared_head.head` are copies of the model's embedding and output layer, which this project's
depths share (layout "copy": checked and skipped on import, written on export, as DeepSeek-V3's
checkpoints hold them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from megatron.training.hf_conversion.moe import moe_layers
from megatron.training.hf_conversion.tensors import Conversion

_Tensor = tuple[str, tuple[tuple[str, tuple[int, ...]], ...], str]
"""One tensor of this project's layer: its name below the layer, its Hugging Face tensors
below transformers' layer with their shapes, and the layout."""


def conversions(args: Mapping[str, Any], rope_interleaved: bool) -> list[Conversion]:
    """Every tensor of the DeepSeek-V3 model `args` describes: embedding, layers, final norm
    and output layer, then the multi-token prediction depths.

    Args:
        args: The model's flag values.
        rope_interleaved: The Hugging Face weights rotate adjacent channel pairs
            (`deepseek_v3.rope_interleaved`).
    """
    return [conversion for conversion, _ in _tensors(args, rope_interleaved, vocab_size=0)]


def hf_shapes(
    args: Mapping[str, Any], rope_interleaved: bool, vocab_size: int
) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor of the model `args` describes, with
    `vocab_size` embedding rows."""
    return {
        name: shape
        for conversion, shapes in _tensors(args, rope_interleaved, vocab_size)
        for name, shape in zip(conversion.hf_names, shapes)
    }


def _tensors(
    args: Mapping[str, Any], rope_interleaved: bool, vocab_size: int
) -> Iterator[tuple[Conversion, tuple[tuple[int, ...], ...]]]:
    hidden = args["hidden_size"]
    embedding = "embedding.word_embeddings.weight"
    yield (
        Conversion(embedding, ("model.embed_tokens.weight",), "vocab", "embedding"),
        ((vocab_size, hidden),),
    )
    layers = args["num_layers"]
    for index, moe in enumerate(moe_layers(args)):
        yield from _layer(
            args, rope_interleaved, moe, f"decoder.layers.{index}.", index, f"layer {index}"
        )
    norm = Conversion("decoder.final_layernorm.weight", ("model.norm.weight",), "same", "output")
    yield norm, ((hidden,),)
    untied = args["untie_embeddings_and_output_weights"]
    output = "output_layer.weight" if untied else embedding
    if untied:
        yield Conversion(output, ("lm_head.weight",), "vocab", "output"), ((vocab_size, hidden),)
    for depth in range(args.get("mtp_num_layers") or 0):
        ours, theirs = f"mtp.layers.{depth}.", f"model.layers.{layers + depth}."
        group = f"mtp {depth}"
        for name, hf_name, shape in (
            ("enorm.weight", "enorm.weight", (hidden,)),
            ("hnorm.weight", "hnorm.weight", (hidden,)),
            ("eh_proj.weight", "eh_proj.weight", (hidden, 2 * hidden)),
            ("final_layernorm.weight", "shared_head.norm.weight", (hidden,)),
        ):
            yield Conversion(ours + name, (theirs + hf_name,), "same", group), (shape,)
        # The depth's layer is an MoE layer, as transformers builds it (and as this project
        # builds it from the decoder's last layer, which `deepseek_v3` checks is one).
        yield from _layer(
            args, rope_interleaved, True, ours + "transformer_layer.", layers + depth, group
        )
        for name, hf_name in (
            (embedding, "embed_tokens.weight"),
            (output, "shared_head.head.weight"),
        ):
            yield Conversion(name, (theirs + hf_name,), "copy", group), ((vocab_size, hidden),)


def _layer(
    args: Mapping[str, Any],
    rope_interleaved: bool,
    moe: bool,
    prefix: str,
    hf_index: int,
    group: str,
) -> Iterator[tuple[Conversion, tuple[tuple[int, ...], ...]]]:
    tensors = [*_attention(args, rope_interleaved), *(_moe(args) if moe else _dense_mlp(args))]
    for ours, theirs, layout in tensors:
        names, shapes = zip(*theirs)
        yield (
            Conversion(
                prefix + ours,
                tuple(f"model.layers.{hf_index}.{name}" for name in names),
                layout,
                group,
            ),
            shapes,
        )


def _attention(args: Mapping[str, Any], rope_interleaved: bool) -> list[_Tensor]:
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    q_rank, kv_rank = args["q_lora_rank"], args["kv_lora_rank"]
    rotated = args["qk_pos_emb_head_dim"]
    query_rows = heads * (args["qk_head_dim"] + rotated)
    q_layout, kv_layout = ("same", "same") if rope_interleaved else ("mla_q", "mla_kv_down")
    norm = ("input_layernorm.weight", (("input_layernorm.weight", (hidden,)),), "same")
    if q_rank is None:
        query = [
            (
                "self_attention.linear_q_proj.weight",
                (("self_attn.q_proj.weight", (query_rows, hidden)),),
                q_layout,
            )
        ]
    else:
        query = [
            (
                "self_attention.linear_q_down_proj.weight",
                (("self_attn.q_a_proj.weight", (q_rank, hidden)),),
                "same",
            ),
            (
                "self_attention.q_layernorm.weight",
                (("self_attn.q_a_layernorm.weight", (q_rank,)),),
                "same",
            ),
            (
                "self_attention.linear_q_up_proj.weight",
                (("self_attn.q_b_proj.weight", (query_rows, q_rank)),),
                q_layout,
            ),
        ]
    key_value = [
        (
            "self_attention.linear_kv_down_proj.weight",
            (("self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rotated, hidden)),),
            kv_layout,
        ),
        (
            "self_attention.kv_layernorm.weight",
            (("self_attn.kv_a_layernorm.weight", (kv_rank,)),),
            "same",
        ),
        (
            "self_attention.linear_kv_up_proj.weight",
            (
                (
                    "self_attn.kv_b_proj.weight",
                    (heads * (args["qk_head_dim"] + args["v_head_dim"]), kv_rank),
                ),
            ),
            "same",
        ),
        (
            "self_attention.linear_proj.weight",
            (("self_attn.o_proj.weight", (hidden, heads * args["v_head_dim"])),),
            "same",
        ),
        ("pre_mlp_layernorm.weight", (("post_attention_layernorm.weight", (hidden,)),), "same"),
    ]
    return [norm, *query, *key_value]


def _mlp(prefix: str, ours: str, hidden: int, width: int) -> list[_Tensor]:
    """A SwiGLU MLP's tensors: `ours` (this project's module) from transformers' `prefix`."""
    return [
        (
            f"{ours}.linear_fc1.weight",
            (
                (f"{prefix}.gate_proj.weight", (width, hidden)),
                (f"{prefix}.up_proj.weight", (width, hidden)),
            ),
            "fc1",
        ),
        (f"{ours}.linear_fc2.weight", ((f"{prefix}.down_proj.weight", (hidden, width)),), "same"),
    ]


def _dense_mlp(args: Mapping[str, Any]) -> list[_Tensor]:
    return _mlp("mlp", "mlp", args["hidden_size"], args["ffn_hidden_size"])


def _moe(args: Mapping[str, Any]) -> list[_Tensor]:
    hidden, experts = args["hidden_size"], args["num_experts"]
    width = args["moe_ffn_hidden_size"]
    return [
        ("mlp.router.weight", (("mlp.gate.weight", (experts, hidden)),), "same"),
        ("mlp.router.expert_bias", (("mlp.gate.e_score_correction_bias", (experts,)),), "same"),
        (
            "mlp.experts.linear_fc1.weight",
            tuple(
                (f"mlp.experts.{e}.{projection}.weight", (width, hidden))
                for e in range(experts)
                for projection in ("gate_proj", "up_proj")
            ),
            "experts_fc1",
        ),
        (
            "mlp.experts.linear_fc2.weight",
            tuple((f"mlp.experts.{e}.down_proj.weight", (hidden, width)) for e in range(experts)),
            "experts_fc2",
        ),
        *_mlp(
            "mlp.shared_experts",
            "mlp.shared_experts",
            hidden,
            args["moe_shared_expert_intermediate_size"],
        ),
    ]
