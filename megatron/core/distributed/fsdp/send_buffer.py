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

Over a shard group of one rank, with no dtype to change, the reduce-scatter would only copy the
buffer into `main_grad` (and scale it, for expert gradients averaged over more ranks), whose
shard is then the whole gradients in the same layout. A backward whose reduction would start
`main_grad` afresh writes there instead (`begin_direct`): the same writes and casts, into the
memory the optimizer reads, then the scaling in place, and no reduction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron.core.distributed.fsdp.dbuffer import DBuffer, ShardLayout, cast_into, concatenates
from megatron.core.tensor_parallel.grad_accumulation import FusionTarget


class _Slots(NamedTuple):
    """Views of one storage laid out as the reduce-scatter reads it.

    Attributes:
        inputs: each tensor flat, padded to N full chunks.
        targets: each tensor's real rows, where its gradient goes.
        padding: the padded rows of the tensors that have any, zeroed before a reduction.
    """

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    padding: list[torch.Tensor]

    @classmethod
    def over(cls, padded: list[torch.Tensor], shapes: list[torch.Size]) -> _Slots:
        """The slots of `padded`, each tensor's view padded to N full chunks."""
        return cls(
            [view.view(-1) for view in padded],
            [view[: shape[0]] for view, shape in zip(padded, shapes)],
            [view[shape[0] :] for view, shape in zip(padded, shapes) if len(view) > shape[0]],
        )


class SendBuffer:
    """The reduce-scatter inputs of one group, their views (made once) and their lifetime.

    Args:
        layout: the group's gradient layout (each tensor's N chunks).
        dtype: the reduction dtype.
        device: where the buffer lives.
        param_index: each compute weight's index in the group, by `id`.
        direct: `main_grad`, where the group's reduction only copies (module docstring):
            `begin_direct` then sends a backward's gradients there. Its layout must be
            `layout`, of one shard, in `dtype`.
    """

    def __init__(
        self,
        layout: ShardLayout,
        dtype: torch.dtype,
        device: torch.device,
        param_index: dict[int, int],
        direct: DBuffer | None = None,
    ):
        self._layout = layout
        self._buffer = DBuffer(
            layout.unsharded(), dtype, device, sharded=False, rank=0, zeroed=False
        )
        self._own = _Slots.over(self._buffer.tensor_views(), layout.shapes)
        self._direct: _Slots | None = None
        if direct is not None:
            if layout.num_shards != 1 or direct.dtype != dtype:
                raise ValueError("A direct send target is one shard of the reduction dtype.")
            self._direct = _Slots.over(layout.local_views(direct.data, 0), layout.shapes)
        # Where the current backward's gradients go: this buffer, or `direct`.
        self._slots = self._own
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

    @property
    def idle(self) -> bool:
        """Whether the current backward has put nothing here yet and no reduce-scatter reads
        it: where its gradients go is still open."""
        return self._written is None and self._in_flight is None

    @property
    def writes_direct(self) -> bool:
        """Whether the current backward's gradients go into `direct` (`begin_direct`)."""
        return self._slots is self._direct

    def begin_direct(self) -> None:
        """Sends the current backward's gradients into `direct` instead of this buffer; the
        caller has allocated it, and it starts afresh: each gradient's first write (or cast)
        overwrites it, and what gets none is zeroed. Only while `idle`."""
        self._slots = self._direct
        self._written = [False] * len(self._own.targets)

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
            written = self._written = [False] * len(self._own.targets)
        index = self._param_index[id(param)]
        overwrite = not written[index]
        written[index] = True
        return FusionTarget(self._slots.targets[index], overwrite)

    def inputs(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each gradient flat, padded to N full chunks, in the reduction dtype: the gradients
        themselves where they already are that (no copy), else the buffer (or `direct`, after
        `begin_direct`), into which they are cast in a single pass (zeros for None; added to
        what linear layers wrote there), after which they are freed. Empties the list.

        Each input is a whole tensor, whose N row blocks the reduce-scatter splits: no packing
        into the shard-major layout, which would move every byte once more (and, fused with the
        cast as `_chunk_cat`, cost host time that grows with the bytes moved).
        """
        written, self._written = self._written, None
        slots = self._slots
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
        cast_into(slots.targets, grads, written)
        if slots.padding:
            torch._foreach_zero_(slots.padding)
        grads.clear()
        return slots.inputs

    def in_flight(self, sends: list[torch.Tensor]) -> None:
        """A reduce-scatter on the reduce-scatter stream reads `sends` (`inputs`' result): they
        are kept until `reduced`, and linear layers write no gradient here meanwhile."""
        self._in_flight = sends

    def reduced(self) -> None:
        """The reduce-scatter has read the inputs (the current stream has waited for it where
        it ran on another): frees them (the cast gradients, on the stream that allocated them;
        or autograd's, reduced as they were)."""
        self._in_flight = None
        self._slots = self._own
        self._buffer.free_storage()

    def drop_written(self) -> None:
        """Forgets what linear layers wrote for a reduction that did not run (a failed pass);
        what went into `direct` stays there, for the caller to drop."""
        self._slots = self._own
        if self._written is not None:
            self._written = None
            self._buffer.free_storage()
