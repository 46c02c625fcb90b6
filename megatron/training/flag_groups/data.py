"""Data and tokenizer flags."""

from __future__ import annotations

import argparse

from megatron.core.datasets.splits import DEFAULT_SPLIT
from megatron.core.datasets.tokenizers import TOKENIZER_TYPES
from megatron.core.datasets.tokenizers.tiktoken_tokenizer import (
    DEFAULT_NUM_SPECIAL_TOKENS,
    PATTERNS,
)

PER_SPLIT_FLAGS = ("train", "valid", "test")
"""The splits of `--train-data-path`, `--valid-data-path` and `--test-data-path`."""


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """The "data and dataloader" group."""
    group = parser.add_argument_group(title="data and dataloader")
    group.add_argument("--mock-data", action="store_true", help="Synthetic tokens.")
    group.add_argument(
        "--data-path",
        nargs="*",
        help="Prefixes of .bin/.idx datasets (tools/preprocess_data.py): PREFIX, or "
        "WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ... to blend.",
    )
    group.add_argument(
        "--split",
        help=f"Train, validation and test weights of --data-path; None: {DEFAULT_SPLIT}.",
    )
    for split in PER_SPLIT_FLAGS:
        group.add_argument(
            f"--{split}-data-path",
            nargs="*",
            help=f"The {split} split's own datasets, whole (as --data-path, not split); "
            "instead of --data-path.",
        )
    group.add_argument(
        "--mid-level-dataset-surplus",
        type=float,
        default=0.005,
        help="Share of extra samples each dataset of a weighted blend is built with.",
    )
    group.add_argument(
        "--allow-ambiguous-pad-tokens",
        action="store_true",
        help="Mask the tokenizer's pad id even where it is also its EOS or EOD id.",
    )
    group.add_argument(
        "--dataloader-type",
        choices=("single", "cyclic", "external"),
        help="single (None: the same): each sample once per epoch, in the datasets' order; "
        "cyclic and external are not built.",
    )
    group.add_argument(
        "--num-dataset-builder-threads",
        type=int,
        default=1,
        help="Accepted; the datasets are built one after another.",
    )
    group.add_argument(
        "--data-cache-path", help="Folder of cached sample indices; None: beside the data."
    )
    group.add_argument(
        "--no-mmap-bin-files",
        action="store_false",
        dest="mmap_bin_files",
        help="Read the .bin files instead of memory-mapping them.",
    )
    group.add_argument("--seq-length", type=int, help="Tokens per sequence.")
    group.add_argument("--num-workers", type=int, default=2, help="Dataloader workers.")
    group.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")
    group.add_argument(
        "--reset-position-ids", action="store_true", help="Positions restart after each EOD."
    )
    group.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="No attention across EOD tokens (samples carry a mask).",
    )
    group.add_argument(
        "--no-create-attention-mask-in-dataloader",
        action="store_false",
        dest="create_attention_mask_in_dataloader",
        help="Samples carry no dense [1, s, s] attention mask (upstream's samples do by default; "
        "the model applies the causal mask itself and reads the dataset's mask only with "
        "--reset-attention-mask, which therefore needs it).",
    )


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The tokenizer flags, which `tools/preprocess_data.py` shares; returns their group."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--vocab-size",
        type=int,
        help="Token ids of --mock-data without a tokenizer; NullTokenizer's whole vocabulary.",
    )
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="The tokenizer.")
    group.add_argument(
        "--null-tokenizer-eod-id",
        type=int,
        help="NullTokenizer's end-of-document id (default: --vocab-size - 1).",
    )
    group.add_argument(
        "--null-tokenizer-pad-id",
        type=int,
        default=-1,
        help="NullTokenizer's pad id (-1: none); its tokens get no loss.",
    )
    group.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json.")
    group.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt.")
    group.add_argument(
        "--tokenizer-model",
        help="SentencePiece .model file, .tiktoken / .json rank file (TikTokenizer), or local "
        "HuggingFace tokenizer directory.",
    )
    group.add_argument(
        "--vocab-extra-ids",
        type=int,
        default=0,
        help="T5's span-masking tokens; only 0 (GPT training adds none).",
    )
    group.add_argument(
        "--tiktoken-pattern", choices=tuple(PATTERNS), help="TikTokenizer's regex; None: v2."
    )
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=DEFAULT_NUM_SPECIAL_TOKENS,
        help="TikTokenizer: ids reserved for special tokens before the BPE ranks.",
    )
    group.add_argument(
        "--tokenizer-special-tokens",
        "--tiktoken-special-tokens",
        dest="special_tokens",
        nargs="+",
        help="TikTokenizer's special tokens (must include <unk> <s> </s> <mask> <pad> <cls> "
        "<sep>).",
    )
    return group


def validate_data(args: argparse.Namespace) -> None:
    """Refuses `--reset-attention-mask` with `--no-create-attention-mask-in-dataloader`: the
    documents are kept apart by the dataset's mask, which the second flag switches off
    (upstream then silently attends across documents). And the data loaders not built.

    Raises:
        ValueError: both flags are given; `--dataloader-type` cyclic or external.
    """
    if args.dataloader_type not in (None, "single"):
        raise ValueError(
            f"--dataloader-type {args.dataloader_type} is not built in this project: samples "
            "are read once per epoch in the datasets' order (single, the default); drop the "
            "flag."
        )
    if args.reset_attention_mask and not args.create_attention_mask_in_dataloader:
        raise ValueError(
            "--reset-attention-mask keeps attention within documents through the dataset's "
            "attention mask, which --no-create-attention-mask-in-dataloader switches off; drop "
            "one of the two flags."
        )


def validate_tokenizer(args: argparse.Namespace) -> None:
    """Refuses `--vocab-extra-ids` other than 0 (`--tokenizer-prompt-format` is refused in
    `flag_groups.unbuilt`).

    Raises:
        ValueError: `--vocab-extra-ids` is not 0.
    """
    if args.vocab_extra_ids != 0:
        raise ValueError(
            f"--vocab-extra-ids {args.vocab_extra_ids}: T5 span-masking tokens are not built "
            "(GPT pretraining uses none); drop the flag."
        )
