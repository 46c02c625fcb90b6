"""`NullTokenizer`: the text already is token ids, written as whitespace-separated integers.

Megatron-LM's `_NullTokenizer`, for data tokenized elsewhere: `--vocab-size N` is the number of
ids the text may use, and the tokenizer adds one more, the end-of-document id N, so its
`vocab_size` is N + 1. Unlike Megatron-LM's, any whitespace separates ids (Megatron-LM splits
on single spaces, so a double space or a newline breaks it) and an id that is not an integer in
[0, N] is a `ValueError` rather than a token the model's embedding cannot hold.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from megatron.core.datasets.tokenizers.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Parses `"5 17 3"` into `[5, 17, 3]` and back.

    Args:
        vocab_size: the number of ids the text uses (`--vocab-size`), without the
            end-of-document id, which is `vocab_size`.

    Raises:
        ValueError: `vocab_size` is not a positive integer.
    """

    def __init__(self, vocab_size: int):
        try:
            size = None if isinstance(vocab_size, bool) else operator.index(vocab_size)
        except TypeError:
            size = None
        if size is None or size < 1:
            raise ValueError(
                f"NullTokenizer: --vocab-size must be a positive integer, got {vocab_size!r}."
            )
        # The ids have no texts: vocab and inv_vocab raise.
        super().__init__(None, eod=size, eos=size)

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
        return self.eod + 1
