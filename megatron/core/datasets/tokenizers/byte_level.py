"""`ByteLevelTokenizer`: UTF-8 bytes as tokens; needs no vocabulary file.

Ids 0..255 are the bytes of the UTF-8 encoding, so any text round-trips exactly; the special
tokens follow them (NeMo's layout): 256 `<pad>`, 257 `<bos>`, 258 `<eos>`, which is also the
end-of-document id. The vocabulary is tiny (259 ids), which makes it the quick start's
tokenizer: a small model trains on real text without a vocabulary to download.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.datasets.tokenizers.base import MegatronTokenizer

NUM_BYTES = 256
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
"""The special tokens, in id order from `NUM_BYTES` on."""


class ByteLevelTokenizer(MegatronTokenizer):
    """Each UTF-8 byte is a token: `tokenize(text) == list(text.encode("utf-8"))`.

    `detokenize()` drops special ids and decodes the bytes with `errors="replace"`, so a
    sequence cut inside a multi-byte character decodes to U+FFFD rather than raising. An id
    outside the vocabulary is a `ValueError`. The vocabulary's texts are `<0x00>`..`<0xFF>`
    (SentencePiece's names for byte tokens) and the special tokens.
    """

    def __init__(self):
        vocab = {_byte_token(byte): byte for byte in range(NUM_BYTES)}
        for offset, token in enumerate(SPECIAL_TOKENS):
            vocab[token] = NUM_BYTES + offset
        super().__init__(
            vocab, eod=vocab["<eos>"], bos=vocab["<bos>"], eos=vocab["<eos>"], pad=vocab["<pad>"]
        )

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        data = bytearray()
        for index in ids:
            if 0 <= index < NUM_BYTES:
                data.append(index)
            elif not NUM_BYTES <= index < self.vocab_size:
                raise ValueError(
                    f"ByteLevelTokenizer: id {index} is not in [0, {self.vocab_size})."
                )
        return data.decode("utf-8", errors="replace")


def _byte_token(byte: int) -> str:
    """The token text of a byte: its hex value, which cannot collide with a special token."""
    return f"<0x{byte:02X}>"
