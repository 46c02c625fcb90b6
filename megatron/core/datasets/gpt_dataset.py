"""`GPTDataset`: GPT samples cut from a tokenized corpus (an `IndexedDataset`), as Megatron-LM's.

The documents of one split (for GPT, the indexed dataset's sequences, as Megatron-LM counts
them; `tools/preprocess_data.py` writes one sequence per document unless it splits sentences)
are concatenated, in an order shuffled per epoch, into one token stream. Sample `i` of that
stream is its tokens `[i * s, (i + 1) * s]`: `s + 1` tokens, so consecutive samples share one
boundary token, the last label of one being the first input of the next (without
`add_extra_token_to_sequence`, the `s` tokens `[i * s, (i + 1) * s)`, whose last label is the
pad id). Three arrays describe this, built as Megatron-LM builds them and cached
(`index_cache`):

- document index: the split's documents repeated for enough epochs and shuffled
  (`numpy.random.RandomState(random_seed)`); when the last epoch would be under 80% used it is
  shuffled on its own, so the partial epoch still draws from all documents evenly.
- sample index `[num_samples + 1, 2]`: where each sample starts, as (position in the document
  index, token offset in that document); row `i + 1` is where sample `i` ends. The stream's
  last partial sample is dropped, but in the validation split without
  `drop_last_partial_validation_sequence`, where it is padded with the pad id.
- shuffle index: a permutation of the samples (the final separate epoch again on its own).

Identical arrays come out of Megatron-core (0.19.2, checked against its own output in
`tests/unit_tests/datasets/test_upstream_parity.py`) for the same corpus, split, seed and sizes,
and so do the samples (the pad rule and the dense attention mask included), so a run can move
between the two projects and read the same data in the same order.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from megatron.core.datasets import index_cache
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.splits import (
    DEFAULT_SPLIT,
    SPLIT_NAMES,
    SplitMatrix,
    get_split_indices,
    parse_and_normalize_split,
    split_matrix,
)

__all__ = [
    "DEFAULT_SPLIT",
    "PAD_TOKEN_ID",
    "SPLIT_NAMES",
    "Blend",
    "GPTDataset",
    "GPTDatasetConfig",
    "get_split_indices",
    "pad_token_of",
    "parse_and_normalize_split",
]

Blend = tuple[list[str], list[float] | None]
"""Dataset prefixes and their weights (None: a single prefix, or weights from sizes)."""

PAD_TOKEN_ID = -1
"""Megatron-core's pad id when the tokenizer has none (or an ambiguous one): no token has it."""

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig:
    """What the GPT datasets are built from, and how samples are masked (Megatron-core's
    `GPTDatasetConfig`, with the tokenizer's ids given directly).

    Attributes:
        random_seed: seeds the document and sample shuffles.
        sequence_length: tokens per sample (the model's input length).
        blend: the datasets all splits draw from: prefixes and their weights (None: one
            prefix alone, or several weighted by their sizes; one weighted prefix is a blend
            of one dataset, as upstream). `build_gpt_datasets` can take Megatron-LM's
            `--data-path` list instead.
        blend_per_split: one blend (or None) per split, train, valid, test, each using its
            datasets whole (Megatron-LM's `--train-data-path` etc.); excludes `blend`/`split`.
        split: the train/valid/test weights of `blend`'s documents, e.g. "969,30,1"
            (None: `DEFAULT_SPLIT`).
        path_to_cache: the folder of cached indices (None: `cache/GPTDataset_indices` beside
            each dataset's files, and `cache/BlendedDataset_indices` beside the first one's).
        mmap_bin_files: memory-map the .bin files, else read them with file reads.
        reset_position_ids: positions restart at 0 after each EOD token.
        reset_attention_mask: tokens do not attend across an EOD token (in `attention_mask`).
        eod_mask_loss: no loss where the input token is EOD.
        create_attention_mask: samples carry the dense `attention_mask` [1, s, s] (upstream's
            default; `--no-create-attention-mask-in-dataloader` turns it off).
        eod_token: the EOD token id; needed by the three options above.
        pad_token: where the label is this id the loss is 0, and where a token or label is it
            the id becomes 0 (upstream's pad rule; `pad_token_of(tokenizer)` picks it as
            upstream does). `PAD_TOKEN_ID` (-1) matches nothing.
        vocab_size: the tokenizer's vocabulary; a dataset holding a larger id is refused when
            it is built (None: not checked).
        mid_level_dataset_surplus: the share of extra samples each dataset of a weighted blend
            is built with (upstream's 0.005, so the blend never runs a dataset dry).
        drop_last_partial_validation_sequence: the validation split drops the stream's last,
            partial sample (else it is padded with the pad id, which carries no loss).
        add_extra_token_to_sequence: samples read `sequence_length + 1` tokens, the labels
            being the inputs shifted by one; else `sequence_length`, the last label being the
            pad id (no loss).
        split_vector: the normalised `split` (set from it; None with `blend_per_split`).
        split_matrix: each split's book-ends (`splits.split_matrix`; None with
            `blend_per_split`).

    Raises:
        ValueError: a size or the seed is out of range, the split does not parse, `blend` and
            `blend_per_split` are both given, an EOD option has no `eod_token`, or
            `reset_attention_mask` without `create_attention_mask`.
    """

    random_seed: int
    sequence_length: int
    blend: Blend | None = None
    blend_per_split: list[Blend | None] | None = None
    split: str | None = None
    path_to_cache: str | None = None
    mmap_bin_files: bool = True
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    eod_token: int | None = None
    pad_token: int = PAD_TOKEN_ID
    vocab_size: int | None = None
    mid_level_dataset_surplus: float = 0.005
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    split_vector: list[float] | None = field(init=False, default=None)
    split_matrix: SplitMatrix | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.sequence_length < 1:
            raise ValueError(f"sequence_length={self.sequence_length} must be >= 1.")
        if not 0 <= self.random_seed < 2**32:
            raise ValueError(f"random_seed={self.random_seed} must be in [0, 2**32).")
        if not self.mid_level_dataset_surplus >= 0:
            raise ValueError(
                f"mid_level_dataset_surplus={self.mid_level_dataset_surplus} must be >= 0."
            )
        if self.blend_per_split is not None:
            if self.blend is not None or self.split is not None:
                raise ValueError(
                    "blend_per_split (per-split data paths) excludes blend and split "
                    "(--data-path and --split); give one or the other."
                )
            if len(self.blend_per_split) != len(SPLIT_NAMES):
                raise ValueError(
                    f"blend_per_split has {len(self.blend_per_split)} entries; it needs one "
                    f"(or None) for each of {SPLIT_NAMES}."
                )
        else:
            self.split_vector = parse_and_normalize_split(self.split or DEFAULT_SPLIT)
            self.split_matrix = split_matrix(self.split_vector)
        for flag in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, flag) and self.eod_token is None:
                raise ValueError(f"{flag} needs eod_token, the tokenizer's EOD id.")
        if self.reset_attention_mask and not self.create_attention_mask:
            raise ValueError(
                "--reset-attention-mask keeps attention within documents through the dataset's "
                "attention mask, which --no-create-attention-mask-in-dataloader switches off "
                "(upstream then silently attends across documents); drop one of the two flags."
            )


def pad_token_of(tokenizer: Any, allow_ambiguous: bool = False) -> int:
    """The pad id Megatron-core's GPT dataset masks for `tokenizer`: its `pad`, unless it has
    none (`PAD_TOKEN_ID`) or the pad id is also its EOS or EOD id (then `PAD_TOKEN_ID` too, so
    real EOD tokens keep their loss, unless `allow_ambiguous`, upstream's
    `--allow-ambiguous-pad-tokens`)."""
    try:
        pad = tokenizer.pad
    except Exception:  # upstream's rule: a tokenizer without a pad id raises anything
        return PAD_TOKEN_ID
    if pad is None:
        return PAD_TOKEN_ID
    special = []
    for name in ("eos", "eod"):
        try:
            special.append(getattr(tokenizer, name))
        except (AttributeError, NotImplementedError):
            pass
    if pad in special and not allow_ambiguous:
        return PAD_TOKEN_ID
    return int(pad)


class GPTDataset(torch.utils.data.Dataset):
    """The GPT samples of one split of an indexed dataset (see the module docstring).

    With `torch.distributed` initialised, construction is a collective (rank 0 builds the
    indices on a cache miss, the other ranks then load them): every rank constructs the same
    datasets in the same order, as `build_gpt_datasets` does.

    Args:
        indexed_dataset: the tokenized corpus.
        dataset_path: its prefix, for the cache description and default cache folder (None:
            `indexed_dataset.path_prefix`).
        indexed_indices: the documents (sequence ids) of this split.
        num_samples: samples wanted; the documents repeat for as many epochs as they need
            (None: one epoch). The dataset can hold a few more (the last epoch's rest).
        index_split: "train", "valid" or "test".
        config: the configuration.

    Attributes:
        built_anew_on_cache_miss: whether this construction built the indices (False: loaded).
        unique_description: what the indices depend on (JSON), the content of the .idx
            included; its MD5 names the cache files.

    Raises:
        ValueError: a bad split name or document id, or documents without any token (a split
            with fewer tokens than one sample is fine: its epochs repeat, as upstream).
        OSError: the cache folder cannot be written.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str | None,
        indexed_indices: numpy.ndarray,
        num_samples: int | None,
        index_split: str,
        config: GPTDatasetConfig,
    ):
        if index_split not in SPLIT_NAMES:
            raise ValueError(f"index_split={index_split!r} must be one of {SPLIT_NAMES}.")
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples={num_samples} must be >= 0 (or None: one epoch).")
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path or indexed_dataset.path_prefix
        self.indices = numpy.asarray(indexed_indices, dtype=numpy.int32)
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        if self.indices.ndim != 1 or (
            self.indices.size
            and not 0 <= self.indices.min() <= self.indices.max() < len(indexed_dataset)
        ):
            raise ValueError(
                f"indexed_indices must be ids in [0, {len(indexed_dataset)}) of "
                f"{self.dataset_path}'s documents."
            )
        lengths = indexed_dataset.sequence_lengths
        self.tokens_per_epoch = int(lengths[self.indices].sum(dtype=numpy.int64))
        if self.tokens_per_epoch == 0:
            # Upstream loops forever here (no number of epochs reaches a sample).
            raise ValueError(
                f"The {index_split} split of {self.dataset_path} has {self.indices.size} "
                "documents and no token; give that split documents (--split) or more data."
            )

        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("dataset_path", self.dataset_path),
                ("num_samples", num_samples),
                ("index_split", index_split),
                ("random_seed", config.random_seed),
                ("sequence_length", config.sequence_length),
                # The documents and the content of the .idx rather than the split string: they
                # are what the indices depend on, and a re-tokenized (or reordered) corpus
                # changes them even when its document and token counts stay the same.
                ("num_documents", int(self.indices.size)),
                ("documents_md5", hashlib.md5(self.indices.tobytes()).hexdigest()),
                ("idx_sha256", indexed_dataset.index_digest),
                ("tokens_per_epoch", self.tokens_per_epoch),
                ("add_extra_token_to_sequence", config.add_extra_token_to_sequence),
                ("drops_last_partial_sample", self._drops_last_partial_sample),
            ]
        )
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        cache_dir = config.path_to_cache or index_cache.default_cache_dir(
            self.dataset_path, type(self).__name__
        )
        base_name = (
            f"{index_cache.description_hash(self.unique_description)}-"
            f"{type(self).__name__}-{index_split}"
        )
        arrays, self.built_anew_on_cache_miss = index_cache.load_or_build(
            cache_dir,
            base_name,
            self.unique_description,
            ("document_index", "sample_index", "shuffle_index"),
            self._build_indices,
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self._cached_masks: tuple | None = None

    @property
    def _drops_last_partial_sample(self) -> bool:
        return self.index_split != "valid" or self.config.drop_last_partial_validation_sequence

    def _build_indices(self) -> dict[str, numpy.ndarray]:
        """The document, sample and shuffle indices, exactly as Megatron-LM builds them."""
        sequence_length = self.config.sequence_length
        tokens_per_epoch = self.tokens_per_epoch
        # The token after the last sample's inputs, which its labels need.
        extra = int(self.config.add_extra_token_to_sequence)
        num_epochs = 1
        if self.num_samples is not None:
            tokens_wanted = self.num_samples * sequence_length + extra
            num_epochs = max(1, -(-tokens_wanted // tokens_per_epoch))
        separate_final_epoch = False
        if num_epochs > 1:
            samples_before_final = ((num_epochs - 1) * tokens_per_epoch - extra) // sequence_length
            samples_from_final = self.num_samples - samples_before_final
            samples_per_epoch = (tokens_per_epoch - extra) // sequence_length
            separate_final_epoch = samples_from_final < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch
            )
        random_state = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(
            self.indices, num_epochs, random_state, separate_final_epoch
        )
        sample_index = build_sample_index(
            self.dataset.sequence_lengths,
            document_index,
            sequence_length,
            num_epochs,
            tokens_per_epoch,
            drop_last_partial_sample=self._drops_last_partial_sample,
            add_extra_token=self.config.add_extra_token_to_sequence,
        )
        num_samples_total = sample_index.shape[0] - 1
        first_shuffled = samples_before_final if separate_final_epoch else num_samples_total
        shuffle_index = _build_shuffle_index(first_shuffled, num_samples_total, random_state)
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """Sample `idx` as Megatron-core's: `tokens` and `labels` (shifted by one, the last
        one the pad id without `add_extra_token_to_sequence`), int64 [s];
        `attention_mask` bool [1, s, s] (True = masked out; with `create_attention_mask`);
        `loss_mask` float32 [s]; `position_ids` int64 [s]. Where a label is the pad id the
        loss is 0, and pad ids become 0. `idx` None: a padding sample (sample 0, no loss)."""
        if idx is not None and not 0 <= idx < len(self):
            raise IndexError(f"GPTDataset index {idx} out of range [0, {len(self)}).")
        config = self.config
        text = torch.from_numpy(self._sample_tokens(0 if idx is None else int(idx)))
        if config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens, labels = text, torch.roll(text, shifts=-1)
            labels[-1] = config.pad_token
        cacheable = not (
            config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss
        )
        if cacheable and self._cached_masks is not None:
            attention_mask, loss_mask, position_ids = self._cached_masks
            loss_mask = loss_mask.clone()
        else:
            attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
                tokens,
                config.eod_token,
                config.reset_position_ids,
                config.reset_attention_mask,
                config.eod_mask_loss,
                config.create_attention_mask,
            )
            if cacheable:
                # Upstream's cache: without the EOD options, every sample has the same ones.
                self._cached_masks = (attention_mask, loss_mask.clone(), position_ids)
        pad = config.pad_token
        loss_mask[labels == pad] = 0.0
        tokens[tokens == pad] = 0
        labels[labels == pad] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)
        sample = {"tokens": tokens, "labels": labels}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _sample_tokens(self, idx: int) -> numpy.ndarray:
        """The `sequence_length + 1` tokens of sample `idx` (`sequence_length` without
        `add_extra_token_to_sequence`; a partial last sample padded with the pad id), int64."""
        extra = int(self.config.add_extra_token_to_sequence)
        position = int(self.shuffle_index[idx])
        first, first_offset = (int(v) for v in self.sample_index[position])
        last, last_offset = (int(v) for v in self.sample_index[position + 1])
        documents = self.document_index
        if first == last:
            length = last_offset - first_offset + extra
            parts = [self.dataset.get(int(documents[first]), first_offset, length)]
        else:
            parts = [self.dataset.get(int(documents[first]), first_offset)]
            parts += [self.dataset.get(int(documents[d])) for d in range(first + 1, last)]
            parts.append(self.dataset.get(int(documents[last]), 0, last_offset + extra))
        missing = self.config.sequence_length + extra - sum(len(part) for part in parts)
        if missing:
            parts.append(numpy.full(missing, self.config.pad_token))
        return numpy.concatenate(parts, dtype=numpy.int64)


def build_sample_index(
    sequence_lengths: numpy.ndarray,
    document_index: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sample: bool = True,
    add_extra_token: bool = True,
) -> numpy.ndarray:
    """Megatron-LM's `build_sample_idx` (its C++ helper).

    Row `i` is the position of stream token `i * sequence_length`, as (index into
    `document_index`, offset in that document); row 0 is (0, 0). With `add_extra_token` the
    document is the one that holds the token (each sample reads up to it, inclusive), else the
    one the sample before it ends in (up to it, exclusive: the offset may be that document's
    length). A partial last sample ends where the stream does, as (the last position,
    its document's length less the extra token). Vectorised: one binary search per sample.

    Args:
        sequence_lengths: the corpus's tokens per document (sequence).
        document_index: the documents of the stream, in order.
        sequence_length: tokens per sample, beside the shared boundary token.
        num_epochs, tokens_per_epoch: the stream holds `num_epochs * tokens_per_epoch` tokens.
        drop_last_partial_sample: no sample of fewer tokens at the stream's end.
        add_extra_token: samples read `sequence_length + 1` tokens, the labels' last one too.

    Returns:
        [num_samples + 1, 2], num_samples = (stream tokens - extra) / sequence_length rounded
        down (up with a partial last sample), extra being 1 with `add_extra_token`; int32 when
        every value fits (as Megatron-LM), else int64.
    """
    extra = int(add_extra_token)
    stream = num_epochs * tokens_per_epoch
    num_samples = (stream - extra) // sequence_length
    if not drop_last_partial_sample:
        num_samples = -(-(stream - extra) // sequence_length)
    lengths = sequence_lengths[document_index].astype(numpy.int64)
    ends = numpy.cumsum(lengths)
    assert ends[-1] == stream, "document index and token count disagree"
    starts = numpy.arange(num_samples + 1, dtype=numpy.int64) * sequence_length
    # The first document whose end lies beyond the token (with the extra token; without it,
    # reaches the position): empty documents are skipped.
    documents = numpy.searchsorted(ends, starts, side="right" if add_extra_token else "left")
    partial = starts[-1] > stream - extra
    if partial:  # the helper stops at the stream's end
        documents[-1] = len(document_index) - 1
    offsets = starts - (ends[documents] - lengths[documents])
    if partial:
        offsets[-1] = lengths[-1] - extra
    documents[0], offsets[0] = 0, 0
    largest = max(len(document_index), int(sequence_lengths.max()))
    dtype = numpy.int32 if largest <= numpy.iinfo(numpy.int32).max else numpy.int64
    return numpy.stack([documents, offsets], axis=1).astype(dtype)


def _build_document_index(
    documents: numpy.ndarray,
    num_epochs: int,
    random_state: numpy.random.RandomState,
    separate_final_epoch: bool,
) -> numpy.ndarray:
    """The documents repeated `num_epochs` times and shuffled, int32 (the final epoch on its
    own when `separate_final_epoch`), consuming `random_state` as Megatron-LM does."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(documents, num_epochs).astype(numpy.int32)
        random_state.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, random_state, False)
    last = _build_document_index(documents, 1, random_state, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(
    num_samples: int, total_size: int, random_state: numpy.random.RandomState
) -> numpy.ndarray:
    """A permutation of [0, total_size) that shuffles [0, num_samples) and the rest apart."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(num_samples, dtype=dtype)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    random_state.shuffle(last)
    return numpy.concatenate((first, last))


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod_token: int | None,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Masks and positions of a left-to-right sample, as Megatron-core's
    `_get_ltor_masks_and_position_ids` computes them (vectorised instead of its loop over EODs).

    Args:
        tokens: int64 [s], the sample's input tokens.
        eod_token: the EOD id (needed by the three options).
        reset_position_ids: positions restart at 0 after each EOD.
        reset_attention_mask: a token attends only to earlier tokens of its own document (the
            EOD closes a document).
        eod_mask_loss: zero loss where the input token is EOD.
        create_attention_mask: build the dense mask (without it `reset_attention_mask` has no
            effect here, as upstream).

    Returns:
        `attention_mask` bool [1, s, s] (query, key; True = masked out, the causal part
        included, GPTModel's convention) or None without `create_attention_mask`;
        `loss_mask` float32 [s]; `position_ids` int64 [s].
    """
    seq_length = tokens.numel()
    positions = torch.arange(seq_length, dtype=torch.int64)
    loss_mask = torch.ones(seq_length, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids, document_start = positions, None
    if reset_position_ids or (reset_attention_mask and create_attention_mask):
        # Where each token's document starts: one past the last EOD strictly before it.
        after_eod = torch.where(tokens == eod_token, positions + 1, 0)
        document_start = torch.cummax(
            torch.cat([torch.zeros(1, dtype=torch.int64), after_eod[:-1]]), dim=0
        ).values
        if reset_position_ids:
            position_ids = positions - document_start
    attention_mask = None
    if create_attention_mask:
        visible = positions[None, :] <= positions[:, None]
        if reset_attention_mask:
            visible &= document_start[None, :] == document_start[:, None]
        attention_mask = (~visible).unsqueeze(0)
    return attention_mask, loss_mask, position_ids
