"""The GPT the benchmarking tools build: its command-line flags and its construction.

Defaults are the 1.34B benchmark configuration (hidden 2048, 24 layers, 16 heads, vocab 32000,
RoPE). Imported by the scripts in this folder (`python tools/<script>.py` puts it on the path).
"""

from __future__ import annotations

import argparse

import torch

from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig


def add_model_args(parser: argparse.ArgumentParser, micro_batch_size: int = 2) -> None:
    """Adds the model-shape, batch and precision flags."""
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=micro_batch_size)
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters and compute")


def build_gpt(
    args: argparse.Namespace, bf16: bool | None = None
) -> tuple[TransformerConfig, GPTModel]:
    """The config and model the flags describe, on the current default device (use
    `with torch.device(...)`, `meta` included).

    Args:
        args: the flags of `add_model_args`.
        bf16: overrides `args.bf16` (e.g. an fp32 model whose engine casts to bf16 itself).
    """
    bf16 = args.bf16 if bf16 is None else bf16
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
    )
    return config, model
