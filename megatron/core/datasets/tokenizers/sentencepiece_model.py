"""`SentencePieceTokenizer`, `GPTSentencePieceTokenizer` and `Llama2Tokenizer`: a SentencePiece
`.model` file's own ids.

Megatron-LM (0.19) builds all three types through its SentencePiece library wrapper, alike and
without legacy special tokens: the ids are the model's (vocabulary size = the model's piece
count, nothing appended), `tokenize()` is the model's plain encoding (no BOS or EOS added; the
text of a special piece, `<s>` say, is encoded as text), and the end-of-document id is the
model's EOS piece. (Megatron-LM's tokenizer before 0.19 appended `<CLS> <SEP> <EOD> <MASK>` to
`SentencePieceTokenizer`'s vocabulary and ended documents with `<EOD>`: data tokenized that way
has other ids.) A model trained with EOS disabled has no end-of-document id: building one of
these tokenizers from it is a `ValueError`, since every GPT document ends with one. The
`sentencepiece` package is imported only when a tokenizer is built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from megatron.core.datasets.tokenizers.base import MegatronTokenizer


def load_processor(model_file: str | os.PathLike, tokenizer: str) -> Any:
    """The `sentencepiece.SentencePieceProcessor` of a `.model` file, with named errors.

    Args:
        model_file: the SentencePiece `.model` file (`--tokenizer-model`).
        tokenizer: the tokenizer type reading it, for the messages.

    Raises:
        FileNotFoundError: `model_file` does not exist.
        ValueError: `model_file` is not a SentencePiece model.
        ImportError: the `sentencepiece` package is not installed.
    """
    if not os.path.isfile(model_file):
        raise FileNotFoundError(
            f"--tokenizer-model {model_file}: no such file; {tokenizer} reads a SentencePiece "
            ".model file."
        )
    try:
        import sentencepiece
    except ImportError as error:
        raise ImportError(
            f"{tokenizer} needs the `sentencepiece` package: pip install sentencepiece"
        ) from error
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    except (RuntimeError, OSError) as error:
        raise ValueError(
            f"--tokenizer-model {model_file} is not a SentencePiece model: {error}"
        ) from error


def decode_model_ids(processor: Any, ids: list[int], tokenizer: str, vocab_size: int) -> str:
    """Text of a model's own ids, checked first (SentencePiece fails on an id outside the model
    with no useful message).

    Args:
        processor: the SentencePiece model.
        ids: ids of its pieces.
        tokenizer: the tokenizer type, and `vocab_size` its vocabulary size, for the message.

    Raises:
        ValueError: an id is not one of the model's pieces.
    """
    for index in ids:
        if not 0 <= index < len(processor):
            raise ValueError(f"{tokenizer}: id {index} is not in [0, {vocab_size}).")
    return processor.decode_ids(ids)


class GPTSentencePieceTokenizer(MegatronTokenizer):
    """A SentencePiece model's ids, EOS as the end of document.

    Args:
        model_file: the SentencePiece `.model` file (`--tokenizer-model`).

    Raises:
        FileNotFoundError: `model_file` does not exist.
        ValueError: `model_file` is not a SentencePiece model, or it has no EOS piece.
        ImportError: the `sentencepiece` package is not installed.
    """

    def __init__(self, model_file: str | os.PathLike):
        name = type(self).__name__
        self._processor = load_processor(model_file, name)
        size = len(self._processor)
        ids = {
            "bos": self._processor.bos_id(),
            "eos": self._processor.eos_id(),
            "pad": self._processor.pad_id(),
        }
        # SentencePiece reports a disabled piece as -1.
        ids = {key: (index if 0 <= index < size else None) for key, index in ids.items()}
        if ids["eos"] is None:
            raise ValueError(
                f"--tokenizer-model {model_file}: the model has no EOS piece, which is {name}'s "
                "end-of-document id; train it with eos_id set (SentencePiece's default)."
            )
        vocab = {self._processor.id_to_piece(index): index for index in range(size)}
        super().__init__(vocab, eod=ids["eos"], **ids)

    def tokenize(self, text: str) -> list[int]:
        return list(self._processor.encode_as_ids(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(index) for index in ids]
        return decode_model_ids(self._processor, ids, type(self).__name__, self.vocab_size)

    @property
    def vocab_size(self) -> int:
        """The model's piece count."""
        return len(self._processor)


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Any SentencePiece model, read as `GPTSentencePieceTokenizer` reads it (Megatron-LM builds
    both the same way)."""


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama 2's tokenizer: its SentencePiece `tokenizer.model`, read as
    `GPTSentencePieceTokenizer` reads any model (Megatron-LM builds both the same way)."""
