"""`GPTSentencePieceTokenizer` and `Llama2Tokenizer`: a SentencePiece `.model` file's own ids.

Megatron-LM builds both types (and `SentencePieceTokenizer`) through its SentencePiece library
wrapper without legacy special tokens: the ids are the model's (vocabulary size = the model's
piece count, nothing appended), `tokenize()` is the model's plain encoding (no BOS or EOS
added), and the end-of-document id is the model's EOS piece. This project's
`SentencePieceTokenizer` keeps the legacy `<CLS> <SEP> <EOD> <MASK>` tokens instead (see
`sentencepiece_tokenizer.py`). A model trained with EOS disabled has no end-of-document id:
building one of these tokenizers from it is a `ValueError`, since every GPT document ends with
one. The `sentencepiece` package is imported only when a tokenizer is built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from megatron.core.datasets.tokenizers.base import MegatronTokenizer
from megatron.core.datasets.tokenizers.sentencepiece_tokenizer import (
    decode_model_ids,
    load_processor,
)


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


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama 2's tokenizer: its SentencePiece `tokenizer.model`, read as
    `GPTSentencePieceTokenizer` reads any model (Megatron-LM builds both the same way)."""
