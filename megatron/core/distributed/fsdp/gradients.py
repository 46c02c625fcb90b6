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
- ACCUMULATING: the step's reductions so far (`BackwardReduction`) are in `main_grad`; the
  once-per-step reductions (the all-reduce or reduce-scatter of locally accumulated gradients,
  the outer reduction of hybrid sharding: `StepReduction`) have not run. Every backward pass
  adds to it, however many run per forward or per step.
- READY: finalised: the optimizer's `.grad` hold the reduced gradients (averaged over the
  data-parallel ranks; expert gradients over the dp x cp ranks too, see `expert_parallel.py`;
  summed instead where `ShardGroups.average_grads` is False).
  A further backward adds to them (as torch accumulates into `.grad`), and finalising again
  adds its reduction.
- CONSUMED: READY, after an optimizer step connected by `fully_shard_optimizer`: the next
  reduction replaces the gradients instead of adding to them.

Outside this machine, two holders keep gradients on their way to `main_grad`:

- `SendBuffer` (sharded gradients): what each backward's reduce-scatter reads, in the reduction
  dtype. With gradient-accumulation fusion (`fuse_into_sends`) linear layers write their weight
  gradients straight into it: no gradient in the compute dtype, no cast pass. Only where the
  unit's reduction follows its own backward (`pre_forward`); a failed backward's writes are
  dropped with autograd's gradients (`drop_unreduced`, at the next forward, `zero_grad` or
  finalisation). Over a shard group of one rank with no dtype to change
  (`GroupPlan.direct_grads`) a backward that starts `main_grad` afresh sends its gradients
  into `main_grad` itself, with no reduction (the average over more ranks, for expert
  gradients, taken there): from its first fused gradient where the group is EMPTY, else from
  its reduction. A failed one that wrote there leaves the group EMPTY. Later backwards' sends
  are added to `main_grad` as they are, with no copy.
- `DeferredSums` (`OverlapPolicy.accumulate_unsharded_grads`): the sharded gradients of the
  microbatches before a step's last, summed whole in `main_grads_dtype`; the last microbatch's
  reduction adds its gradients and reduce-scatters the sums once, a reduction like any other
  above. With fusion (`fuse_into_deferred_sums`) linear layers add their weight gradients into
  the sums themselves.

An optimizer's `zero_grad()` (set_to_none) drops `.grad`; the group notices at its next
reduction (or before the next forward, to free the memory) and starts afresh; a `.grad` dropped
for some parameters only restarts those, and one replaced by a tensor of the user's restarts from
its values. `zero_grad(set_to_none=False)` zeroes the views in place, which the next reduction
adds to. Only `FsdpContext.finalize_grads` finalises.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable

import torch

from megatron.core.distributed.fsdp.backward_reduction import BackwardReduction
from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import DBuffer, cast_into
from megatron.core.distributed.fsdp.deferred_sums import DeferredSums
from megatron.core.distributed.fsdp.grad_views import GradViews
from megatron.core.distributed.fsdp.overlap import CommStreams
from megatron.core.distributed.fsdp.plan import GroupPlan
from megatron.core.distributed.fsdp.send_buffer import SendBuffer
from megatron.core.distributed.fsdp.step_reduction import StepReduction
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

    Attributes:
        main_grad: where the step's reductions accumulate.
        optim_grad: the optimizer's own buffer, where it cannot read views of `main_grad`.
        views: the main weights' `.grad`.
        send_buffer: what each backward's reduce-scatter reads (None: gradients not sharded).
        deferred_sums: a step's sharded gradients summed whole until its last microbatch.
    """

    def __init__(self, plan: GroupPlan, weights: GroupWeights, comm: Collectives):
        self.plan = plan
        self.weights = weights
        self.comm = comm
        self.state = GradState.EMPTY
        layout, device, precision = weights.layout, weights.device, plan.precision
        self.main_grad = DBuffer(
            layout,
            precision.main_grads,
            device,
            sharded=plan.shards_grads,
            rank=weights.rank,
            zeroed=False,
        )
        params = weights.unsharded_params
        param_index = {id(param): i for i, param in enumerate(params)}
        self._backward_reduction = BackwardReduction(self.main_grad, layout, weights.groups, device)
        self.send_buffer: SendBuffer | None = None
        if plan.shards_grads:
            direct = self.main_grad if plan.direct_grads else None
            self.send_buffer = SendBuffer(
                layout, precision.grad_comm, device, param_index, direct=direct
            )
        self.deferred_sums = DeferredSums(params, precision.main_grads, param_index)
        self._param_index = param_index
        # Whole gradients of one shard (`fuse_into_main_grad`): each tensor's view of
        # `main_grad` (made once: valid across free / reallocate), and while a backward that
        # starts them afresh is under way, per parameter whether a linear layer wrote there.
        self._whole_views: list[torch.Tensor] | None = None
        if not plan.shards_grads and layout.num_shards == 1:
            self._whole_views = layout.local_views(self.main_grad.data, 0)
        self._whole_written: list[bool] | None = None
        # Whether the unit's latest forward routed inputs through its post-backward hook, so
        # that its reduction follows its own backward (`pre_forward`). Units without (the root,
        # fed token ids) reduce at the end of the whole backward, and their linear layers do
        # not write into the send buffer, which would then hold their gradients in the
        # reduction dtype through all of it.
        self._reduced_after_own_backward = False
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
        self._step_reduction = StepReduction(
            plan, layout, weights.outer_layout, weights.groups, device
        )
        self.views = GradViews(weights, self.optim_grad or self.main_grad)
        self._free_buffers()

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
            or self._whole_written is not None
            or self.deferred_sums.exist()
            or (self.send_buffer is not None and self.send_buffer.holds_written)
        )

    def pre_forward(self, *, reduced_after_own_backward: bool) -> None:
        """A forward of the unit's modules runs with autograd (called again where a later
        module of the unit changes the answer): its backward reduces these gradients at the
        end of the unit's own backward, or, where `reduced_after_own_backward` is False, at the
        end of the whole backward. Linear layers ask at their forward whether to write their
        weight gradients into the send buffer (`fuse_into_sends`), which only the former
        allows."""
        self._reduced_after_own_backward = reduced_after_own_backward

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
        params = self.weights.unsharded_params
        grads = [param.grad for param in params]
        for param in params:
            param.grad = None
        sums = self.deferred_sums
        if self.plan.shards_grads and (defer or sums.exist()):
            sums.add(grads)
            if defer:
                return False
            grads = sums.take()
        return self._reduce_grads(grads, streams)

    def fuse_into_deferred_sums(self) -> None:
        """Lets linear layers add their weight gradients straight into the whole sums of
        `reduce(defer=True)` while a step has them (gradient-accumulation fusion, from the
        second microbatch on), instead of handing autograd a gradient to add. Parameters whose
        sums have a dtype a GEMM cannot write (other than fp32 and their own) stay unfused."""
        sums = self.deferred_sums
        self._fuse(sums.dtype, sums.target_of, sums.exist)

    def fuse_into_sends(self) -> None:
        """Lets linear layers write their weight gradients straight into the buffer each
        backward's reduce-scatter reads (gradient-accumulation fusion where gradients are
        sharded and not summed whole), in forwards whose reduction follows the unit's own
        backward (`pre_forward`): the GEMM writes the reduction dtype, and neither a gradient
        in the compute dtype nor its cast exists. The buffer is then allocated at the
        backward's first fused gradient instead of at the reduction, so up to two units'
        buffers are held at once (this unit's and the previous unit's, still in flight)
        instead of one and this unit's gradients in the compute dtype. Parameters whose
        reduction dtype a GEMM cannot write (other than fp32 and their own) stay unfused; so
        does everything without sharded gradients."""
        sends = self.send_buffer
        if sends is not None:
            self._fuse(sends.dtype, self._send_target, self._may_fuse_into_sends)

    def _may_fuse_into_sends(self) -> bool:
        return self._reduced_after_own_backward

    def fuse_into_main_grad(self) -> None:
        """Lets linear layers write their weight gradients straight into `main_grad` where it
        holds the whole gradients in their own layout (gradients not sharded, a shard group of
        one: `no_shard`, and `optim` over one rank), as Megatron-LM's engines do: a backward
        that starts the step's gradients (the group EMPTY) overwrites, later ones add. A
        backward that fails leaves what linear layers added there, as torch leaves the `.grad`
        it accumulated; one that started the gradients leaves the group EMPTY. Parameters whose
        `main_grad` dtype a GEMM cannot write stay unfused. ZeRO-1 over several ranks keeps the
        sums shard-major, which no GEMM writes: it stays unfused."""
        if self._whole_views is not None:
            self._fuse(self.main_grad.dtype, self._whole_target)

    def _whole_target(self, param: torch.nn.Parameter) -> FusionTarget | None:
        """`param`'s view of the whole `main_grad` (`fuse_into_main_grad`); None (autograd keeps
        the gradient) where the group holds gradients that a reduction has yet to replace or
        finalising has reduced (READY, CONSUMED)."""
        index = self._param_index[id(param)]
        written = self._whole_written
        if written is None:
            if self.state is GradState.ACCUMULATING:
                return FusionTarget(self._whole_views[index])
            if self.state is not GradState.EMPTY:
                return None
            # The group stays EMPTY (`.grad` None) until the reduction attaches the views.
            self.main_grad.reallocate_storage()
            written = self._whole_written = [False] * len(self._whole_views)
        overwrite = not written[index]
        written[index] = True
        return FusionTarget(self._whole_views[index], overwrite)

    def _send_target(self, param: torch.nn.Parameter) -> FusionTarget | None:
        """`SendBuffer.target_of`, once the backward's first fused gradient has chosen where
        its gradients go: straight into `main_grad` where the plan allows it
        (`direct_grads`) and the group holds no gradients (EMPTY: `main_grad` is free); the
        send buffer otherwise. The group stays EMPTY, its `.grad` None, until the reduction
        (`_write_direct`): `main_grad` holds only part of the gradients until then."""
        sends = self.send_buffer
        if self.plan.direct_grads and sends.idle and self.state is GradState.EMPTY:
            self._begin_direct()
        return sends.target_of(param)

    def _begin_direct(self) -> None:
        """Sends this backward's gradients into `main_grad`, which starts afresh."""
        self.main_grad.reallocate_storage()
        self.send_buffer.begin_direct()

    def _fuse(
        self,
        dtype: torch.dtype,
        target_of: Callable[[torch.nn.Parameter], FusionTarget | None],
        may_fuse: Callable[[], bool] | None = None,
    ) -> None:
        for param in self.weights.unsharded_params:
            if param.requires_grad and dtype in (torch.float32, param.dtype):
                register_main_grad(param, target_of, may_fuse)

    def reduce_deferred(self) -> None:
        """Reduce-scatters the whole sums `reduce(defer=True)` left, if any, on the current
        stream (a step whose last microbatch did not)."""
        if self.deferred_sums.exist():
            self._reduce_grads(self.deferred_sums.take(), None)

    def _reduce_grads(self, grads: list[torch.Tensor | None], streams: CommStreams | None) -> bool:
        """`reduce` of the whole gradients `grads` (None: zeros, or written into the send
        buffer; the list is emptied where they are cast)."""
        sends = self.send_buffer
        if sends is not None and sends.writes_direct:  # begun by a fused gradient, from EMPTY
            self._begin_accumulating()
            return self._write_direct(grads)
        fresh = self._begin_accumulating()
        if self.plan.shards_grads:
            if fresh and self.plan.direct_grads and sends.idle:
                self._begin_direct()
                return self._write_direct(grads)
            return self._reduce_scatter(grads, fresh, streams)
        written, self._whole_written = self._whole_written, None
        if written is not None:  # linear layers wrote the step's first gradients
            cast_into(self._whole_views, grads, written)
            return False
        if self._whole_views is not None and not fresh:
            # Added to the step's earlier gradients; None: written by linear layers, or none.
            cast_into(self._whole_views, grads, itertools.repeat(True))
            return False
        grads = [
            grad if grad is not None else torch.zeros_like(param)
            for grad, param in zip(grads, self.weights.unsharded_params)
        ]
        if fresh:
            self.main_grad.reallocate_storage()
        self._backward_reduction.add_locally(grads, fresh)
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

    def _write_direct(self, grads: list[torch.Tensor | None]) -> bool:
        """Casts `grads` (emptying the list) into `main_grad` beside what linear layers wrote
        there (`_begin_direct`): the whole reduction. Returns False: nothing is in flight."""
        self.send_buffer.inputs(grads)
        self.send_buffer.reduced()
        self._backward_reduction.average_direct()
        return False

    def _reduce_scatter(
        self, grads: list[torch.Tensor | None], fresh: bool, streams: CommStreams | None
    ) -> bool:
        """Reduce-scatters `grads` (emptying the list) into `main_grad`; returns whether the
        reduction on `streams.reduce_scatter` still reads its inputs (False without
        `streams`: done on the current stream)."""
        sends = self.send_buffer.inputs(grads)
        # The whole gradients are freed (where cast) before the step's first reduction
        # allocates the gradient shards: at the root's (the largest unit's) they would peak
        # together.
        if fresh:
            self.main_grad.reallocate_storage()
        if streams is None:
            self._backward_reduction.reduce_scatter(sends, fresh, self.comm)
            self.send_buffer.reduced()
            return False
        with streams.running_on(streams.reduce_scatter) as compute:
            streams.wait(streams.reduce_scatter, compute)
            self._backward_reduction.reduce_scatter(sends, fresh, self.comm)
        self.send_buffer.in_flight(sends)
        return True

    def reduction_done(self) -> None:
        """The current stream has waited for the reduce-scatter `reduce` left in flight: frees
        what it read."""
        self.send_buffer.reduced()

    # Finalisation (once per step, by the context).

    @torch.no_grad()
    def finalize(self) -> None:
        """Runs the reductions deferred to the end of the step (`StepReduction`) and adds the
        result to what the optimizer reads: ACCUMULATING -> READY. The accumulation buffer is
        freed where the optimizer has a buffer of its own."""
        self._assert_in(GradState.ACCUMULATING)
        reduced = self._step_reduction.run(self.main_grad, self.comm)
        if self.optim_grad is not None:
            self.optim_grad.data.add_(reduced)
            self.main_grad.free_storage()
        self.state = GradState.READY

    # What the optimizer sees.

    def free_if_dropped(self) -> None:
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
        self.deferred_sums.scale(factor)

    def zero_grad(self) -> None:
        """Forgets every gradient, the unreduced ones of the compute weights included, and
        frees their memory (on the compute stream, which has waited for every reduction)."""
        self.drop_held()
        self._drop()

    def drop_held(self) -> None:
        """Forgets the gradients held outside any `.grad`: the unreduced ones and the whole sums
        of a step's earlier microbatches (`accumulate_unsharded_grads`)."""
        self.drop_unreduced()
        self.deferred_sums.drop()

    def drop_unreduced(self) -> None:
        """Forgets the gradients a backward left for a reduction that did not run (a failed
        pass): autograd's, and what linear layers wrote into the send buffer."""
        for param in self.weights.unsharded_params:
            param.grad = None
        if self._whole_written is not None:  # `main_grad` started afresh for that backward
            self._whole_written = None
            self._drop()
        sends = self.send_buffer
        if sends is not None:
            if sends.writes_direct:
                # `main_grad` started afresh for that backward (from EMPTY, or at its
                # reduction): it holds nothing else.
                self._drop()
            sends.drop_written()

    def _drop(self) -> None:
        self.views.detach()
        self._free_buffers()
        self.state = GradState.EMPTY

    def _free_buffers(self) -> None:
        for buffer in (self.main_grad, self.optim_grad):
            if buffer is not None:
                buffer.free_storage()
