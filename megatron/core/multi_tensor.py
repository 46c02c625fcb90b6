"""Elementwise copies and additions over lists of tensors in the fewest kernel launches.

PyTorch's `_foreach_copy_` / `_foreach_add_` launch one kernel for many small tensors, but on
CUDA each launch covers at most 320 chunks of 65,536 elements (`multi_tensor_apply`), so a tensor
of more elements takes several launches: an MoE layer's stacked expert weights (hundreds of
millions of elements) take ten or more, where `copy_` takes one. The host time per launch is
what bounds small-batch steps; so tensors larger than one launch's reach go one kernel each, and
the others together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_ELEMENTS_PER_LAUNCH = 320 * 65536
"""The most elements one `multi_tensor_apply` launch covers (its blocks per launch times its
chunk size, for lists of two tensors)."""


def _split(
    targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[list, list]]:
    """The (target, source) pairs that go one kernel each, and the lists of the others."""
    alone, grouped = [], ([], [])
    for target, source in zip(targets, sources):
        if target.numel() > _ELEMENTS_PER_LAUNCH:
            alone.append((target, source))
        else:
            grouped[0].append(target)
            grouped[1].append(source)
    return alone, grouped


def copy_tensors_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """`target.copy_(source)` for each pair (casting to the target's dtype)."""
    alone, grouped = _split(targets, sources)
    for target, source in alone:
        target.copy_(source)
    if grouped[0]:
        torch._foreach_copy_(*grouped)


def add_tensors_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """`target.add_(source)` for each pair."""
    alone, grouped = _split(targets, sources)
    for target, source in alone:
        target.add_(source)
    if grouped[0]:
        torch._foreach_add_(*grouped)
