"""`GradViews`: the `.grad` an optimizer reads for one group's main weights.

Each trainable main weight, the DTensor and its local shard alike, gets a view of the group's
optimizer buffer as its `.grad`, so an optimizer over either finds its gradient without being
told. An optimizer or the user may then detach a `.grad` from its view: set it to None
(`zero_grad()`) or assign a tensor of their own (`p.grad = p.grad * 0.5`). Torch would add the
next backward's gradient to what `.grad` holds then; `reattach` gives the same result by
starting the view again from it (zeros for None, the assigned values otherwise) before the next
reduction adds to it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from megatron.core.distributed.fsdp.dbuffer import DBuffer
from megatron.core.distributed.fsdp.weights import GroupWeights


class GradViews:
    """The `.grad` views over one group's optimizer buffer (made once: views of persistent
    storage) and their attachment to the main weights.

    Args:
        weights: the group's weights.
        buffer: the buffer the optimizer reads (its local views are the gradients' values).
    """

    def __init__(self, weights: GroupWeights, buffer: DBuffer):
        self._weights = weights
        self._locals = buffer.local_views()
        self._dtensors: list[DTensor] = [
            weights.dtensor(local, index) for index, local in enumerate(self._locals)
        ]

    def _pairs(
        self,
    ) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor, DTensor, torch.Tensor]]:
        """Each main weight, its local shard, and their `.grad` views."""
        weights = self._weights
        return zip(weights.main_weights, weights.local_main_weights, self._dtensors, self._locals)

    def attach(self) -> None:
        """Points the `.grad` of each trainable main weight at its view; a weight frozen after
        wrapping gets none."""
        for param, local, grad, local_grad in self._pairs():
            trainable = param.requires_grad
            param.grad = grad if trainable else None
            local.grad = local_grad if trainable else None

    def detach(self) -> None:
        """Sets every main weight's `.grad` to None."""
        weights = self._weights
        for param in (*weights.main_weights, *weights.local_main_weights):
            param.grad = None

    def num_trainable(self) -> int:
        return sum(param.requires_grad for param in self._weights.main_weights)

    def num_dropped(self) -> int:
        """How many trainable main weights have a `.grad` (the DTensor's or the local shard's)
        set to None."""
        return sum(
            param.requires_grad and (param.grad is None or local.grad is None)
            for param, local, _, _ in self._pairs()
        )

    def first_attached(self) -> bool:
        """Whether the first main weight's `.grad` are in place: the common case, nothing
        dropped, shows there at once."""
        param, local = self._weights.main_weights[0], self._weights.local_main_weights[0]
        return param.requires_grad and param.grad is not None and local.grad is not None

    def reattach(self) -> bool:
        """Starts each detached view again from its `.grad` (zeros where None, the assigned
        values otherwise) and attaches them all.

        Returns:
            False, touching nothing, when every trainable `.grad` was dropped (the caller then
            starts afresh without memory); True otherwise.
        """
        detached = [
            index
            for index, (param, local, grad, local_grad) in enumerate(self._pairs())
            if param.requires_grad and (param.grad is not grad or local.grad is not local_grad)
        ]
        if not detached:
            return True
        if self.num_dropped() == self.num_trainable():
            return False
        weights = self._weights
        with torch.no_grad():
            for index in detached:
                values = self._values_of(
                    weights.main_weights[index].grad, weights.local_main_weights[index].grad, index
                )
                if values is None:
                    self._locals[index].zero_()
                else:
                    self._locals[index].copy_(values)
        self.attach()
        return True

    def _values_of(
        self, grad: torch.Tensor | None, local_grad: torch.Tensor | None, index: int
    ) -> torch.Tensor | None:
        """This rank's part of what the user left in the `.grad` of main weight `index`: the
        DTensor's where it was replaced, else the local shard's; None where either was
        dropped."""
        if grad is None or local_grad is None:
            return None
        if grad is not self._dtensors[index]:
            param = self._weights.main_weights[index]
            if not isinstance(grad, DTensor) or grad.placements != param.placements:
                raise ValueError(
                    f"Megatron-FSDP: the .grad assigned to {self._weights.fqns[index]} is not a "
                    f"DTensor placed like its parameter ({param.placements}); assign one made "
                    "from the parameter's .grad (p.grad = p.grad * 0.5) or scale it in place."
                )
            return grad.to_local()
        return local_grad
