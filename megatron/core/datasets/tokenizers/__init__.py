"""Tokenizers for GPT data, under Megatron-LM's `--tokenizer-type` names, and
`build_tokenizer()`, which makes one from Megatron-LM's flags.

| `--tokenizer-type` | needs | end-of-document id |
|---|---|---|
| `ByteLevelTokenizer` | nothing (UTF-8 bytes; the quick start's) | `<eos>` (258) |
| `GPT2BPETokenizer` | `--vocab-file`, `--merge-file` | `<\\|endoftext\\|>` |
| `SentencePieceTokenizer` | `--tokenizer-model` (a `.model` file; `sentencepiece`) | EOS |
| `GPTSentencePieceTokenizer` | `--tokenizer-model` (a `.model` file; `sentencepiece`) | EOS |
| `Llama2Tokenizer` | `--tokenizer-model` (Llama 2's `tokenizer.model`; `sentencepiece`) | EOS |
| `TikTokenizer` | `--tokenizer-model` (a `.tiktoken` / `.json` rank file; `tiktoken`) | `</s>` |
| `HuggingFaceTokenizer` | `--tokenizer-model` (a local directory; `transformers`) | EOS |
| `NullTokenizer` | `--vocab-size N` (text is ids 0 to N - 1) | N - 1 (`--null-tokenizer-eod-id`) |

`TikTokenizer` also reads `--vocab-size` (optional), `--tiktoken-pattern`,
`--tiktoken-num-special-tokens` and `--tokenizer-special-tokens`; the other types ignore the two
`--tiktoken-*` flags, as Megatron-LM's do (its Llama 3 launch scripts pass `--tiktoken-pattern v2`
with `NullTokenizer`).
"""

from __future__ import annotations

import os

from megatron.core.datasets.tokenizers.base import MegatronTokenizer
from megatron.core.datasets.tokenizers.byte_level import ByteLevelTokenizer
from megatron.core.datasets.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.datasets.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.core.datasets.tokenizers.null import NullTokenizer
from megatron.core.datasets.tokenizers.sentencepiece_model import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.core.datasets.tokenizers.tiktoken_tokenizer import (
    DEFAULT_NUM_SPECIAL_TOKENS,
    TikTokenizer,
)

TOKENIZER_TYPES = (
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)
"""The `--tokenizer-type` choices."""

_FLAGS = {
    "vocab_file": "--vocab-file",
    "merge_file": "--merge-file",
    "tokenizer_model": "--tokenizer-model",
    "vocab_size": "--vocab-size",
    "special_tokens": "--tokenizer-special-tokens",
    "null_eod_id": "--null-tokenizer-eod-id",
    "null_pad_id": "--null-tokenizer-pad-id",
}

_REQUIRED = {
    "ByteLevelTokenizer": (),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}
"""The arguments each type needs."""

_OPTIONAL = {
    "TikTokenizer": ("vocab_size", "special_tokens"),
    "NullTokenizer": ("null_eod_id", "null_pad_id"),
}
"""The arguments a type reads when given; a type takes no argument outside these two tables."""

_HINTS = {
    "vocab_file": "the GPT-2 vocab.json",
    "merge_file": "the GPT-2 merges.txt",
    "tokenizer_model": (
        "a SentencePiece .model file, a .tiktoken rank file or a HuggingFace tokenizer directory"
    ),
    "vocab_size": "the number of ids of the pre-tokenized text, its EOD id included",
    "special_tokens": "the special tokens' texts",
}


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
    special_tokens: list[str] | None = None,
    null_eod_id: int | None = None,
    null_pad_id: int | None = None,
) -> MegatronTokenizer:
    """The tokenizer Megatron-LM's flags describe.

    Args:
        tokenizer_type: one of `TOKENIZER_TYPES` (`--tokenizer-type`).
        vocab_file: `--vocab-file` (GPT2BPETokenizer).
        merge_file: `--merge-file` (GPT2BPETokenizer).
        tokenizer_model: `--tokenizer-model` (SentencePieceTokenizer, HuggingFaceTokenizer).
        vocab_size: `--vocab-size` (NullTokenizer and TikTokenizer: the whole vocabulary).
        tiktoken_pattern: `--tiktoken-pattern` (TikTokenizer; ignored by the other types).
        tiktoken_num_special_tokens: `--tiktoken-num-special-tokens` (TikTokenizer; ignored by
            the other types).
        special_tokens: `--tokenizer-special-tokens` (TikTokenizer).
        null_eod_id: `--null-tokenizer-eod-id` (NullTokenizer; None: vocab_size - 1).
        null_pad_id: `--null-tokenizer-pad-id` (NullTokenizer; None or -1: no pad id).

    Raises:
        ValueError: an unknown type, a missing argument the type needs, or one it does not
            read (which would be silently ignored otherwise), naming the flag.
        FileNotFoundError: a file or directory the type needs does not exist.
    """
    if tokenizer_type not in _REQUIRED:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type!r} is not one of: {', '.join(TOKENIZER_TYPES)}."
        )
    given = {
        "vocab_file": vocab_file,
        "merge_file": merge_file,
        "tokenizer_model": tokenizer_model,
        "vocab_size": vocab_size,
        "special_tokens": special_tokens,
        "null_eod_id": null_eod_id,
        "null_pad_id": null_pad_id,
    }
    needed = _REQUIRED[tokenizer_type]
    read = needed + _OPTIONAL.get(tokenizer_type, ())
    for name in needed:
        if given[name] is None:
            raise ValueError(
                f"--tokenizer-type {tokenizer_type} needs {_FLAGS[name]} ({_HINTS[name]})."
            )
    for name, value in given.items():
        if value is not None and name not in read:
            raise ValueError(
                f"--tokenizer-type {tokenizer_type} does not read {_FLAGS[name]}; drop it "
                "(or choose the tokenizer type that uses it)."
            )
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(
            tokenizer_model,
            pattern=tiktoken_pattern,
            vocab_size=vocab_size,
            num_special_tokens=tiktoken_num_special_tokens,
            special_tokens=special_tokens,
        )
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    return NullTokenizer(vocab_size, null_eod_id, -1 if null_pad_id is None else null_pad_id)


__all__ = [
    "TOKENIZER_TYPES",
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "MegatronTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "build_tokenizer",
]
