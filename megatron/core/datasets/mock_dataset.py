"""`MockGPTDataset`: synthetic, deterministic, learnable GPT samples for tests and quick starts.

Each sample is a counting sequence: it starts at a random token and climbs by a random stride
of 1 to 3 (modulo the vocabulary). The next token follows from the previous two, so a tiny model
learns it within tens of iterations and its loss visibly falls, unlike uniform random tokens.
There are few distinct sequences (vocabulary size x 3 strides), so datasets of other seeds (the
validation and test splits of `pretrain_gpt.py`) repeat the training sequences: they are not
held out, and their loss measures fitting, not generalisation.
Sample `i` depends only on (`seed`, `i`), so every rank, worker and resumed run sees the same
data at the same index.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

MAX_STRIDE = 3

SEED_LIMIT = 2**31
"""`MockGPTDataset` takes seeds in [0, SEED_LIMIT)."""


class MockGPTDataset(Dataset):
    """`num_samples` counting sequences in Megatron's GPT batch format.

    Args:
        num_samples: the dataset length.
        seq_length: tokens per sample (the model's input length).
        vocab_size: token ids are in [0, vocab_size).
        seed: selects the sequences; with the index, all a sample depends on.

    Raises:
        ValueError: a size is not positive, or `seed` is negative or too large.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234):
        for name, value in (
            ("num_samples", num_samples),
            ("seq_length", seq_length),
            ("vocab_size", vocab_size),
        ):
            if value < 1:
                raise ValueError(f"MockGPTDataset: {name}={value} must be >= 1.")
        if not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"MockGPTDataset: seed={seed} must be in [0, 2**31).")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        """Sample `idx`: `tokens` and `labels` (the tokens shifted left by one), int64 [s];
        `loss_mask` float32 [s] of ones; `position_ids` int64 [s] = 0..s-1. There is no
        `attention_mask`: GPTModel applies its causal mask when given none."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"MockGPTDataset index {idx} out of range [0, {self.num_samples}).")
        # A hash rather than a torch.Generator per sample: CPU generators keep only 32 bits of
        # their seed, so (seed, idx) pairs could not all get distinct streams.
        mixed = _splitmix64((self.seed << 32) | idx)
        start = mixed % self.vocab_size
        stride = 1 + (mixed >> 32) % MAX_STRIDE
        text = (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length),
        }


def _splitmix64(value: int) -> int:
    """SplitMix64's finaliser: a fixed bijection of 64-bit integers that scatters nearby inputs
    (consecutive indices) over all outputs."""
    mask = (1 << 64) - 1
    value = (value + 0x9E3779B97F4A7C15) & mask
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
    return value ^ (value >> 31)
