"""`HuggingFaceTokenizer`: any tokenizer `transformers.AutoTokenizer` loads, from local files.

Megatron-LM's `HuggingFaceTokenizer`: `--tokenizer-model` is a directory written by
`save_pretrained()` (or the name of a tokenizer already in the local HuggingFace cache).
Nothing is downloaded (`local_files_only=True`): training machines often have no network, and
a download in every data-loader worker would be slow where they do. Remote code is never run.
As in Megatron-LM, `tokenize()` adds the tokenizer's own special tokens (a Llama tokenizer's
BOS, say) and the end-of-document id is the tokenizer's EOS; a tokenizer without EOS or BOS
tokens (BERT-style) uses its SEP and CLS tokens for them. `transformers` is imported only when
a tokenizer is built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from megatron.core.datasets.tokenizers.base import MegatronTokenizer


class HuggingFaceTokenizer(MegatronTokenizer):
    """A `transformers` tokenizer loaded from local files.

    Args:
        name_or_path: a directory holding the tokenizer's files (`tokenizer.json`,
            `tokenizer_config.json`, ...), or the name of a tokenizer in the local HuggingFace
            cache (`--tokenizer-model`).

    Raises:
        FileNotFoundError: no local tokenizer is there.
        ValueError: the directory exists but its files do not load as a tokenizer.
        ImportError: the `transformers` package is not installed.
    """

    def __init__(self, name_or_path: str | os.PathLike):
        try:
            import transformers
        except ImportError as error:
            raise ImportError(
                "HuggingFaceTokenizer needs the `transformers` package: pip install transformers"
            ) from error
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(name_or_path), local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError) as error:
            if not os.path.isdir(name_or_path):
                raise FileNotFoundError(
                    f"--tokenizer-model {name_or_path}: no local tokenizer there. It must be a "
                    "local directory holding tokenizer files (as written by a tokenizer's "
                    "save_pretrained(directory)), or a name already in the local HuggingFace "
                    "cache; nothing is downloaded."
                ) from error
            raise ValueError(
                f"--tokenizer-model {name_or_path}: the directory does not load as a "
                "HuggingFace tokenizer; it must hold tokenizer files as written by a "
                f"tokenizer's save_pretrained(directory) ({error})"
            ) from error
        tokenizer = self._tokenizer
        # Megatron-LM's fallbacks: SEP ends a sequence, CLS begins one, where EOS / BOS lack.
        eos = tokenizer.sep_token_id if tokenizer.eos_token is None else tokenizer.eos_token_id
        bos = tokenizer.cls_token_id if tokenizer.bos_token is None else tokenizer.bos_token_id
        super().__init__(
            tokenizer.get_vocab(), eod=eos, bos=bos, eos=eos, pad=tokenizer.pad_token_id
        )

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer(text).input_ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(index) for index in ids])

    @property
    def vocab_size(self) -> int:
        """All ids, added tokens included (`len(tokenizer)`, not the base vocabulary's size)."""
        return len(self._tokenizer)

    def _missing(self, name: str) -> NotImplementedError:
        """Megatron's error, saying for `eod` that the tokenizer has no EOS token."""
        if name != "eod":
            return super()._missing(name)
        return NotImplementedError(
            "HuggingFaceTokenizer has no attribute 'eod': the tokenizer has no eos_token (nor a "
            "sep_token), which is its end-of-document id; save it with an eos_token set."
        )
