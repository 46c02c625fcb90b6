"""Transformer-configuration flags: the `TransformerConfig` fields Megatron-LM generates flags
for (QK norms, zero-centred norms, RoPE layout, attention backend, softmax sinks, the GLU's
offset and clamp, activation recompute, the fused cross-entropy), and the legacy aliases
`--recompute-activations` and `--use-flash-attn`.

`validate_transformer_options` resolves the two aliases and rejects combinations the model would
ignore or cannot run, naming the flags and the fix.
"""

from __future__ import annotations

import argparse
import logging

import torch

from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.flex_attention import FLEX_MIN_HEAD_DIM
from megatron.core.transformer.softmax_sinks import SOFTMAX_TYPES
from megatron.core.transformer.transformer_config import (
    CROSS_ENTROPY_FUSION_IMPLS,
    RECOMPUTE_MODULES,
    recompute_module_refusal,
)
from megatron.training.utils import print_rank_0


def _attn_backend(name: str) -> AttnBackend:
    """`AttnBackend` by name, as Megatron-LM's generated flag parses it."""
    try:
        return AttnBackend[name]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"invalid choice {name!r} (choose from {', '.join(b.name for b in AttnBackend)})"
        ) from None


def add_transformer_config_args(parser: argparse.ArgumentParser) -> None:
    """The "transformer configuration" group."""
    group = parser.add_argument_group(title="transformer configuration")
    group.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        dest="layernorm_zero_centered_gamma",
        help="Zero-centred norm weights: initialised to 0, the norm scales by 1 + weight.",
    )
    group.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="Normalise each query and key head (--normalization) before RoPE.",
    )
    group.add_argument(
        "--qk-l2-norm", action="store_true", help="Llama-4 QK norm: unit-RMS heads, no weight."
    )
    group.add_argument(
        "--rotary-interleaved",
        action="store_true",
        help="RoPE rotates adjacent channel pairs instead of the two halves.",
    )
    group.add_argument(
        "--apply-query-key-layer-scaling",
        action="store_true",
        help="Scale Q K^T by 1 / layer number, undone in an fp32 softmax (local backend).",
    )
    group.add_argument(
        "--attention-backend",
        type=_attn_backend,
        # A name, which argparse converts with `type`, and a metavar of names: --help and the
        # arguments print show what a user types, not `AttnBackend.auto`.
        default=AttnBackend.auto.name,
        choices=list(AttnBackend),
        metavar="{" + ",".join(backend.name for backend in AttnBackend) + "}",
        help="Attention kernel: flash, fused (cuDNN), unfused (SDPA math), local, auto.",
    )
    group.add_argument(
        "--softmax-type",
        default="vanilla",
        choices=SOFTMAX_TYPES,
        help="Sinks: off-by-one (a 0 logit), learnable (one per head, gpt-oss).",
    )
    group.add_argument(
        "--glu-linear-offset",
        type=float,
        default=0.0,
        metavar="OFFSET",
        help="GLU: act(x W) * (x V + OFFSET).",
    )
    group.add_argument(
        "--activation-func-clamp-value",
        type=float,
        metavar="C",
        help="GLU: clamp x W to <= C, x V to [-C, C].",
    )
    group.add_argument(
        "--use-flash-attn",
        action="store_true",
        help="Legacy alias of --attention-backend flash.",
    )
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Legacy alias of --recompute-granularity selective.",
    )
    group.add_argument(
        "--recompute-granularity", choices=("full", "selective"), help="Activation recompute."
    )
    group.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        help="Full recompute: chunks of --recompute-num-layers, or the first that many layers.",
    )
    group.add_argument(
        "--recompute-num-layers", type=int, help="Layers per chunk (uniform) or recomputed (block)."
    )
    group.add_argument(
        "--recompute-modules",
        nargs="+",
        help=f"Selective recompute: parts of each layer among {', '.join(RECOMPUTE_MODULES)} "
        "(default core_attn).",
    )
    group.add_argument(
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="Chunked cross-entropy: no fp32 logits for the whole vocabulary and batch.",
    )
    group.add_argument(
        "--cross-entropy-fusion-impl",
        default="native",
        choices=CROSS_ENTROPY_FUSION_IMPLS,
        help="native: the chunked PyTorch one; te: refused (unstable, as upstream).",
    )


def validate_transformer_options(args: argparse.Namespace) -> None:
    """Resolves `--recompute-activations` and `--use-flash-attn` and checks these flags.

    Raises:
        ValueError: a bad combination, an unbuilt recompute module, an attention backend this
            machine cannot run, or attention dropout where FlexAttention computes sliding
            windows and sinks; the message names the flags and the fix.
    """
    _validate_recompute(args)
    _validate_attention_backend(args)
    _validate_flex_attention(args)
    if args.qk_layernorm and args.qk_l2_norm:
        print_rank_0(
            "WARNING: --qk-layernorm and --qk-l2-norm are both set: the QK norm is --qk-l2-norm's "
            "(no weights), as in Megatron-core; drop --qk-layernorm to silence this.",
            logging.WARNING,
        )
    if args.rotary_interleaved and args.position_embedding_type != "rope":
        raise ValueError(
            f"--rotary-interleaved applies to --position-embedding-type rope, not "
            f"{args.position_embedding_type}; add --position-embedding-type rope or drop it."
        )
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te":
        raise ValueError(
            "--cross-entropy-fusion-impl te is refused, as in Megatron-LM (Transformer Engine's "
            "fused cross-entropy is numerically unstable); use --cross-entropy-fusion-impl "
            "native, or omit --cross-entropy-loss-fusion."
        )


def _validate_recompute(args: argparse.Namespace) -> None:
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            raise ValueError(
                "--recompute-activations means --recompute-granularity selective, but "
                f"--recompute-granularity {args.recompute_granularity} is given; drop one."
            )
        # The legacy alias, resolved as Megatron-LM resolves it; validation stays idempotent.
        args.recompute_granularity = "selective"
    granularity = args.recompute_granularity
    if granularity == "full":
        if args.recompute_method is None or args.recompute_num_layers is None:
            raise ValueError(
                "--recompute-granularity full needs --recompute-method (uniform or block) and "
                "--recompute-num-layers, as in Megatron-LM; e.g. --recompute-method uniform "
                "--recompute-num-layers 1 recomputes every layer."
            )
        if not 1 <= args.recompute_num_layers <= args.num_layers:
            raise ValueError(
                f"--recompute-num-layers {args.recompute_num_layers} must be in [1, --num-layers "
                f"{args.num_layers}]."
            )
    else:
        for dest in ("recompute_method", "recompute_num_layers"):
            if getattr(args, dest) is not None:
                name = "--" + dest.replace("_", "-")
                raise ValueError(
                    f"{name} applies to --recompute-granularity full only; add it or drop {name}."
                )
    if args.recompute_modules is None:
        return
    if granularity != "selective":
        raise ValueError(
            "--recompute-modules applies to --recompute-granularity selective; add it or drop "
            "--recompute-modules."
        )
    for module in args.recompute_modules:
        refusal = recompute_module_refusal(module)
        if refusal is not None:
            raise ValueError(
                f"--recompute-modules {module} {refusal}; choose among "
                f"{', '.join(RECOMPUTE_MODULES)}."
            )


def _validate_attention_backend(args: argparse.Namespace) -> None:
    if args.use_flash_attn:
        if args.attention_backend not in (AttnBackend.auto, AttnBackend.flash):
            raise ValueError(
                f"--use-flash-attn asks for --attention-backend flash, but --attention-backend "
                f"{args.attention_backend.name} is given; drop one."
            )
        # The legacy alias (Megatron-LM's FlashAttention switch), resolved to the backend.
        args.attention_backend = AttnBackend.flash
    backend = args.attention_backend
    if backend not in (AttnBackend.flash, AttnBackend.fused):
        return
    spelled = f"--attention-backend {backend.name}"
    if args.use_flash_attn:
        spelled = "--use-flash-attn"
    if not torch.cuda.is_available() or args.distributed_backend != "nccl":
        where = (
            "which is not available"
            if not torch.cuda.is_available()
            else f"and --distributed-backend {args.distributed_backend} computes on the CPU"
        )
        raise ValueError(
            f"{spelled} needs a CUDA GPU, {where}; use --attention-backend auto (or local / "
            "unfused)."
        )
    if backend == AttnBackend.flash and not torch.backends.cuda.is_flash_attention_available():
        raise ValueError(
            f"{spelled}: this PyTorch build has no FlashAttention SDPA kernel; use "
            "--attention-backend auto or fused."
        )
    if not (args.bf16 or args.fp16):
        raise ValueError(
            f"{spelled}: the {backend.name} SDPA kernel runs in half precision only; add --bf16 "
            "(or --fp16) or use --attention-backend auto."
        )
    if backend == AttnBackend.flash and args.reset_attention_mask:
        # SDPA's FlashAttention kernel takes no mask; the per-document masks would fail the
        # first forward ("No available kernel").
        raise ValueError(
            f"{spelled}: the FlashAttention SDPA kernel takes no attention mask, which "
            "--reset-attention-mask gives every sample; use --attention-backend auto (SDPA then "
            "picks a kernel that takes one) or drop --reset-attention-mask."
        )
    limit = 256
    if args.multi_latent_attention:
        # The values are padded to the queries' width for FlashAttention.
        width = args.qk_head_dim + args.qk_pos_emb_head_dim
        spelled_width = f"--qk-head-dim {args.qk_head_dim} + --qk-pos-emb-head-dim "
        spelled_width += f"{args.qk_pos_emb_head_dim} = {width}"
    else:
        width, spelled_width = args.kv_channels, f"--kv-channels {args.kv_channels}"
    if width is not None and width > limit:
        raise ValueError(
            f"{spelled}: head width {spelled_width} exceeds the kernel's {limit}; use "
            "--attention-backend auto."
        )


def _validate_flex_attention(args: argparse.Namespace) -> None:
    windows_or_sinks = args.window_size is not None or args.softmax_type != "vanilla"
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    flex = (
        args.distributed_backend == "nccl"
        and args.attention_backend == AttnBackend.auto
        and head_dim >= FLEX_MIN_HEAD_DIM
    )
    if windows_or_sinks and flex and args.attention_dropout > 0:
        raise ValueError(
            f"--attention-dropout {args.attention_dropout}: FlexAttention, which computes "
            "--window-size and --softmax-type on the GPU, has no attention dropout; pass "
            "--attention-dropout 0 (gpt-oss trains without it), or --attention-backend local "
            "(dense scores)."
        )
