"""`FsdpParameterGroup`: the parameters of one FSDP unit that share dtype, trainability and
expert-ness, with their flat buffers.

A group owns up to five `DBuffer`s (see `strategy.py` for which exist under which strategy):

- `main_weight`: what the optimizer steps, in `main_params_dtype`; the module's registered
  parameters between forwards are DTensors whose local tensors are views of it;
- `unsharded`: the compute-dtype weights the module computes with, one contiguous tensor per
  parameter; transient under ZeRO-3 (all-gathered from the main weights for each use, casting
  this rank's shard on the way, and released after), permanent otherwise;
- `model_shard` (HFSDP only): this replica's inner shard of the compute-dtype weights,
  assembled from the outer shards of the main weights once per step;
- `main_grad`: gradient accumulation in `main_grads_dtype`: this rank's shard when gradients are
  sharded, else the whole (N x S) local sum, reduced once at the end of the last microbatch;
- `optim_grad`: what the optimizer reads as `.grad`, when it cannot be a view of `main_grad`
  (another dtype, or HFSDP's smaller shard).

Gradient memory lives from a step's first reduction to `zero_grad()`, so it is not held during
the forward, where activations peak. Where the main weights are the same dtype and layout as the
compute weights they share storage (`main_weight is unsharded`), and the weight sync is a no-op.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import (
    DBuffer,
    ShardLayout,
    chunk_targets,
    concatenates,
    copy_chunks_in,
    copy_chunks_out,
)
from megatron.core.distributed.fsdp.distributed_index import ShardGroups
from megatron.core.distributed.fsdp.mixed_precision import ResolvedPrecision
from megatron.core.distributed.fsdp.overlap import CommStreams
from megatron.core.distributed.fsdp.strategy import ShardingStrategy
from megatron.core.distributed.fsdp.symmetric_memory import ALL_GATHER, REDUCE_SCATTER


@dataclass
class ParamSlot:
    """Where one parameter of a group is registered.

    Attributes:
        fqn: its name relative to the FSDP unit (the first registration, for messages).
        registrations: every (module, attribute name) that holds it, weakly (a tied parameter
            has several).
    """

    fqn: str
    registrations: list[tuple[weakref.ref[torch.nn.Module], str]]

    def parameter_entries(self) -> list[tuple[dict[str, torch.nn.Parameter | None], str]]:
        """(`module._parameters`, attribute name) of every live registering module."""
        modules = [(module_ref(), name) for module_ref, name in self.registrations]
        return [(module._parameters, name) for module, name in modules if module is not None]


class _Registration:
    """Registers one set of tensors (compute or main weights) on the modules of a group.

    Direct `module._parameters` assignment, as FSDP2 does: `setattr` would refuse a DTensor
    swap for a plain Parameter only in its type checks, and costs more. The swaps run four
    times per unit and step, so the entries are resolved once.
    """

    def __init__(self, slots: list[ParamSlot], params: list[torch.nn.Parameter]):
        self._entries = [
            (parameters, name, param)
            for slot, param in zip(slots, params)
            for parameters, name in slot.parameter_entries()
        ]

    def register(self) -> None:
        for parameters, name, param in self._entries:
            parameters[name] = param


class FsdpParameterGroup:
    """The parameters of one unit with the same (dtype, requires_grad, is_expert).

    Args:
        shapes: each parameter's shape.
        slots: where each parameter is registered.
        model_dtype: dtype of the compute weights (the dtype the module was built in).
        requires_grad: whether the parameters train.
        groups: the process groups to shard and communicate over.
        strategy: what to shard.
        precision: the resolved dtypes.
        comm: the collectives issuer.
        device: where buffers live.
    """

    def __init__(
        self,
        shapes: list[torch.Size],
        slots: list[ParamSlot],
        *,
        model_dtype: torch.dtype,
        requires_grad: bool,
        groups: ShardGroups,
        strategy: ShardingStrategy,
        precision: ResolvedPrecision,
        comm: Collectives,
        device: torch.device,
    ):
        self.requires_grad = requires_grad
        self.groups = groups
        self.strategy = strategy
        self.precision = precision
        self.comm = comm
        self.device = device

        num_shards = groups.shard_size if strategy.shards_optimizer else 1
        self.rank = groups.shard.rank() if num_shards > 1 else 0
        self.layout = ShardLayout(shapes, num_shards)
        self.shapes = self.layout.shapes
        self.unsharded = DBuffer(
            self.layout.unsharded(),
            model_dtype,
            device,
            sharded=False,
            rank=0,
            zeroed=not strategy.shards_params,
        )
        # HFSDP shards the main weights of this rank's inner shard once more over the replicas.
        self.outer_layout: ShardLayout | None = None
        self.outer_rank = 0
        self.model_shard: DBuffer | None = None
        if requires_grad and strategy.shards_outer:
            local_shapes = [self.layout.local_shape(i, self.rank) for i in range(len(shapes))]
            self.outer_layout = ShardLayout(local_shapes, groups.outer_size)
            self.outer_rank = groups.outer.rank()
            self.model_shard = self._shard_buffer(self.layout, model_dtype, self.rank)

        self.main_weight = self._build_main_weight(model_dtype)
        self.main_grad: DBuffer | None = None
        self.optim_grad: DBuffer | None = None
        if requires_grad:
            self._build_grad_buffers()

        self.placements = self._placements()
        # Views stay valid across release / reallocate (same storage), so they are made once.
        self._compute_views = [
            view[: shape[0]] for view, shape in zip(self.unsharded.tensor_views(), self.shapes)
        ]
        self._main_views = (
            self._compute_views
            if self.main_weight is self.unsharded
            else self.main_weight.local_views()
        )
        # The tensor-wise all-gather's outputs, this rank's block of each (where its input is
        # cast to), and its inputs: the chunks of the shard it gathers from.
        self._gather_targets = chunk_targets(self.unsharded, self.layout)
        self._gather_outputs = [target.view(-1) for target in self._gather_targets]
        gather_rank = groups.all_gather.rank() if self.layout.num_shards > 1 else 0
        self._gather_blocks = [target[gather_rank] for target in self._gather_targets]
        source = self.model_shard if self.model_shard is not None else self.main_weight
        self._gather_source = source
        self._gather_inputs = (
            list(source.shard.split(self.layout.chunk_numels)) if source.sharded else None
        )
        self.unsharded_params = [
            torch.nn.Parameter(view, requires_grad=requires_grad) for view in self._compute_views
        ]
        self.dist_params = [
            torch.nn.Parameter(self._dtensor(view, i), requires_grad=requires_grad)
            for i, view in enumerate(self._main_views)
        ]
        with torch.no_grad():  # the DTensors' own local tensors (with grad on: new views)
            self.local_main_weights = [param.to_local() for param in self.dist_params]
        self._unsharded_registration = _Registration(slots, self.unsharded_params)
        self._dist_registration = _Registration(slots, self.dist_params)
        if strategy.shards_params:
            self.unsharded.release_storage()

        self._stale = False
        self._pending_backwards = 0
        self._has_grad_data = False
        self._grads_attached = False
        self._pending_finalize = False
        self._grad_dtensors: list[DTensor] | None = None
        self._local_grads: list[torch.Tensor] = []
        self._steps_local = False
        self.num_weight_syncs = 0

    # Construction.

    def _shard_buffer(self, layout: ShardLayout, dtype: torch.dtype, rank: int) -> DBuffer:
        return DBuffer(layout, dtype, self.device, sharded=True, rank=rank)

    def _build_main_weight(self, model_dtype: torch.dtype) -> DBuffer:
        main_dtype = self.precision.main_params if self.requires_grad else model_dtype
        if self.outer_layout is not None:
            return self._shard_buffer(self.outer_layout, main_dtype, self.outer_rank)
        if main_dtype == model_dtype and not self._shards_main and not self.has_transient_weights:
            return self.unsharded
        return self._shard_buffer(self.layout, main_dtype, self.rank)

    @property
    def _shards_main(self) -> bool:
        """Main weights are sharded over the shard group (frozen ones follow the model weights,
        having no optimizer state to shard)."""
        if not self.requires_grad:
            return self.strategy.shards_params
        return self.strategy.shards_optimizer and self.layout.num_shards > 1

    def _build_grad_buffers(self) -> None:
        precision = self.precision
        self.main_grad = DBuffer(
            self.layout,
            precision.main_grads,
            self.device,
            sharded=self.strategy.shards_grads,
            rank=self.rank,
            zeroed=False,
        )
        if self.strategy.shards_grads:
            # Each tensor's chunk in this rank's gradient shard: the outputs of its
            # reduce-scatter (views of persistent storage: made once).
            self._grad_chunks = list(self.main_grad.shard.split(self.layout.chunk_numels))
        if self.outer_layout is not None:
            self.optim_grad = self._shard_buffer(
                self.outer_layout, precision.main_params, self.outer_rank
            )
        elif precision.main_grads != precision.main_params:
            self.optim_grad = self._shard_buffer(self.layout, precision.main_params, self.rank)
        self._release_grads()  # held only from a step's first reduction

    def _placements(self) -> tuple[Placement, ...]:
        if self.outer_layout is not None:
            placements: tuple[Placement, ...] = (Shard(0), Shard(0))
        elif not self._shards_main:
            placements = (Replicate(),)
        else:
            placements = (Shard(0),)
        if self.groups.mesh.ndim == 2 and len(placements) == 1:
            placements = (*placements, Replicate())
        return placements

    def _dtensor(self, local: torch.Tensor, index: int) -> DTensor:
        shape = self.shapes[index]
        with torch.no_grad():
            return DTensor.from_local(
                local,
                self.groups.mesh,
                self.placements,
                run_check=False,
                shape=shape,
                stride=torch.empty(shape, device="meta").stride(),
            )

    # Loading weights.

    @torch.no_grad()
    def load_full_tensor(self, index: int, full: torch.Tensor) -> None:
        """Writes parameter `index` from its whole value, keeping only what this rank holds.

        The main weights get this rank's chunk; the compute weights are written directly
        (no communication), so the group is in sync afterwards.
        """
        inner = _chunk(full, self.layout, index, self.rank)
        main = self._main_views[index]
        if self.outer_layout is not None:
            main.copy_(_chunk(inner, self.outer_layout, index, self.outer_rank))
        elif self._shards_main:
            main.copy_(inner)
        else:
            main.copy_(full)
        if self.model_shard is not None:
            self.model_shard.local_views()[index].copy_(inner)
        elif not self.has_transient_weights and self.main_weight is not self.unsharded:
            self._compute_views[index].copy_(full)

    # Weights: main -> model, unshard, reshard.

    def mark_main_weights_updated(self) -> None:
        """Records that the main weights changed (an optimizer step, a checkpoint load), so the
        compute weights must be refreshed before the next forward."""
        self._stale = True

    @property
    def is_stale(self) -> bool:
        return self._stale

    def sync_model_weights(self) -> None:
        """Refreshes the compute weights from the main weights (cast, plus an all-gather when
        the compute weights are replicated but the main weights are sharded). Under ZeRO-3 there
        is nothing to refresh but HFSDP's inner shard: every `unshard()` gathers from the main
        weights, and the whole weights must be free (the context frees stale ones first)."""
        self._stale = False
        self.num_weight_syncs += 1
        if self.model_shard is not None:
            self._sync_outer_sharded()
        elif self.has_transient_weights or self.main_weight is self.unsharded:
            return
        elif self._shards_main:
            self._gather_into_unsharded()
        else:
            self.unsharded.data.copy_(self.main_weight.data)

    def _staging(
        self, layout: ShardLayout, dtype: torch.dtype, data: torch.Tensor | None = None
    ) -> DBuffer:
        """A whole (unsharded) buffer of `layout` for one collective: `data` (from
        `Collectives.staging`), or fresh uninitialised memory."""
        return DBuffer(layout, dtype, self.device, sharded=False, rank=0, zeroed=False, data=data)

    def _sync_outer_sharded(self) -> None:
        """HFSDP: gathers this replica's inner shard from the outer shards of the main weights."""
        layout = self.outer_layout
        dtype = self.model_shard.dtype
        gathered = self._staging(layout, dtype)
        self.comm.all_gather(gathered.full, self.main_weight.data, self.groups.outer)
        inner = self._staging(layout.unsharded(), dtype)
        copy_chunks_out(gathered, inner)
        for dst, src, shape in zip(
            self.model_shard.local_views(), inner.tensor_views(), layout.shapes
        ):
            dst.copy_(src[: shape[0]])

    def _gather_into_unsharded(self) -> None:
        """All-gathers the sharded weights (HFSDP's inner shard of the compute weights, else
        the main weights) over the all-gather group into the whole compute weights, cast to
        the compute dtype: each tensor's chunks straight into the tensor, this rank's cast in
        place first, or, with symmetric memory, through the registered window and unpacked
        from it.

        The writes do not bump the weights' version counter: refilling weights that autograd
        saved in forward (and that were freed in between) restores the values it saved, which
        must not read as an in-place modification in backward.
        """
        dtype = self.unsharded.dtype
        group = self.groups.all_gather
        if self.comm.uses_symmetric_memory(group):
            data = self.comm.staging(ALL_GATHER, group, dtype, self.layout.numel, self.device)
            gathered = self._staging(self.layout, dtype, data)
            self.comm.all_gather(gathered.full, self._gather_source.shard, group)
            copy_chunks_out(gathered, self.unsharded, self._gather_targets)
            return
        with torch.autograd._unsafe_preserve_version_counter(self.unsharded.data):
            self.comm.all_gather_tensors(
                self._gather_outputs, self._gather_inputs, group, own_blocks=self._gather_blocks
            )

    def staging_requests(self) -> list[tuple[str, dist.ProcessGroup, torch.dtype, int]]:
        """(role, process group, dtype, numel) of each staging buffer this group's per-unit
        collectives use: the all-gather of weights and the reduce-scatter of gradients. A
        group of one rank communicates nothing, so it stages nothing (`Collectives.staging`)."""
        requests = []
        if self.has_transient_weights or self._shards_main:
            requests.append(
                (ALL_GATHER, self.groups.all_gather, self.unsharded.dtype, self.layout.numel)
            )
        if self.requires_grad and self.strategy.shards_grads:
            requests.append(
                (REDUCE_SCATTER, self.groups.shard, self.precision.grad_comm, self.layout.numel)
            )
        return [request for request in requests if request[1].size() > 1]

    def unshard(self) -> None:
        """Makes the compute weights whole (ZeRO-3: all-gather them; otherwise they are)."""
        if not self.has_transient_weights or self.unsharded.is_allocated:
            return
        self.unsharded.reallocate_storage()
        self._gather_into_unsharded()

    def reshard(self) -> None:
        """Frees the whole compute weights (ZeRO-3 only)."""
        if self.has_transient_weights:
            self.unsharded.release_storage()

    @property
    def has_transient_weights(self) -> bool:
        """Whether the whole compute weights are gathered for use and freed after (ZeRO-3)."""
        return self.strategy.shards_params

    def use_unsharded_params(self) -> None:
        """Registers the compute weights on their modules (for forward and backward); a main
        weight frozen since wrapping freezes its compute weight too."""
        for param, main in zip(self.unsharded_params, self.dist_params):
            if param.requires_grad != main.requires_grad:
                param.requires_grad_(main.requires_grad)
        self._unsharded_registration.register()

    def use_dist_params(self) -> None:
        """Registers the DTensor main weights on their modules (between steps)."""
        self._dist_registration.register()

    # Gradients.

    def note_forward(self) -> None:
        """Counts a forward (with autograd on) whose gradients this group must reduce."""
        if self.requires_grad:
            self._pending_backwards += 1

    @property
    def awaits_grads(self) -> bool:
        """Some forward of this group has not had its gradients reduced yet."""
        return self._pending_backwards > 0

    @torch.no_grad()
    def reduce_grads(self, streams: CommStreams | None = None) -> list[torch.Tensor] | None:
        """Moves the gradients of the unit's backward that just ended into `main_grad`.

        With sharded gradients they are reduce-scattered now (written straight into
        `main_grad` on the first microbatch, accumulated after); otherwise they accumulate
        locally and `finalize_grads` reduces them once. Parameters that got no gradient count
        as zeros, so every rank issues the same collectives whatever its data used.

        Args:
            streams: run the reduce-scatter on `streams.reduce_scatter` (GPU overlap); None:
                on the current stream. The gradients are cast (or packed) on the current
                stream either way.

        Returns:
            The tensors a reduce-scatter on the reduce-scatter stream still reads: the caller
            keeps them alive, unwritten, until that stream's work is done. None otherwise.
        """
        grads = []
        for param in self.unsharded_params:
            grad = param.grad
            grads.append(grad if grad is not None else torch.zeros_like(param))
            param.grad = None
        first = self._main_grad_is_empty()
        in_flight = None
        if self.strategy.shards_grads:
            in_flight = self._reduce_scatter(grads, first, streams)
        elif first:
            self._allocate_grads()
            copy_chunks_in(grads, self.main_grad.full, self.layout)
        else:
            local = torch.empty_like(self.main_grad.full)
            copy_chunks_in(grads, local, self.layout)
            self.main_grad.full.add_(local)
        self._pending_backwards = max(0, self._pending_backwards - 1)
        self._has_grad_data = True
        self._pending_finalize = True
        if first:  # later reductions find them attached (or they would start afresh)
            self._attach_grads()
        return in_flight

    def _reduce_scatter(
        self, grads: list[torch.Tensor], first: bool, streams: CommStreams | None
    ) -> list[torch.Tensor] | None:
        """Reduce-scatters `grads` (emptying the list) into `main_grad`; returns what a
        reduction on `streams.reduce_scatter` still reads (None without `streams`)."""
        symmetric = self.comm.uses_symmetric_memory(self.groups.shard)
        sends = [self._pack_grads(grads)] if symmetric else self._scatter_inputs(grads)
        # The whole gradients are freed (where cast) before the step's first reduction
        # allocates the gradient shards: at the root's (the largest unit's) they would peak
        # together.
        if first:
            self._allocate_grads()
        if streams is None:
            self._reduce_scatter_into_main_grad(sends, first, symmetric)
            return None
        with streams.running_on(streams.reduce_scatter) as compute:
            streams.reduce_scatter.wait_stream(compute)
            self._reduce_scatter_into_main_grad(sends, first, symmetric)
        return sends

    def _scatter_inputs(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each gradient flat, padded to N full chunks, in the reduction dtype: the gradients
        themselves where they already are that (no copy), else cast into one transient buffer
        in a single pass, after which the gradients are freed. Empties the list.

        Each input is a whole tensor, whose N row blocks the reduce-scatter splits: no packing
        into the shard-major layout, which would move every byte once more (and, fused with the
        cast as `_chunk_cat`, cost host time that grows with the bytes moved).
        """
        comm_dtype = self.precision.grad_comm
        if grads[0].dtype == comm_dtype and concatenates(grads, self.layout):
            sends = [g.view(-1) for g in grads]
        else:
            staging = torch.empty(self.layout.numel, dtype=comm_dtype, device=self.device)
            sends = list(staging.split(self.unsharded.layout.chunk_numels))
            flat = [g.reshape(-1) for g in grads]
            if self.layout.splits_evenly:
                torch._foreach_copy_(sends, flat)
            else:
                torch._foreach_copy_([s[: g.numel()] for s, g in zip(sends, flat)], flat)
                for send, grad in zip(sends, flat):
                    send[grad.numel() :].zero_()
        grads.clear()
        return sends

    def _pack_grads(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """`grads` packed N x S (shard-major) in the reduction dtype into the symmetric
        reduce-scatter window, cast on the way; empties the list, which frees them. The
        symmetric kernels need the collective's whole input in the registered window."""
        data = self.comm.staging(
            REDUCE_SCATTER,
            self.groups.shard,
            self.precision.grad_comm,
            self.layout.numel,
            self.device,
        )
        copy_chunks_in(grads, data, self.layout)
        grads.clear()
        return data

    def _reduce_scatter_into_main_grad(
        self, sends: list[torch.Tensor], first: bool, symmetric: bool
    ) -> None:
        """Reduces `sends` (the packed window, or each whole gradient) into this rank's shard
        of `main_grad`: straight into it on a step's first reduction in its dtype, else through
        a transient shard that is copied (cast) or added."""
        group = self.groups.shard
        comm_dtype = sends[0].dtype
        direct = first and comm_dtype == self.main_grad.dtype
        out = (
            self.main_grad.shard
            if direct
            else torch.empty(self.layout.shard_numel, dtype=comm_dtype, device=self.device)
        )
        if symmetric:
            self.comm.reduce_scatter(out, sends[0], group, average=True)
        else:
            outputs = self._grad_chunks if direct else out.split(self.layout.chunk_numels)
            self.comm.reduce_scatter_tensors(outputs, sends, group, average=True)
        if direct:
            return
        if first:
            self.main_grad.shard.copy_(out)
        else:
            self.main_grad.shard.add_(out)

    def _main_grad_is_empty(self) -> bool:
        if not self._has_grad_data:
            return True
        # `optimizer.zero_grad()` (set_to_none) since the last reduction: start afresh.
        return self._grads_attached and any(p.grad is None for p in self._optimizer_params())

    def _optimizer_params(self) -> list[torch.Tensor]:
        """The trainable tensors whose `.grad` the optimizer reads (and `zero_grad()` drops):
        the local shards once an optimizer steps them, else the DTensor main weights."""
        params = self.local_main_weights if self._steps_local else self.dist_params
        return [p for p, main in zip(params, self.dist_params) if main.requires_grad]

    @torch.no_grad()
    def finalize_grads(self) -> None:
        """Runs the reductions deferred to the end of the last microbatch and fills what the
        optimizer reads: the all-reduce of unsharded gradients (no_shard, optim), the outer
        all-reduce (HSDP) or reduce-scatter (HFSDP), and a cast to the main-weights dtype."""
        if not self._pending_finalize:
            return
        self._pending_finalize = False
        main_grad = self.main_grad
        if not self.strategy.shards_grads:
            self._all_reduce(main_grad.full, self.groups.shard)
            if self.groups.outer is not None:
                self._all_reduce(main_grad.full, self.groups.outer)
        elif self.outer_layout is not None:
            self._reduce_scatter_outer()
            return
        elif self.groups.outer is not None:
            self._all_reduce(main_grad.shard, self.groups.outer)
        if self.optim_grad is not None:
            self.optim_grad.data.copy_(main_grad.shard)

    def _all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        comm_dtype = self.precision.grad_comm
        if comm_dtype == tensor.dtype:
            self.comm.all_reduce(tensor, group, average=True)
            return
        staging = tensor.to(comm_dtype)
        self.comm.all_reduce(staging, group, average=True)
        tensor.copy_(staging)

    def _reduce_scatter_outer(self) -> None:
        layout = self.outer_layout
        comm_dtype = self.precision.grad_comm
        staging = self._staging(layout, comm_dtype)
        copy_chunks_in(self.main_grad.local_views(), staging.full, layout)
        out = torch.empty(layout.shard_numel, dtype=comm_dtype, device=self.device)
        staging.reduce_scatter(out, self.comm, self.groups.outer, average=True)
        self.optim_grad.data.copy_(out)

    def _attach_grads(self) -> None:
        """Points the `.grad` of each trainable main weight (the DTensor, and its local shard
        once an optimizer steps those) at its shard of the reduced gradients; a weight frozen
        after wrapping gets none, so the optimizer skips it."""
        if self._grad_dtensors is None:  # views of persistent storage: made once
            source = self.optim_grad or self.main_grad
            self._local_grads = source.local_views()
            self._grad_dtensors = [
                self._dtensor(local, index) for index, local in enumerate(self._local_grads)
            ]
        for param, local, grad, local_grad in zip(
            self.dist_params, self.local_main_weights, self._grad_dtensors, self._local_grads
        ):
            trainable = param.requires_grad
            param.grad = grad if trainable else None
            if self._steps_local:
                local.grad = local_grad if trainable else None
        self._grads_attached = True

    def attach_local_grads(self) -> None:
        """From now on also points each local main weight's `.grad` at the local shard of its
        DTensor's `.grad` (None where that is None), for an optimizer stepping the local
        tensors, so that its `zero_grad()` drops them like any other."""
        self._steps_local = True
        with torch.no_grad():
            for local, param in zip(self.local_main_weights, self.dist_params):
                local.grad = param.grad.to_local() if param.grad is not None else None

    def grads_consumed(self) -> None:
        """An optimizer step used the gradients: the next reduction starts afresh, even if
        `zero_grad(set_to_none=False)` zeroed only what the optimizer sees."""
        self._has_grad_data = False

    def zero_grad(self) -> None:
        """Forgets accumulated gradients and frees their memory until the next reduction
        writes them afresh (on the compute stream, which has waited for every reduction)."""
        self._pending_backwards = 0
        self._has_grad_data = False
        self._pending_finalize = False
        self._drop_grads()

    def _drop_grads(self) -> None:
        """Detaches every gradient view and frees the gradient buffers."""
        self._grads_attached = False
        for param in (*self.unsharded_params, *self.dist_params, *self.local_main_weights):
            param.grad = None
        self._release_grads()

    def _allocate_grads(self) -> None:
        """Allocates the gradient buffers (uninitialised: the first reduction overwrites them)
        on the current stream, the compute stream, which also frees them."""
        for buffer in (self.main_grad, self.optim_grad):
            if buffer is not None:
                buffer.reallocate_storage()

    def _release_grads(self) -> None:
        for buffer in (self.main_grad, self.optim_grad):
            if buffer is not None:
                buffer.release_storage()

    def release_dropped_grads(self) -> None:
        """Frees the gradient memory once the optimizer's `zero_grad(set_to_none=True)` dropped
        every `.grad` it reads since the last reduction. Called before a step's forward, where
        activations peak."""
        if (
            self._grads_attached
            and self.has_grads
            and all(p.grad is None for p in self._optimizer_params())
        ):
            self._has_grad_data = False
            self._drop_grads()

    @property
    def has_grads(self) -> bool:
        """Whether gradient memory is held (from the step's first reduction to `zero_grad`)."""
        return self.main_grad is not None and self.main_grad.is_allocated


def _chunk(full: torch.Tensor, layout: ShardLayout, index: int, shard: int) -> torch.Tensor:
    """Shard `shard`'s rows of tensor `index` (torch.chunk semantics)."""
    rows = layout.chunk_rows[index]
    return full.narrow(0, min(shard * rows, full.shape[0]), layout.valid_rows(index, shard))
