"""`--split`: the train, validation and test shares of a dataset's documents, as Megatron-core's
`BlendedMegatronDatasetConfig` turns them into document ranges.

The weights are normalised to sum to 1, accumulated into book-ends (`0, w0, w0 + w1, 1`), and
split `k` is documents `[round(c_k * n), round(c_k+1 * n))` of `n`: each boundary is rounded on
its own (the cumulative rule). A split of weight 0 has no range at all (None), not an empty one.
The float arithmetic is upstream's, operation for operation (numpy normalisation, the sums in
the same order, Python's `round`), so the boundaries agree for every corpus size.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy

SPLIT_NAMES = ("train", "valid", "test")

DEFAULT_SPLIT = "969,30,1"
"""Megatron-LM's `--split` default: train, validation and test weights."""

SplitMatrix = list[tuple[float, float] | None]
"""Per split, its book-ends (start and end shares of the documents), or None (weight 0)."""


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, as Megatron-core's `normalize` (float64 numpy arithmetic)."""
    array = numpy.array(weights, dtype=numpy.float64)
    return (array / numpy.sum(array)).tolist()


def parse_and_normalize_split(split: str) -> list[float]:
    """Megatron-LM's split string as weights summing to 1: "969,30,1" -> [0.969, 0.03, 0.001].

    Weights are separated by anything but a number's characters, as upstream reads them
    ("969,30,1", "98/2/0", "98 2 0", "98:2:0"); missing ones are 0 ("99,1" = "99,1,0"). Unlike
    upstream, which keeps only the numbers it finds, a piece that is not a number is an error.

    Raises:
        ValueError: more than three weights, one is not a finite number >= 0, or all are 0.
    """
    pieces = [piece for piece in re.split(r"[^\w.+-]+", split.strip()) if piece]
    hint = "e.g. --split 969,30,1 (train, validation and test weights)"
    if not pieces:
        raise ValueError(f"split {split!r} holds no weight; {hint}.")
    if len(pieces) > len(SPLIT_NAMES):
        raise ValueError(f"split {split!r} has {len(pieces)} weights, at most 3; {hint}.")
    weights = []
    for piece in pieces:
        try:
            weight = float(piece)
        except ValueError:
            raise ValueError(f"split {split!r}: {piece!r} is not a number; {hint}.") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"split {split!r}: {piece!r} must be a finite number >= 0; {hint}.")
        weights.append(weight)
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    if sum(weights) <= 0:
        raise ValueError(f"split {split!r} gives every split weight 0; {hint}.")
    return normalize(weights)


def split_matrix(split_vector: Sequence[float]) -> SplitMatrix:
    """The book-ends of each split (upstream's `convert_split_vector_to_split_matrix`):
    [0.969, 0.03, 0.001] -> [(0, 0.969), (0.969, 0.999), (0.999, 1.0)]; None for a split whose
    book-ends do not enclose anything (weight 0)."""
    bounds = [0]
    for weight in split_vector:
        bounds.append(bounds[-1] + weight)
    return [(low, high) if high > low else None for low, high in zip(bounds[:-1], bounds[1:])]


def document_range(bookends: tuple[float, float], num_documents: int) -> tuple[int, int]:
    """The documents `[begin, end)` of one split's book-ends: each rounded on its own."""
    return (
        int(round(bookends[0] * float(num_documents))),
        int(round(bookends[1] * float(num_documents))),
    )


def get_split_indices(split_vector: Sequence[float], num_documents: int) -> list[int]:
    """The document boundaries of the splits: split `k` is documents `[b[k], b[k + 1])` (empty
    for a split of weight 0). Megatron-core's cumulative rule: `b[k] = round(c_k * n)` for the
    accumulated weights `c_k`, so the last one is `n`."""
    bounds = [0]
    for bookends in split_matrix(split_vector):
        bounds.append(
            bounds[-1] if bookends is None else document_range(bookends, num_documents)[1]
        )
    return bounds
