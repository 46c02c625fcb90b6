"""`GPT2BPETokenizer`: GPT-2's byte-level BPE from a `vocab.json` and a `merges.txt`.

The algorithm of OpenAI's GPT-2 `encoder.py` (which Megatron-LM's `GPT2BPETokenizer` wraps):
text is split into words by GPT-2's pre-tokenisation regex, each word's UTF-8 bytes are mapped
to printable characters (`bytes_to_unicode()`), and the adjacent pair of lowest merge rank is
merged until no ranked pair is left. The result matches HuggingFace's GPT-2 tokenizers for the
same files, which Megatron-LM (0.19) builds for this type: `<|endoftext|>` inside text is the
end-of-document id (the text around it is encoded apart), as it is `bos` and `eos` too. (Before
0.19 Megatron-LM encoded it as ordinary text.)
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

from megatron.core.datasets.tokenizers.base import MegatronTokenizer

EOD_TOKEN = "<|endoftext|>"

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""GPT-2's pre-tokenisation: contractions, letters, digits and other symbols (each with at most
one leading space), then runs of whitespace, leaving the last space of a run to the next word."""

CACHE_SIZE = 100_000
"""Words whose merges are remembered: text repeats words, and merging is the slow part."""


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character: printable Latin-1 bytes map to
    themselves, the rest to characters from U+0100 on, so no token holds whitespace or control
    characters (`merges.txt` separates tokens with a space)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2's byte-level BPE.

    Args:
        vocab_file: `vocab.json`, token text to id (`--vocab-file`).
        merge_file: `merges.txt`, one merge `first second` a line, highest priority first,
            after an optional `#version` line (`--merge-file`).

    Raises:
        FileNotFoundError: a file does not exist.
        ValueError: a file cannot be read or parsed, or the vocabulary has no `<|endoftext|>`.
        ImportError: the `regex` package is not installed.
    """

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike):
        try:
            import regex
        except ImportError as error:
            raise ImportError(
                "GPT2BPETokenizer needs the `regex` package: pip install regex"
            ) from error
        self._pattern = regex.compile(GPT2_PATTERN)
        vocab = _load_vocab(vocab_file)
        self._ranks = _load_merges(merge_file)
        if EOD_TOKEN not in vocab:
            raise ValueError(
                f"--vocab-file {vocab_file} has no {EOD_TOKEN!r} token, which GPT2BPETokenizer "
                "uses as its end-of-document id; add it to the vocabulary."
            )
        eod = vocab[EOD_TOKEN]
        super().__init__(vocab, eod=eod, bos=eod, eos=eod)
        self._byte_encoder = bytes_to_unicode()
        self._byte_decoder = {char: byte for byte, char in self._byte_encoder.items()}
        self._cache: dict[str, tuple[str, ...]] = {}

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for number, piece in enumerate(text.split(EOD_TOKEN)):
            if number:
                ids.append(self.eod)
            ids += self._encode(piece)
        return ids

    def _encode(self, text: str) -> list[int]:
        """The ids of text without the end-of-document token."""
        ids = []
        for word in self._pattern.findall(text):
            mapped = "".join(self._byte_encoder[byte] for byte in word.encode("utf-8"))
            for token in self._bpe(mapped):
                try:
                    ids.append(self._vocab[token])
                except KeyError:
                    raise ValueError(
                        f"GPT2BPETokenizer: the merges make {token!r}, which --vocab-file does "
                        "not hold; the vocabulary and merge files do not belong together."
                    ) from None
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        decoder = self.inv_vocab
        try:
            text = "".join(decoder[int(index)] for index in ids)
        except KeyError as error:
            raise ValueError(
                f"GPT2BPETokenizer: id {error.args[0]} is not in the vocabulary."
            ) from None
        data = bytearray(self._byte_decoder[char] for char in text)
        return data.decode("utf-8", errors="replace")

    def _bpe(self, word: str) -> tuple[str, ...]:
        """The tokens of one pre-tokenised word (in byte-mapped characters)."""
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        parts = tuple(word)
        while len(parts) > 1:
            pairs = set(zip(parts, parts[1:]))
            best = min(pairs, key=lambda pair: self._ranks.get(pair, float("inf")))
            if best not in self._ranks:
                break
            merged = []
            i = 0
            # Left to right, so of overlapping occurrences ("a a a") the leftmost merges first.
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = tuple(merged)
        if len(self._cache) >= CACHE_SIZE:
            self._cache.clear()
        self._cache[word] = parts
        return parts


def _load_vocab(path: str | os.PathLike) -> dict[str, int]:
    """`vocab.json` as a dict, checked: token strings to distinct integer ids."""
    text = _read_text(path, "--vocab-file")
    try:
        vocab = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--vocab-file {path} is not JSON ({error}); give GPT-2's vocab.json."
        ) from None
    if not isinstance(vocab, dict) or not all(
        isinstance(index, int) and not isinstance(index, bool) for index in vocab.values()
    ):
        raise ValueError(f"--vocab-file {path} must be a JSON object of token: integer id.")
    if len(set(vocab.values())) != len(vocab):
        raise ValueError(f"--vocab-file {path} gives two tokens the same id.")
    return vocab


def _load_merges(path: str | os.PathLike) -> dict[tuple[str, str], int]:
    """`merges.txt` as {(first, second): rank}, rank 0 the first merge."""
    lines = _read_text(path, "--merge-file").splitlines()
    first = 1 if lines and lines[0].startswith("#version") else 0
    ranks: dict[tuple[str, str], int] = {}
    for number, line in enumerate(lines[first:], start=first + 1):
        if not line.strip():
            continue
        pair = line.split()
        if len(pair) != 2:
            raise ValueError(
                f"--merge-file {path} line {number}: {line!r} is not a merge `first second`."
            )
        # A repeated merge takes its later rank, as in GPT-2's and HuggingFace's loaders.
        ranks[(pair[0], pair[1])] = number
    return ranks


def _read_text(path: str | os.PathLike, flag: str) -> str:
    """The UTF-8 text of a tokenizer file, or an error that names its flag."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file; give the path of an existing file.")
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{flag} {path} cannot be read as UTF-8 text: {error}") from error
