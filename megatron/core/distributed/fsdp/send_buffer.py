"""`SendBuffer`: what a group's reduce-scatter of each backward reads.

Where gradients are sharded (ZeRO-2/3), each backward's gradients are reduce-scattered into the
group's shard of `main_grad`. The reduce-scatter reads each gradient whole, flat and padded to
N full chunks, in the reduction dtype (`ResolvedPrecision.grad_comm`): autograd's own gradients
where they already are that and lie back to back, else this buffer, into which they are cast in
a single pass. The buffer is allocated for each reduction and freed once the reduce-scatter has
read it (on the stream that allocated it), so it is held for one unit at a time, or two while
the previous unit's reduction is in flight.

With gradient-accumulation fusion (`GroupGrads.fuse_into_sends`) linear layers write their
weight gradients straight into the buffer, in its dtype: no gradient in the compute dtype, no
cast. The buffer is then allocated at the backward's first such write, and the cast pass adds
the gradients autograd still made (a weight used twice) to what was written.
"""

from __future__ import annotations

import torch

from megatron.core.distributed.fsdp.dbuffer import DBuffer, ShardLayout, concatenates
from megatron.core.tensor_parallel.grad_accumulation import FusionTarget


class SendBuffer:
    """The reduce-scatter inputs of one group, their views (made once) and their lifetime.

    Args:
        layout: the group's gradient layout (each tensor's N chunks).
        dtype: the reduction dtype.
        device: where the buffer lives.
        param_index: each compute weight's index in the group, by `id`.
    """

    def __init__(
        self,
        layout: ShardLayout,
        dtype: torch.dtype,
        device: torch.device,
        param_index: dict[int, int],
    ):
        self._layout = layout
        self._buffer = DBuffer(
            layout.unsharded(), dtype, device, sharded=False, rank=0, zeroed=False
        )
        padded = self._buffer.tensor_views()
        # The reduce-scatter's inputs, where each gradient goes, and the padding to zero.
        self._inputs = [view.view(-1) for view in padded]
        self._targets = [view[: shape[0]] for view, shape in zip(padded, layout.shapes)]
        self._padding = [
            view[shape[0] :] for view, shape in zip(padded, layout.shapes) if len(view) > shape[0]
        ]
        self._buffer.free_storage()
        self._param_index = param_index
        # While linear layers write the current backward's weight gradients here: per
        # parameter, whether one was written.
        self._written: list[bool] | None = None
        # What the reduce-scatter issued last on the reduce-scatter stream reads, until
        # `reduced`.
        self._in_flight: list[torch.Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The reduction dtype."""
        return self._buffer.dtype

    @property
    def holds_written(self) -> bool:
        """Whether linear layers wrote gradients here that no reduce-scatter has read yet."""
        return self._written is not None

    def target_of(self, param: torch.nn.Parameter) -> FusionTarget | None:
        """Where a linear layer writes `param`'s gradient for this backward's reduce-scatter:
        written over at its first fused gradient, added to at further ones (a weight used
        twice). None while the buffer is still read by the group's previous reduce-scatter
        (a unit that runs its backward twice in one pass): autograd keeps the gradient then.
        The buffer is allocated on the current stream, the one the unit's backward and its
        reduction run on (as autograd's own gradients are)."""
        if self._in_flight is not None:
            return None
        written = self._written
        if written is None:
            self._buffer.reallocate_storage()
            written = self._written = [False] * len(self._targets)
        index = self._param_index[id(param)]
        overwrite = not written[index]
        written[index] = True
        return FusionTarget(self._targets[index], overwrite)

    def inputs(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each gradient flat, padded to N full chunks, in the reduction dtype: the gradients
        themselves where they already are that (no copy), else the buffer, into which they
        are cast in a single pass (zeros for None; added to what linear layers wrote there),
        after which they are freed. Empties the list.

        Each input is a whole tensor, whose N row blocks the reduce-scatter splits: no packing
        into the shard-major layout, which would move every byte once more (and, fused with the
        cast as `_chunk_cat`, cost host time that grows with the bytes moved).
        """
        written, self._written = self._written, None
        if written is None:
            # `is not None` per item: `None in grads` would compare each tensor with None
            # through `Tensor.__eq__`, ~9 us per tensor of host time.
            if (
                grads[0] is not None
                and grads[0].dtype == self.dtype
                and all(grad is not None for grad in grads)
                and concatenates(grads, self._layout)
            ):
                sends = [g.view(-1) for g in grads]
                grads.clear()
                return sends
            self._buffer.reallocate_storage()
            written = [False] * len(grads)
        self._cast_in(grads, written)
        if self._padding:
            torch._foreach_zero_(self._padding)
        grads.clear()
        return self._inputs

    def _cast_in(self, grads: list[torch.Tensor | None], written: list[bool]) -> None:
        """Each gradient cast into its place in the buffer, or added where a linear layer
        wrote one there (`written`); zeros where there is neither."""
        copies, adds, zeros = ([], []), ([], []), []
        for target, grad, fused in zip(self._targets, grads, written):
            if grad is not None:
                into = adds if fused else copies
                into[0].append(target)
                into[1].append(grad)
            elif not fused:
                zeros.append(target)
        if copies[0]:
            torch._foreach_copy_(*copies)
        if adds[0]:
            torch._foreach_add_(*adds)
        if zeros:
            torch._foreach_zero_(zeros)

    def in_flight(self, sends: list[torch.Tensor]) -> None:
        """A reduce-scatter on the reduce-scatter stream reads `sends` (`inputs`' result): they
        are kept until `reduced`, and linear layers write no gradient here meanwhile."""
        self._in_flight = sends

    def reduced(self) -> None:
        """The reduce-scatter has read the inputs (the current stream has waited for it where
        it ran on another): frees them (the cast gradients, on the stream that allocated them;
        or autograd's, reduced as they were)."""
        self._in_flight = None
        self._buffer.free_storage()

    def drop_written(self) -> None:
        """Forgets what linear layers wrote for a reduction that did not run (a failed pass)."""
        if self._written is not None:
            self._written = None
            self._buffer.free_storage()
