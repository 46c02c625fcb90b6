"""Elementwise copies and additions over lists of tensors in the fewest kernel launches.

PyTorch's `_foreach_copy_` / `_foreach_add_` launch one kernel for many small tensors, but on
CUDA each launch covers at most 320 chunks of 65,536 elements (`multi_tensor_apply`), so a tensor
of more elements takes several launches: an MoE layer's stacked expert weights (hundreds of
millions of elements) take ten or more, where `copy_` takes one. The host time per launch is
what bounds small-batch steps; so tensors larger than one launch's reach go one kernel each, and
the others together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_ELEMENTS_PER_LAUNCH = 320 * 65536
"""The most elements one `multi_tensor_apply` launch covers (its blocks per launch times its
chunk size, for lists of two tensors)."""


def copy_tensors_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """`target.copy_(source)` for each pair (casting to the target's dtype)."""
    _apply(targets, sources, torch.Tensor.copy_, torch._foreach_copy_)


def add_tensors_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """`target.add_(source)` for each pair."""
    _apply(targets, sources, torch.Tensor.add_, torch._foreach_add_)


def _apply(
    targets: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    one: Callable[[torch.Tensor, torch.Tensor], object],
    grouped: Callable[[list[torch.Tensor], list[torch.Tensor]], object],
) -> None:
    """`one(target, source)` for the pairs past one foreach launch's reach, `grouped` over the
    lists of the others."""
    if not targets:
        return
    # Called per unit and step by the engines: the common case (no tensor past the reach) is
    # told in one pass of C calls, with no Python loop body per tensor.
    numels = list(map(torch.Tensor.numel, targets))
    if max(numels) <= _ELEMENTS_PER_LAUNCH:
        grouped(list(targets), list(sources))
        return
    rest_targets, rest_sources = [], []
    for target, source, numel in zip(targets, sources, numels):
        if numel > _ELEMENTS_PER_LAUNCH:
            one(target, source)
        else:
            rest_targets.append(target)
            rest_sources.append(source)
    if rest_targets:
        grouped(rest_targets, rest_sources)
