"""`NullTokenizer`: the text already is token ids, written as whitespace-separated integers.

Megatron-core's `NullTokenizer`, for data tokenized elsewhere: `--vocab-size N` is the whole
vocabulary, ids 0 to N - 1; the end-of-document id is N - 1 unless `--null-tokenizer-eod-id`
names another, and there is no pad id unless `--null-tokenizer-pad-id` names one (its default,
-1, means none). (Megatron-LM's legacy `_NullTokenizer` added an EOD id N on top; Megatron-LM
builds this one.) Unlike Megatron-core's, any whitespace separates ids and an id outside
[0, N) is a `ValueError` rather than a token the model's embedding cannot hold.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from megatron.core.datasets.tokenizers.base import MegatronTokenizer


def _integer(value: object) -> int | None:
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


class NullTokenizer(MegatronTokenizer):
    """Parses `"5 17 3"` into `[5, 17, 3]` and back.

    Args:
        vocab_size: the number of ids (`--vocab-size`), the end-of-document id included.
        eod_id: the end-of-document id (`--null-tokenizer-eod-id`); None: `vocab_size - 1`.
        pad_id: the pad id (`--null-tokenizer-pad-id`); -1: none.

    Raises:
        ValueError: `vocab_size` is not a positive integer, or an id is outside the vocabulary.
    """

    def __init__(self, vocab_size: int, eod_id: int | None = None, pad_id: int = -1):
        size = _integer(vocab_size)
        if size is None or size < 1:
            raise ValueError(
                f"NullTokenizer: --vocab-size must be a positive integer, got {vocab_size!r}."
            )
        eod = size - 1 if eod_id is None else _integer(eod_id)
        if eod is None or not 0 <= eod < size:
            raise ValueError(
                f"NullTokenizer: --null-tokenizer-eod-id {eod_id!r} is not an id of the "
                f"vocabulary [0, {size}); choose one below --vocab-size {size}."
            )
        pad = _integer(pad_id)
        if pad is None or not -1 <= pad < size:
            raise ValueError(
                f"NullTokenizer: --null-tokenizer-pad-id {pad_id!r} is neither -1 (no pad) nor "
                f"an id of the vocabulary [0, {size})."
            )
        self._size = size
        # The ids have no texts: vocab and inv_vocab raise.
        super().__init__(None, eod=eod, eos=eod, pad=None if pad == -1 else pad)

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                index = int(word)
            except ValueError:
                raise ValueError(
                    f"NullTokenizer: {word!r} is not an integer token id (its text must be "
                    "whitespace-separated ids)."
                ) from None
            if not 0 <= index < self.vocab_size:
                raise ValueError(
                    f"NullTokenizer: id {index} is not in [0, {self.vocab_size}); raise "
                    "--vocab-size to the number of ids the data uses."
                )
            ids.append(index)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(index)) for index in ids)

    @property
    def vocab_size(self) -> int:
        return self._size
