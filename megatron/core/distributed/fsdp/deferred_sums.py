"""`DeferredSums`: a step's sharded gradients summed whole until its last microbatch.

With `OverlapPolicy.accumulate_unsharded_grads`, the backward passes of a step's microbatches
but the last do not reduce-scatter their gradients: they add them to one whole sum per
parameter, in `main_grads_dtype`, and the last microbatch's reduction adds its own and
reduce-scatters the sums once (`GroupGrads.reduce`). The sums are freed by that reduction or by
`zero_grad`.

With gradient-accumulation fusion (`GroupGrads.fuse_into_deferred_sums`) linear layers add their
weight gradients into the sums themselves once they exist (from the second microbatch on),
leaving `.grad` None; a backward that fails leaves those in the sums, as torch leaves the
`.grad` it accumulated.
"""

from __future__ import annotations

import torch

from megatron.core.multi_tensor import add_tensors_
from megatron.core.tensor_parallel.grad_accumulation import FusionTarget


class DeferredSums:
    """The whole gradient sums of one group, one per compute weight, or none.

    Args:
        params: the group's compute weights (whose shapes the sums have).
        dtype: the sums' dtype (`main_grads_dtype`).
        param_index: each compute weight's index in `params`, by `id`.

    Attributes:
        sums: one whole sum per parameter; None when the step has none.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], dtype: torch.dtype, param_index: dict[int, int]
    ):
        self._params = params
        self.dtype = dtype
        self._param_index = param_index
        self.sums: list[torch.Tensor] | None = None

    def exist(self) -> bool:
        """Whether the step has sums (asked by linear layers at forward: whether to fuse)."""
        return self.sums is not None

    def add(self, grads: list[torch.Tensor | None]) -> None:
        """Adds `grads` (None: none, or fused into the sum already) to the sums, or makes them
        the sums (the step's first, zeros for None) in the sums' dtype: autograd's own tensors
        where they already have it (no copy)."""
        if self.sums is None:
            self.sums = [
                torch.zeros_like(param, dtype=self.dtype) if grad is None else grad.to(self.dtype)
                for grad, param in zip(grads, self._params)
            ]
            return
        added = [(s, g) for s, g in zip(self.sums, grads) if g is not None]
        if added:
            add_tensors_([s for s, _ in added], [g for _, g in added])

    def take(self) -> list[torch.Tensor] | None:
        """The sums, handed over to be reduced (the group holds them no more)."""
        sums, self.sums = self.sums, None
        return sums

    def target_of(self, param: torch.nn.Parameter) -> FusionTarget | None:
        """`param`'s sum for a fused accumulation; None before the step has sums (its first
        microbatch)."""
        if self.sums is None:
            return None
        return FusionTarget(self.sums[self._param_index[id(param)]])

    def scale(self, factor: float | torch.Tensor) -> None:
        """Multiplies the sums by `factor`."""
        if self.sums is not None:
            torch._foreach_mul_(self.sums, factor)

    def drop(self) -> None:
        """Forgets the sums."""
        self.sums = None
