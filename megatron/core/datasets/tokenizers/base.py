"""`MegatronTokenizer`: the interface every tokenizer implements, as Megatron-LM's
`MegatronLegacyTokenizer` (`megatron/core/datasets/megatron_tokenizer.py`).

Datasets and `tools/preprocess_data.py` see only this interface: `tokenize()` and
`detokenize()`, the vocabulary (`vocab`, `inv_vocab`, `vocab_size`) and the special ids. `eod`
(the id appended after each document) is the one every GPT tokenizer must have. A tokenizer
without some other special token raises `NotImplementedError` naming it, as Megatron-LM's
does, so callers that can do without it (Megatron's GPT dataset falls back to its own pad id)
catch that, and no caller mistakes a missing id for a real one.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence


class MegatronTokenizer(ABC):
    """Text to token ids and back.

    Args:
        vocab: token text -> id, complete once the subclass's constructor returns; None for a
            tokenizer whose ids have no texts (`vocab` and `inv_vocab` then raise).
        eod: the end-of-document id; a keyword every subclass must pass, None only where the
            tokenizer has none (`eod` then raises).
        bos: the beginning-of-sequence id, or None where there is none.
        eos: the end-of-sequence id, or None where there is none.
        pad: the padding id, or None where there is none.
    """

    def __init__(
        self,
        vocab: dict[str, int] | None,
        *,
        eod: int | None,
        bos: int | None = None,
        eos: int | None = None,
        pad: int | None = None,
    ):
        self._vocab = vocab
        self._special_ids = {"eod": eod, "bos": bos, "eos": eos, "pad": pad}

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` (no end-of-document id: callers append `eod` themselves)."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids (`ids` may be a list or a 1-D integer array)."""

    @property
    def vocab_size(self) -> int:
        """Number of ids: every id the tokenizer produces is in [0, vocab_size)."""
        return len(self.vocab)

    @property
    def vocab(self) -> dict[str, int]:
        """Token text to id.

        Raises:
            NotImplementedError: the ids have no texts.
        """
        if self._vocab is None:
            raise self._missing("vocab")
        return self._vocab

    @functools.cached_property
    def inv_vocab(self) -> dict[int, str]:
        """Id to token text (built on first use).

        Raises:
            NotImplementedError: the ids have no texts.
        """
        return {index: token for token, index in self.vocab.items()}

    @property
    def eod(self) -> int:
        """The end-of-document id, appended after each document when preprocessing.

        Raises:
            NotImplementedError: the tokenizer has none.
        """
        return self._special_id("eod")

    @property
    def bos(self) -> int:
        """The beginning-of-sequence id.

        Raises:
            NotImplementedError: the tokenizer has none.
        """
        return self._special_id("bos")

    @property
    def eos(self) -> int:
        """The end-of-sequence id.

        Raises:
            NotImplementedError: the tokenizer has none.
        """
        return self._special_id("eos")

    @property
    def pad(self) -> int:
        """The padding id.

        Raises:
            NotImplementedError: the tokenizer has none.
        """
        return self._special_id("pad")

    def _special_id(self, name: str) -> int:
        """The id of special token `name`, or Megatron's error where the tokenizer has none."""
        index = self._special_ids[name]
        if index is None:
            raise self._missing(name)
        return index

    def _missing(self, name: str) -> NotImplementedError:
        """The error for a special token this tokenizer does not have (Megatron-LM's)."""
        return NotImplementedError(f"{type(self).__name__} has no attribute '{name}'")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"
