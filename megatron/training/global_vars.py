"""The running job's parsed command-line arguments (`get_args()`) and tokenizer
(`get_tokenizer()`), readable from anywhere, as in Megatron-LM: model providers and
forward-step functions take no `args` parameter."""

from __future__ import annotations

import argparse
import logging

from megatron.core.datasets.tokenizers import MegatronTokenizer
from megatron.core.datasets.tokenizers import build_tokenizer as build_core_tokenizer
from megatron.training.arguments_validation import vocab_size_with_padding
from megatron.training.utils import print_rank_0

VOCABULARY_FROM_FILES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
)
"""Tokenizer types whose vocabulary their files give: Megatron-LM ignores `--vocab-size` with
them (its own launch scripts pass it with `HuggingFaceTokenizer`), and so does this project,
saying so."""

_GLOBAL_ARGS: argparse.Namespace | None = None
_GLOBAL_TOKENIZER: MegatronTokenizer | None = None


def get_args() -> argparse.Namespace:
    """The validated arguments `initialize_megatron()` stored.

    Raises:
        RuntimeError: no job has initialised them yet.
    """
    if _GLOBAL_ARGS is None:
        raise RuntimeError(
            "get_args() before initialize_megatron(): call pretrain() or initialize_megatron() "
            "first."
        )
    return _GLOBAL_ARGS


def set_args(args: argparse.Namespace | None) -> None:
    """Stores `args` for `get_args()` (None forgets them)."""
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def get_tokenizer() -> MegatronTokenizer:
    """The tokenizer `build_tokenizer()` made for the job.

    Raises:
        RuntimeError: the job has none (no `--tokenizer-type`).
    """
    if _GLOBAL_TOKENIZER is None:
        raise RuntimeError(
            "get_tokenizer(): this job has no tokenizer; pass --tokenizer-type (and the files "
            "it reads)."
        )
    return _GLOBAL_TOKENIZER


def build_tokenizer(args: argparse.Namespace) -> MegatronTokenizer | None:
    """Builds the tokenizer `--tokenizer-type` names (None without one), keeps it for
    `get_tokenizer()`, and sets `args.padded_vocab_size` from its vocabulary.

    Raises:
        ValueError: a flag the tokenizer needs is missing, or one it does not read is set.
        FileNotFoundError: a file it reads does not exist.
    """
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = None
    if args.tokenizer_type is None:
        return None
    _GLOBAL_TOKENIZER = tokenizer_from_args(args)
    args.padded_vocab_size = vocab_size_with_padding(_GLOBAL_TOKENIZER.vocab_size, args)
    return _GLOBAL_TOKENIZER


def tokenizer_from_args(args: argparse.Namespace) -> MegatronTokenizer:
    """The tokenizer the tokenizer flags (`add_tokenizer_args`) name; no global state.
    `--vocab-size` with a type of `VOCABULARY_FROM_FILES` is ignored, with a warning.

    Raises:
        ValueError, FileNotFoundError: as `megatron.core.datasets.tokenizers.build_tokenizer`.
    """
    vocab_size = args.vocab_size
    if vocab_size is not None and args.tokenizer_type in VOCABULARY_FROM_FILES:
        print_rank_0(
            f"WARNING: --tokenizer-type {args.tokenizer_type} takes its vocabulary from its "
            f"files; --vocab-size {vocab_size} is ignored, as Megatron-LM ignores it.",
            logging.WARNING,
        )
        vocab_size = None
    return build_core_tokenizer(
        args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=vocab_size,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        special_tokens=args.special_tokens,
        **(
            dict(null_eod_id=args.null_tokenizer_eod_id, null_pad_id=args.null_tokenizer_pad_id)
            if args.tokenizer_type == "NullTokenizer"
            else {}
        ),
    )


def unset_tokenizer() -> None:
    """Forgets the job's tokenizer."""
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = None
