"""`GroupGrads`: the gradients of one parameter group, as an explicit state machine.

Two buffers hold them: `main_grad`, where a step's reductions accumulate in `main_grads_dtype`
(this rank's reduced shard when gradients are sharded, else the whole local sum), and, where the
optimizer cannot read views of it, `optim_grad` (another dtype, the shard of locally accumulated
gradients under ZeRO-1, or HFSDP's outer shard). The `.grad` of every trainable main weight is a
view of the optimizer's buffer (`GradViews`).

States (`GradState`) and transitions::

    EMPTY --reduce--> ACCUMULATING --finalize--> READY --reduce--> ACCUMULATING ...
      ^                    |                       |  \\--optimizer step (fully_shard_optimizer)
      |                    |                       |        --> CONSUMED --reduce--> (as EMPTY)
      +---- zero_grad -----+------ zero_grad ------+
      +---- every .grad dropped (optimizer.zero_grad()) seen before a forward or a reduction

- EMPTY: no gradient memory; the main weights' `.grad` are None.
- ACCUMULATING: the step's reductions so far are in `main_grad`; the once-per-step reductions
  (the all-reduce or reduce-scatter of locally accumulated gradients, the outer reduction of
  hybrid sharding) have not run. Every backward pass adds to it, however many run per forward
  or per step.
- READY: finalised: the optimizer's `.grad` hold the reduced gradients (averaged over the
  data-parallel ranks; expert gradients over the dp x cp ranks too, see `expert_parallel.py`;
  summed instead where `ShardGroups.average_grads` is False).
  A further backward adds to them (as torch accumulates into `.grad`), and finalising again
  adds its reduction.
- CONSUMED: READY, after an optimizer step connected by `fully_shard_optimizer`: the next
  reduction replaces the gradients instead of adding to them.

With `OverlapPolicy.accumulate_unsharded_grads`, the sharded gradients of the microbatches
before a step's last wait outside this machine, summed whole in `main_grads_dtype` (the
*deferred* sums, freed by the reduce-scatter that consumes them or by `zero_grad`); the last
microbatch's reduction adds its gradients and reduce-scatters the sum once, a reduction like
any other above. With gradient-accumulation fusion (`fuse_into_deferred_sums`), linear layers
add their weight gradients into the sums themselves once they exist, leaving `.grad` None (so a
backward that fails leaves those in the sums, as torch leaves the `.grad` it accumulated).
Without the sums, fusion (`fuse_into_sends`) has linear layers write their weight gradients
straight into the buffer the backward's reduce-scatter reads, in its dtype: no gradient in the
compute dtype, no cast pass. Only where the unit's reduction follows its own backward
(`reduced_after_own_backward`); a failed backward's are dropped with autograd's
(`drop_unreduced`, at the next forward, `zero_grad` or finalisation).

An optimizer's `zero_grad()` (set_to_none) drops `.grad`; the group notices at its next
reduction (or before the next forward, to free the memory) and starts afresh; a `.grad` dropped
for some parameters only restarts those, and one replaced by a tensor of the user's restarts from
its values. `zero_grad(set_to_none=False)` zeroes the views in place, which the next reduction
adds to. Only `FsdpContext.finalize_grads` finalises.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import (
    DBuffer,
    concatenates,
    copy_chunks_in,
)
from megatron.core.distributed.fsdp.distributed_index import ShardGroups
from megatron.core.distributed.fsdp.grad_views import GradViews
from megatron.core.distributed.fsdp.overlap import CommStreams
from megatron.core.distributed.fsdp.plan import GroupPlan
from megatron.core.distributed.fsdp.weights import GroupWeights
from megatron.core.tensor_parallel.grad_accumulation import FusionTarget, register_main_grad


class GradState(enum.Enum):
    """Where a group's gradients are in their lifecycle (module docstring)."""

    EMPTY = "empty"
    ACCUMULATING = "accumulating"
    READY = "ready"
    CONSUMED = "consumed"


class GroupGrads:
    """The gradient buffers of one trainable group and their state.

    Args:
        plan: the group's plan.
        weights: the group's weights (whose parameters the gradients belong to).
        comm: the collectives issuer (the root context's, once bound).
    """

    def __init__(self, plan: GroupPlan, weights: GroupWeights, comm: Collectives):
        self.plan = plan
        self.weights = weights
        self.comm = comm
        self.state = GradState.EMPTY
        layout, device, precision = weights.layout, weights.device, plan.precision
        self._layout = layout
        self._groups: ShardGroups = weights.groups
        self._device = device
        self.main_grad = DBuffer(
            layout,
            precision.main_grads,
            device,
            sharded=plan.shards_grads,
            rank=weights.rank,
            zeroed=False,
        )
        if plan.shards_grads:
            # Each tensor's chunk in this rank's gradient shard: the outputs of its
            # reduce-scatter (views of persistent storage: made once).
            self._grad_chunks = list(self.main_grad.shard.split(layout.chunk_numels))
            self._init_send_buffer()
        # What the reduce-scatter issued last on the reduce-scatter stream reads, until
        # `reduction_done`.
        self._in_flight: list[torch.Tensor] | None = None
        # While linear layers write the current backward's weight gradients into the send
        # buffer (`fuse_into_sends`): per parameter, whether one was written there.
        self._written: list[bool] | None = None
        # Whether the unit's latest forward routed inputs through its post-backward hook, so
        # that its reduction follows its own backward (set by the unit at each forward). Units
        # without (the root, fed token ids) reduce at the end of the whole backward, and their
        # linear layers do not write into the send buffer, which would then hold their
        # gradients in the reduction dtype through all of it.
        self.reduced_after_own_backward = False
        self.optim_grad: DBuffer | None = None
        if weights.outer_layout is not None:
            self.optim_grad = DBuffer(
                weights.outer_layout,
                precision.main_params,
                device,
                sharded=True,
                rank=weights.outer_rank,
                zeroed=False,
            )
        elif plan.separate_optim_grad:
            self.optim_grad = DBuffer(
                layout, precision.main_params, device, sharded=True, rank=weights.rank, zeroed=False
            )
        # The whole gradient sums of a step's microbatches not yet reduce-scattered
        # (`reduce(defer=True)`), one per parameter; None when there are none.
        self._deferred: list[torch.Tensor] | None = None
        # Each compute weight's index, by identity, for gradient-accumulation fusion.
        self._param_index: dict[int, int] = {}
        self.views = GradViews(weights, self.optim_grad or self.main_grad)
        self._release()

    def _init_send_buffer(self) -> None:
        """The whole buffer gradients are cast into for their reduce-scatter (each tensor padded
        to N full chunks, in the reduction dtype), allocated for each reduction (or at the
        backward's first weight gradient a linear layer writes there, `fuse_into_sends`) and
        freed once the reduce-scatter has read it, and its views, made once: where each
        gradient goes, the padding to zero, and the reduce-scatter's inputs."""
        layout = self._layout
        self._sends = DBuffer(
            layout.unsharded(),
            self.plan.precision.grad_comm,
            self._device,
            sharded=False,
            rank=0,
            zeroed=False,
        )
        padded = self._sends.tensor_views()
        self._send_inputs = [view.view(-1) for view in padded]
        self._cast_targets = [view[: shape[0]] for view, shape in zip(padded, layout.shapes)]
        self._send_padding = [
            view[shape[0] :] for view, shape in zip(padded, layout.shapes) if len(view) > shape[0]
        ]
        self._sends.release_storage()

    def _assert_in(self, *states: GradState) -> None:
        if self.state not in states:
            raise RuntimeError(
                f"Megatron-FSDP gradients are {self.state.name}, expected "
                f"{' or '.join(s.name for s in states)}: an engine bug, please report it."
            )

    @property
    def holds_memory(self) -> bool:
        """Whether gradient memory is held (from a step's first reduction, deferred sum or
        fused weight gradient, to `zero_grad`)."""
        return (
            self.state is not GradState.EMPTY
            or self._deferred is not None
            or self._written is not None
        )

    # Reduction (every backward).

    def reduce(self, streams: CommStreams | None = None, *, defer: bool = False) -> bool:
        """Moves the gradients of the backward that just ended into `main_grad`. Called under
        `torch.no_grad()` (the context's backward hooks, which set it once per unit).

        With sharded gradients they are reduce-scattered now; otherwise they accumulate locally
        and `finalize` reduces them once. Parameters that got no gradient count as zeros, so
        every rank issues the same collectives whatever its data used.

        Args:
            streams: run the reduce-scatter on `streams.reduce_scatter` (GPU overlap); None:
                on the current stream. The gradients are cast (or packed) on the current
                stream either way.
            defer: sharded gradients are added to whole sums in the main-grads dtype instead
                (`OverlapPolicy.accumulate_unsharded_grads`), which the next reduction without
                `defer` (or `reduce_deferred`) reduce-scatters together with its own.

        Returns:
            Whether a reduce-scatter on `streams.reduce_scatter` still reads what this group
            holds for it: the caller calls `reduction_done()` once the current stream has
            waited for that stream's work.
        """
        grads = []
        for param in self.weights.unsharded_params:
            grads.append(param.grad)
            param.grad = None
        if self.plan.shards_grads and (defer or self._deferred is not None):
            self._deferred = self._summed_with_deferred(grads)
            if defer:
                return False
            grads, self._deferred = self._deferred, None
        return self._reduce_grads(grads, streams)

    def fuse_into_deferred_sums(self) -> None:
        """Lets linear layers add their weight gradients straight into the whole sums of
        `reduce(defer=True)` while a step has them (gradient-accumulation fusion, from the
        second microbatch on), instead of handing autograd a gradient to add. Parameters whose
        sums have a dtype a GEMM cannot write (other than fp32 and their own) stay unfused."""
        self._fuse(self.plan.precision.main_grads, self._deferred_sum_of, self._has_deferred_sums)

    def fuse_into_sends(self) -> None:
        """Lets linear layers write their weight gradients straight into the buffer each
        backward's reduce-scatter reads (gradient-accumulation fusion where gradients are
        sharded and not summed whole), in forwards `reduced_after_own_backward`: the GEMM
        writes the reduction dtype, and neither a gradient in the compute dtype nor its cast
        exists. The buffer is then allocated at the backward's first fused gradient instead of
        at the reduction, so up to two units' buffers are held at once (this unit's and the
        previous unit's, still in flight) instead of one and this unit's gradients in the
        compute dtype. Parameters whose reduction dtype a GEMM cannot write (other than fp32
        and their own) stay unfused; so does everything without sharded gradients."""
        if self.plan.shards_grads:
            self._fuse(self._sends.dtype, self._send_of, self._reduced_after_own_backward)

    def _reduced_after_own_backward(self) -> bool:
        return self.reduced_after_own_backward

    def _fuse(
        self,
        dtype: torch.dtype,
        target_of: Callable[[torch.nn.Parameter], FusionTarget | None],
        may_fuse: Callable[[], bool] | None = None,
    ) -> None:
        params = self.weights.unsharded_params
        self._param_index = {id(param): i for i, param in enumerate(params)}
        for param in params:
            if param.requires_grad and dtype in (torch.float32, param.dtype):
                register_main_grad(param, target_of, may_fuse)

    def _has_deferred_sums(self) -> bool:
        return self._deferred is not None

    def _deferred_sum_of(self, param: torch.nn.Parameter) -> FusionTarget | None:
        """`param`'s whole gradient sum for a fused accumulation, None before the step has
        sums (its first microbatch)."""
        if self._deferred is None:
            return None
        return FusionTarget(self._deferred[self._param_index[id(param)]])

    def _send_of(self, param: torch.nn.Parameter) -> FusionTarget | None:
        """Where a linear layer writes `param`'s gradient for this backward's reduce-scatter:
        written over at its first fused gradient, added to at further ones (a weight used
        twice). None while the send buffer is still read by the group's previous reduce-scatter
        (a unit that runs its backward twice in one pass): autograd keeps the gradient then.
        The buffer is allocated on the current stream, the one the unit's backward and its
        reduction run on (as autograd's own gradients are)."""
        if self._in_flight is not None:
            return None
        written = self._written
        if written is None:
            self._sends.reallocate_storage()
            written = self._written = [False] * len(self._cast_targets)
        index = self._param_index[id(param)]
        overwrite = not written[index]
        written[index] = True
        return FusionTarget(self._cast_targets[index], overwrite)

    def reduce_deferred(self) -> None:
        """Reduce-scatters the whole sums `reduce(defer=True)` left, if any, on the current
        stream (a step whose last microbatch did not)."""
        if self._deferred is not None:
            grads, self._deferred = self._deferred, None
            self._reduce_grads(grads, None)

    def _or_zeros(
        self, grads: list[torch.Tensor | None], dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """Each gradient, or zeros of its parameter's shape (in `dtype`, default the
        parameter's) where it is None."""
        return [
            grad if grad is not None else torch.zeros_like(param, dtype=dtype)
            for grad, param in zip(grads, self.weights.unsharded_params)
        ]

    def _summed_with_deferred(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """`grads` (None: none, or fused into the sum already) added to the deferred sums, or,
        for the step's first, as the sums: in the main-grads dtype, autograd's own tensors
        where they already have it (no copy)."""
        if self._deferred is None:
            dtype = self.plan.precision.main_grads
            return [g if g.dtype == dtype else g.to(dtype) for g in self._or_zeros(grads, dtype)]
        added = [(s, g) for s, g in zip(self._deferred, grads) if g is not None]
        if added:
            torch._foreach_add_([s for s, _ in added], [g for _, g in added])
        return self._deferred

    def _reduce_grads(self, grads: list[torch.Tensor | None], streams: CommStreams | None) -> bool:
        """`reduce` of the whole gradients `grads` (None: zeros, or written into the send
        buffer; the list is emptied where they are cast)."""
        fresh = self._begin_accumulating()
        if self.plan.shards_grads:
            return self._reduce_scatter(grads, fresh, streams)
        grads = self._or_zeros(grads)
        if fresh:
            self.main_grad.reallocate_storage()
            copy_chunks_in(grads, self.main_grad.full, self._layout)
        else:
            local = torch.empty_like(self.main_grad.full)
            copy_chunks_in(grads, local, self._layout)
            self.main_grad.full.add_(local)
        return False

    def _begin_accumulating(self) -> bool:
        """Moves to ACCUMULATING; returns whether `main_grad` starts afresh (overwritten, not
        added to). Gradients dropped or replaced since the last reduction restart
        (`GradViews.reattach`)."""
        if self.state is GradState.CONSUMED or (
            self.state is not GradState.EMPTY and not self.views.reattach()
        ):
            self._drop()
        if self.state is GradState.EMPTY:
            # The optimizer's own buffer starts at zero, as finalising adds to it; allocated on
            # the current (compute) stream, which also frees it.
            if self.optim_grad is not None:
                self.optim_grad.reallocate_storage()
                self.optim_grad.data.zero_()
            self.views.attach()
        self.state = GradState.ACCUMULATING
        return not self.main_grad.is_allocated

    def _reduce_scatter(
        self, grads: list[torch.Tensor | None], fresh: bool, streams: CommStreams | None
    ) -> bool:
        """Reduce-scatters `grads` (emptying the list) into `main_grad`; returns whether the
        reduction on `streams.reduce_scatter` still reads its inputs (False without
        `streams`: done on the current stream)."""
        sends = self._scatter_inputs(grads)
        # The whole gradients are freed (where cast) before the step's first reduction
        # allocates the gradient shards: at the root's (the largest unit's) they would peak
        # together.
        if fresh:
            self.main_grad.reallocate_storage()
        if streams is None:
            self._reduce_scatter_into_main_grad(sends, fresh)
            self._sends.release_storage()
            return False
        with streams.running_on(streams.reduce_scatter) as compute:
            streams.wait(streams.reduce_scatter, compute)
            self._reduce_scatter_into_main_grad(sends, fresh)
        self._in_flight = sends
        return True

    def reduction_done(self) -> None:
        """The current stream has waited for the reduce-scatter `reduce` left in flight: frees
        what it read (the cast gradients, on the stream that allocated them; or autograd's,
        reduced as they were)."""
        self._in_flight = None
        self._sends.release_storage()

    def _scatter_inputs(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each gradient flat, padded to N full chunks, in the reduction dtype: the gradients
        themselves where they already are that (no copy), else the send buffer, into which they
        are cast in a single pass (zeros for None; added to what linear layers wrote there
        themselves, `fuse_into_sends`), after which they are freed. Empties the list.

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
                and grads[0].dtype == self._sends.dtype
                and all(grad is not None for grad in grads)
                and concatenates(grads, self._layout)
            ):
                sends = [g.view(-1) for g in grads]
                grads.clear()
                return sends
            self._sends.reallocate_storage()
            written = [False] * len(grads)
        self._cast_into_sends(grads, written)
        if self._send_padding:
            torch._foreach_zero_(self._send_padding)
        grads.clear()
        return self._send_inputs

    def _cast_into_sends(self, grads: list[torch.Tensor | None], written: list[bool]) -> None:
        """Each gradient cast into its place in the send buffer, or added where a linear layer
        wrote one there (`written`); zeros where there is neither."""
        copies, adds, zeros = ([], []), ([], []), []
        for target, grad, fused in zip(self._cast_targets, grads, written):
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

    def _reduce_scatter_into_main_grad(self, sends: list[torch.Tensor], fresh: bool) -> None:
        """Reduces `sends` (each whole gradient, padded) into this rank's shard of
        `main_grad`: straight into it when it starts afresh in its dtype, else through a
        transient shard that is copied (cast) or added."""
        group = self._groups.shard
        comm_dtype = sends[0].dtype
        direct = fresh and comm_dtype == self.main_grad.dtype
        out = (
            self.main_grad.shard
            if direct
            else torch.empty(self._layout.shard_numel, dtype=comm_dtype, device=self._device)
        )
        outputs = self._grad_chunks if direct else out.split(self._layout.chunk_numels)
        self.comm.reduce_scatter_tensors(
            outputs,
            sends,
            group,
            average=self._groups.average_grads,
            divisor=self._groups.grad_divisor,
        )
        if direct:
            return
        if fresh:
            self.main_grad.shard.copy_(out)
        else:
            self.main_grad.shard.add_(out)

    # Finalisation (once per step, by the context).

    @torch.no_grad()
    def finalize(self) -> None:
        """Runs the reductions deferred to the end of the step and adds the result to what the
        optimizer reads: ACCUMULATING -> READY. The accumulation buffer is freed where the
        optimizer has a buffer of its own."""
        self._assert_in(GradState.ACCUMULATING)
        plan, groups, main_grad = self.plan, self._groups, self.main_grad
        if plan.shards_grads:
            reduced = main_grad.shard
        elif plan.num_shards > 1:  # ZeRO-1: this rank's shard of the local sums
            reduced = torch.empty(
                self._layout.shard_numel, dtype=plan.precision.grad_comm, device=self._device
            )
            self.comm.reduce_scatter(
                reduced,
                self._in_comm_dtype(main_grad.full),
                groups.shard,
                average=groups.average_grads,
                divisor=groups.grad_divisor,
            )
        else:
            self._all_reduce(main_grad.full, groups.shard, groups.grad_divisor)
            reduced = main_grad.full
        if plan.outer_sharded:
            reduced = self._reduce_scatter_outer()
        elif plan.reduces_outer:
            self._all_reduce(reduced, groups.outer, groups.outer_size)
        if self.optim_grad is not None:
            self.optim_grad.data.add_(reduced)
            main_grad.release_storage()
        self.state = GradState.READY

    def _in_comm_dtype(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.plan.precision.grad_comm)

    def _all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, divisor: int) -> None:
        staging = self._in_comm_dtype(tensor)
        self.comm.all_reduce(staging, group, average=self._groups.average_grads, divisor=divisor)
        if staging is not tensor:
            tensor.copy_(staging)

    def _reduce_scatter_outer(self) -> torch.Tensor:
        """HFSDP: this replica's inner gradient shard reduce-scattered over the replicas."""
        layout = self.weights.outer_layout
        comm_dtype = self.plan.precision.grad_comm
        staging = torch.empty(layout.numel, dtype=comm_dtype, device=self._device)
        copy_chunks_in(self.main_grad.local_views(), staging, layout)
        out = torch.empty(layout.shard_numel, dtype=comm_dtype, device=self._device)
        self.comm.reduce_scatter(
            out, staging, self._groups.outer, average=self._groups.average_grads
        )
        return out

    # What the optimizer sees.

    def release_if_dropped(self) -> None:
        """Frees the gradient memory once an optimizer dropped every `.grad` it reads (checked
        before a forward, where activations peak)."""
        if self.state is GradState.EMPTY or self.views.first_attached():
            return
        if self.views.num_dropped() == self.views.num_trainable():
            self._drop()

    def consumed(self) -> None:
        """An optimizer step used the gradients: the next reduction replaces them."""
        if self.state is GradState.READY:
            self.state = GradState.CONSUMED

    def scale(self, factor: float | torch.Tensor) -> None:
        """Multiplies the gradients (accumulated, deferred and handed to the optimizer) by
        `factor`."""
        for buffer in (self.main_grad, self.optim_grad):
            if buffer is not None and buffer.is_allocated:
                buffer.data.mul_(factor)
        if self._deferred is not None:
            torch._foreach_mul_(self._deferred, factor)

    def zero_grad(self) -> None:
        """Forgets every gradient, the unreduced ones of the compute weights included, and
        frees their memory (on the compute stream, which has waited for every reduction)."""
        self.drop_held()
        self._drop()

    def drop_held(self) -> None:
        """Forgets the gradients held outside any `.grad`: the unreduced ones and the whole sums
        of a step's earlier microbatches (`accumulate_unsharded_grads`)."""
        self.drop_unreduced()
        self._deferred = None

    def drop_unreduced(self) -> None:
        """Forgets the gradients a backward left for a reduction that did not run (a failed
        pass): autograd's, and what linear layers wrote into the send buffer."""
        for param in self.weights.unsharded_params:
            param.grad = None
        if self._written is not None:
            self._written = None
            self._sends.release_storage()

    def _drop(self) -> None:
        self.views.detach()
        self._release()
        self.state = GradState.EMPTY

    def _release(self) -> None:
        for buffer in (self.main_grad, self.optim_grad):
            if buffer is not None:
                buffer.release_storage()
