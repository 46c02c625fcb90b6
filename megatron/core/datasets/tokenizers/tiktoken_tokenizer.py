"""`TikTokenizer`: a byte-level BPE run by the `tiktoken` package, from a local file.

Megatron-LM's `TikTokenizer` (`megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py`),
so the same file and flags give the same ids:

- The first `--tiktoken-num-special-tokens` ids (1000) are special tokens: the
  `--tokenizer-special-tokens` list (default `<unk> <s> </s> <mask> <pad> <cls> <sep>`, which
  any custom list must contain), then fillers `<SPECIAL_7>`, `<SPECIAL_8>`, ... up to that
  count. The file's BPE ranks follow, shifted by that count.
- `--vocab-size` is the whole vocabulary (2**17 = 131072 when not given): the file's first
  vocab-size - num-special ranks are kept, and the file must hold at least that many.
- `--tiktoken-pattern` (`v1` or `v2`, default `v2`) is the pre-tokenisation regex.
- The end-of-document id is `</s>`'s (2 by default); `tokenize()` turns the text of any special
  token into its id, as Megatron-LM's (`allowed_special="all"`).

The file is either Megatron-LM's JSON list (`[{"rank": 0, "token_bytes": base64, "token_str":
...}, ...]`, a `.json` file) or tiktoken's own `.tiktoken` format (one `base64-bytes rank` pair a
line, as `tiktoken.load.load_tiktoken_bpe` reads). Ranks must be 0, 1, 2, ... in order and the
first 256 the single bytes, so every text encodes. Nothing is downloaded. The `tiktoken`
package is imported only when a tokenizer is built.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Sequence

from megatron.core.datasets.tokenizers.base import MegatronTokenizer

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
"""`--tiktoken-pattern` choices: Megatron-LM's pre-tokenisation regexes."""

DEFAULT_PATTERN = "v2"
DEFAULT_VOCAB_SIZE = 2**17
DEFAULT_NUM_SPECIAL_TOKENS = 1000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
"""The special tokens every list must hold (Megatron-LM's default list, in its order)."""


def load_ranks(path: str | os.PathLike) -> list[bytes]:
    """The BPE tokens of a rank file, in rank order (index = rank).

    Args:
        path: Megatron-LM's `.json` list or a `.tiktoken` file.

    Raises:
        ValueError: the file is not in either format, or its ranks are not 0, 1, 2, ... in
            order with the 256 single bytes first.
    """
    path = str(path)
    tokens: list[bytes] = []
    ranks: list[int] = []
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as file:
                for entry in json.load(file):
                    tokens.append(base64.b64decode(entry["token_bytes"], validate=True))
                    ranks.append(int(entry["rank"]))
        else:
            with open(path, "rb") as file:
                for line in file:
                    if line.strip():
                        token, rank = line.split()
                        tokens.append(base64.b64decode(token, validate=True))
                        ranks.append(int(rank))
    except (ValueError, KeyError, TypeError, binascii.Error) as error:
        raise ValueError(
            f"--tokenizer-model {path}: not a tiktoken rank file (a .json list of "
            f"{{rank, token_bytes, token_str}} or `base64 rank` lines): {error!r}"
        ) from error
    if ranks != list(range(len(ranks))):
        raise ValueError(f"--tokenizer-model {path}: the ranks must be 0, 1, 2, ... in order.")
    if len(tokens) < 256 or any(tokens[i] != bytes([i]) for i in range(256)):
        raise ValueError(
            f"--tokenizer-model {path}: ranks 0-255 must be the 256 single bytes (byte-level "
            "BPE), so that every text encodes."
        )
    return tokens


class TikTokenizer(MegatronTokenizer):
    """Megatron-LM's tiktoken tokenizer over a local rank file.

    Args:
        path: the rank file (`--tokenizer-model`).
        pattern: `--tiktoken-pattern`, a key of `PATTERNS` (None: `v2`).
        vocab_size: `--vocab-size`, the whole vocabulary (None: 2**17).
        num_special_tokens: `--tiktoken-num-special-tokens`.
        special_tokens: `--tokenizer-special-tokens` (None: `SPECIAL_TOKENS`).

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: a bad pattern, special-token list or vocabulary size (naming the flag), or a
            file that is not a rank file.
        ImportError: the `tiktoken` package is not installed.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        pattern: str | None = None,
        vocab_size: int | None = None,
        num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
        special_tokens: Sequence[str] | None = None,
    ):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"--tokenizer-model {path}: no such file; give a local .tiktoken file or "
                "Megatron-LM's tiktoken .json list."
            )
        pattern = DEFAULT_PATTERN if pattern is None else pattern
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern}: choose one of {', '.join(PATTERNS)}.")
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        special = list(SPECIAL_TOKENS if special_tokens is None else special_tokens)
        _check_special_tokens(special, num_special_tokens, vocab_size)
        try:
            import tiktoken
        except ImportError as error:
            raise ImportError(
                "TikTokenizer needs the `tiktoken` package: pip install tiktoken"
            ) from error
        tokens = load_ranks(path)
        inner_size = vocab_size - num_special_tokens
        if len(tokens) < inner_size:
            raise ValueError(
                f"--vocab-size {vocab_size}: {path} holds {len(tokens)} BPE tokens, fewer than "
                f"--vocab-size minus --tiktoken-num-special-tokens ({inner_size}); pass "
                f"--vocab-size {len(tokens) + num_special_tokens} or less."
            )
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        self._special_tokens = {token: index for index, token in enumerate(special)}
        ranks = {token: rank + num_special_tokens for rank, token in enumerate(tokens[:inner_size])}
        if len(ranks) != inner_size:
            raise ValueError(f"--tokenizer-model {path}: a token appears twice.")
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(str(path)),
            pat_str=PATTERNS[pattern],
            mergeable_ranks=ranks,
            special_tokens=self._special_tokens,
        )
        self._vocab_size = vocab_size
        self.num_special_tokens = num_special_tokens
        # The ids' texts are bytes, not all valid UTF-8, so there is no str vocabulary.
        super().__init__(
            None,
            eod=self._special_tokens["</s>"],
            bos=self._special_tokens["<s>"],
            eos=self._special_tokens["</s>"],
            pad=self._special_tokens["<pad>"],
        )

    def tokenize(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def detokenize(self, ids: Sequence[int]) -> str:
        # tiktoken joins the bytes before decoding, so characters split across tokens survive.
        return self._encoding.decode([int(index) for index in ids])

    @property
    def vocab_size(self) -> int:
        """`--vocab-size`: the special tokens and the BPE ranks kept."""
        return self._vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token text -> id (ids 0 to `num_special_tokens` - 1)."""
        return dict(self._special_tokens)

    def token_bytes(self, index: int) -> bytes:
        """The bytes of one id (a special token's text as UTF-8)."""
        return self._encoding.decode_single_token_bytes(int(index))


def _check_special_tokens(special: list[str], num_special_tokens: int, vocab_size: int) -> None:
    """Megatron-LM's conditions on the special-token list and counts, as named errors."""
    if len(set(special)) != len(special):
        raise ValueError(f"--tokenizer-special-tokens has duplicates: {special}.")
    missing = [token for token in SPECIAL_TOKENS if token not in special]
    if missing:
        raise ValueError(
            f"--tokenizer-special-tokens must contain {' '.join(SPECIAL_TOKENS)}; add "
            f"{' '.join(missing)}."
        )
    if not len(special) <= num_special_tokens < vocab_size:
        raise ValueError(
            f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the "
            f"{len(special)} special tokens and below --vocab-size {vocab_size}."
        )
