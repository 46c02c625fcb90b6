"""`SentencePieceTokenizer`: a SentencePiece `.model` file (`--tokenizer-model`).

Megatron-LM's `SentencePieceTokenizer`, so the same model gives the same ids: the model's
pieces keep their ids, and the special tokens `<CLS>`, `<SEP>`, `<EOD>`, `<MASK>` and the
model's pad, bos and eos pieces (`<PAD>`, `<BOS>`, `<EOS>` where the model has none) are added
after them unless the model already holds them. The end-of-document id is `<EOD>`'s. A special
token's text inside the input becomes its id, and `detokenize()` writes special ids back as
their text between spaces (NeMo's behaviour, which Megatron-LM copies). The `sentencepiece`
package is imported only when a tokenizer is built.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from megatron.core.datasets.tokenizers.base import MegatronTokenizer

SPECIAL_TOKENS = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")
"""Added before the model's own pad, bos and eos pieces, in Megatron-LM's order."""


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


class SentencePieceTokenizer(MegatronTokenizer):
    """A SentencePiece model with Megatron-LM's special tokens.

    Args:
        model_file: the SentencePiece `.model` file (`--tokenizer-model`).

    Raises:
        FileNotFoundError: `model_file` does not exist.
        ValueError: `model_file` is not a SentencePiece model.
        ImportError: the `sentencepiece` package is not installed.
    """

    def __init__(self, model_file: str | os.PathLike):
        self._processor = load_processor(model_file, type(self).__name__)
        vocab = {self._processor.id_to_piece(index): index for index in range(len(self._processor))}
        self._special_tokens: dict[str, int] = {}
        for token in SPECIAL_TOKENS:
            self._add_special_token(vocab, token)
        pad = self._add_special_token(vocab, self._piece_or(self._processor.pad_id(), "<PAD>"))
        bos = self._add_special_token(vocab, self._piece_or(self._processor.bos_id(), "<BOS>"))
        eos = self._add_special_token(vocab, self._piece_or(self._processor.eos_id(), "<EOS>"))
        super().__init__(vocab, eod=self._special_tokens["<EOD>"], bos=bos, eos=eos, pad=pad)
        self._inv_special_tokens = {index: token for token, index in self._special_tokens.items()}
        # In insertion order: where two special tokens match at one position, the first wins
        # (Megatron-LM's tie-break).
        self._special_pattern = re.compile(
            "(" + "|".join(re.escape(token) for token in self._special_tokens) + ")"
        )

    def _piece_or(self, index: int, fallback: str) -> str:
        """The model's piece of a special id, or `fallback` where the model disabled it (-1)."""
        return self._processor.id_to_piece(index) if 0 <= index < len(self._processor) else fallback

    def _add_special_token(self, vocab: dict[str, int], token: str) -> int:
        """Registers a special token, appending it to `vocab` if the model lacks it."""
        if token not in vocab:
            vocab[token] = len(vocab)
        self._special_tokens[token] = vocab[token]
        return vocab[token]

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        # re.split with a group alternates text and the special tokens between it.
        for position, part in enumerate(self._special_pattern.split(text)):
            if position % 2:
                ids.append(self._special_tokens[part])
            elif part:
                ids.extend(self._processor.encode_as_ids(part))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text = ""
        pending: list[int] = []
        for index in (int(index) for index in ids):
            if index in self._inv_special_tokens:
                text += self._decode(pending) + " " + self._inv_special_tokens[index] + " "
                pending = []
            else:
                pending.append(index)
        return text + self._decode(pending)

    def _decode(self, ids: list[int]) -> str:
        """Text of the model's own ids."""
        return decode_model_ids(self._processor, ids, type(self).__name__, self.vocab_size)

    @property
    def cls(self) -> int:
        return self._special_tokens["<CLS>"]

    @property
    def sep(self) -> int:
        return self._special_tokens["<SEP>"]

    @property
    def mask(self) -> int:
        return self._special_tokens["<MASK>"]
