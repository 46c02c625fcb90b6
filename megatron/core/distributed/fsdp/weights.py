"""`GroupWeights`: the weights of one parameter group: unshard, reshard, refresh, register.

The module's registered parameters are the DTensor main weights between forwards (what
`parameters()`, `state_dict()` and optimizers see) and the whole compute weights during forward
and backward. The compute weights are made from the main weights, so they must follow every
change of them, however it was made. The group's *main version* is the one signal for that: the
sum of the version counters of every tensor through which the main weights can be written (the
flat buffer, each DTensor, each local shard: in-place writes through any of them bump it) plus a
count of optimizer steps over them (fused and foreach kernels write without bumping version
counters; `optimizer_steps.py` counts their steps in `untracked_writes`, as does a forced
refresh). The compute weights remember the version they were made from and are refreshed, or
gathered again, when it differs. Writes through `.data` bypass version counters (as they bypass
autograd): follow them with `mark_written()` (`start_param_sync(force_sync=True)`). Wherever the
compute weights are rewritten or freed, their FP8 copies (`megatron.core.fp8.weights`, which
cannot see these writes: they bump no version counter) are dropped, to be made again from the
new values at their next use. A group with `plan.fp8_gather` keeps FP8 compute weights instead
(`Fp8ComputeWeights`, `fp8_gather.py`): its refresh starts with `start_fp8_refresh` (the
amaxes, reduced with other groups' by the caller), unshard and reshard gather and free them,
and its model-dtype compute weights are released at construction and never allocated again.

Under tensor or expert parallelism each parameter is this rank's part of a global tensor: the
buffers hold and shard that part like any parameter, and the DTensors show the global tensor,
placed over the mesh's leading dimensions as `LeadingGroups` (`leading_groups.py`) says for the
parameter's layout, then as the plan shards it.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import (
    DBuffer,
    ShardLayout,
    chunk_targets,
    copy_chunks_out,
)
from megatron.core.distributed.fsdp.distributed_index import ShardGroups
from megatron.core.distributed.fsdp.fp8_gather import Fp8ComputeWeights
from megatron.core.distributed.fsdp.plan import GroupPlan, Refresh
from megatron.core.distributed.tensor_parallel_params import check_data_parallel_chunks, dtensor
from megatron.core.fp8.weights import forget_fp8_weights
from megatron.core.fusions.fused_adam import StepAmaxes
from megatron.core.fusions.segment_copy import SegmentCopy
from megatron.core.tensor_parallel.layout import TensorParallelLayout

_version = operator.attrgetter("_version")
_requires_grad = operator.attrgetter("requires_grad")


@dataclass
class ParamSlot:
    """Where one parameter of a group is registered.

    Attributes:
        fqn: its name relative to the FSDP unit (the first registration, for messages).
        registrations: every (module, attribute name) that holds it, weakly (a tied parameter
            has several).
        tp_layout: how it is split over tensor parallelism (None: replicated, or no TP).
    """

    fqn: str
    registrations: list[tuple[weakref.ref[torch.nn.Module], str]]
    tp_layout: TensorParallelLayout | None = None

    def parameter_entries(self) -> list[tuple[dict[str, torch.nn.Parameter | None], str]]:
        """(`module._parameters`, attribute name) of every live registering module."""
        modules = [(module_ref(), name) for module_ref, name in self.registrations]
        return [(module._parameters, name) for module, name in modules if module is not None]


class _Registration:
    """Registers one set of tensors (unsharded or main weights) on the modules of a group.

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


class GroupWeights:
    """The unsharded and sharded main weights of one group, and the inner shard under HFSDP.

    Args:
        plan: the group's plan.
        layout: the layout of the shard group (N = `plan.num_shards`).
        slots: where each parameter is registered.
        groups: the process groups.
        comm: the collectives issuer (the root context's, once bound).
        device: where the buffers live.

    Attributes:
        unsharded_params: the compute weights, registered for forward and backward.
        main_weights: the DTensor main weights, registered between forwards.
        local_main_weights: each DTensor's local tensor (its shard, a view of the main buffer).
        untracked_writes: writes to the main weights that bumped no version counter.
        fp8: the FP8 compute weights (`plan.fp8_gather`), else None.
    """

    def __init__(
        self,
        plan: GroupPlan,
        layout: ShardLayout,
        slots: list[ParamSlot],
        groups: ShardGroups,
        comm: Collectives,
        device: torch.device,
    ):
        self.plan = plan
        self.layout = layout
        self.groups = groups
        self.comm = comm
        self.device = device
        self.rank = groups.shard.rank() if layout.num_shards > 1 else 0
        self._tp_layouts = [slot.tp_layout for slot in slots]
        self.fqns = [slot.fqn for slot in slots]  # for messages
        self._placements = self._param_placements(slots)
        self.unsharded = DBuffer(
            layout.unsharded(),
            plan.model_dtype,
            device,
            sharded=False,
            rank=0,
            zeroed=not (plan.transient_unsharded or plan.fp8_gather),
        )
        self.outer_layout: ShardLayout | None = None
        self.outer_rank = 0
        self.inner_shard: DBuffer | None = None
        if plan.outer_sharded:
            local_shapes = [layout.local_shape(i, self.rank) for i in range(len(layout))]
            self.outer_layout = ShardLayout(local_shapes, groups.outer_size)
            self.outer_rank = groups.outer.rank()
            self.inner_shard = DBuffer(
                layout, plan.model_dtype, device, sharded=True, rank=self.rank
            )
            self.sharded_main = DBuffer(
                self.outer_layout, plan.main_dtype, device, sharded=True, rank=self.outer_rank
            )
        elif plan.main_is_unsharded:
            self.sharded_main = self.unsharded
        else:
            self.sharded_main = DBuffer(
                layout, plan.main_dtype, device, sharded=True, rank=self.rank
            )

        self._bind_unsharded_views()
        self._main_views = (
            self._compute_views if plan.main_is_unsharded else self.sharded_main.local_views()
        )
        # The tensor-wise all-gather's inputs: the chunks of the shard it gathers from, cast
        # into this rank's block of each tensor in one launch where the kernel runs.
        source = self.inner_shard if self.inner_shard is not None else self.sharded_main
        self._gather_source = source
        self._gather_inputs = None
        self._own_block_copy: SegmentCopy | None = None
        if source.sharded:
            self._gather_inputs = list(source.shard.split(layout.chunk_numels))
            own_blocks = [
                start + self._gather_rank() * numel
                for start, numel in zip(self.unsharded.layout.offsets, layout.chunk_numels)
            ]
            self._own_block_copy = SegmentCopy.make(
                source.shard, self.unsharded.data, layout.offsets, own_blocks, layout.chunk_numels
            )
        trains = plan.requires_grad
        self.unsharded_params = [
            torch.nn.Parameter(view, requires_grad=trains) for view in self._compute_views
        ]
        self.main_weights = [
            torch.nn.Parameter(self.dtensor(view, i), requires_grad=trains)
            for i, view in enumerate(self._main_views)
        ]
        with torch.no_grad():  # the DTensors' own local tensors (with grad on: new views)
            self.local_main_weights = [param.to_local() for param in self.main_weights]
        self._writable = [self.sharded_main.data, *self.main_weights, *self.local_main_weights]
        self._unsharded_registration = _Registration(slots, self.unsharded_params)
        self._sharded_registration = _Registration(slots, self.main_weights)
        self.fp8: Fp8ComputeWeights | None = None
        if plan.fp8_gather:
            self.fp8 = Fp8ComputeWeights(
                layout,
                self.rank,
                self.unsharded_params,
                self.fqns,
                model_dtype=plan.model_dtype,
                transient=plan.transient_unsharded,
                amax_group=groups.shard if layout.num_shards > 1 else None,
                gather_group=groups.all_gather,
                device=device,
                keep_transposes=plan.keeps_fp8_transposes,
                transpose_together=True,
            )
        if plan.transient_unsharded or plan.fp8_gather:
            self.unsharded.free_storage()
        self.untracked_writes = 0
        # The main version whose amaxes an optimizer step recorded (`step_amaxes_recorded`).
        self._amaxes_version: int | None = None
        # id -> (weakref, version counted) of each live `aliased_dtensor` local tensor.
        self._aliases: dict[int, tuple[weakref.ref, int]] = {}
        self._observed_version = self.main_version()
        # FP8 compute weights are made by the first refresh.
        self._made_version = -1 if plan.fp8_gather else self._observed_version

    def _bind_unsharded_views(self) -> None:
        """Makes the views of the unsharded buffer that every use reads: each compute weight
        (its real rows), and the tensor-wise all-gather's outputs and this rank's block of each
        (where its input is cast to). They stay valid across free / reallocate (same
        storage), so they are made once, and again only if the buffer moves."""
        layout = self.layout
        self._compute_views = [
            view[: shape[0]] for view, shape in zip(self.unsharded.tensor_views(), layout.shapes)
        ]
        targets = chunk_targets(self.unsharded, layout)
        self._gather_outputs = [target.view(-1) for target in targets]
        self._gather_blocks = [target[self._gather_rank()] for target in targets]

    def _gather_rank(self) -> int:
        """This rank's block in each gathered tensor: its rank in the all-gather group."""
        return self.groups.all_gather.rank() if self.layout.num_shards > 1 else 0

    def _param_placements(self, slots: list[ParamSlot]) -> list[tuple[Placement, ...]]:
        """Each parameter's placements: over the leading dimensions, then the plan's.

        Raises:
            ValueError: a strided TP parameter's data-parallel chunk spans two blocks.
        """
        leading = self.groups.leading
        if leading.tp is not None:
            sizes = (self.groups.shard_size, self.groups.outer_size)
            counts = [n for p, n in zip(self.plan.placements, sizes) if p.is_shard()]
            for slot, shape in zip(slots, self.layout.shapes):
                check_data_parallel_chunks(slot.fqn, shape, slot.tp_layout, counts)
        return [(*leading.placements(slot.tp_layout), *self.plan.placements) for slot in slots]

    def global_shape(self, index: int) -> torch.Size:
        """The shape of parameter `index` as its DTensors show it: the module's; for experts
        split by expert parallelism the global `[num_experts, ...]`; for a parameter split by
        tensor parallelism the global (TP = 1) shape."""
        return self.groups.leading.global_shape(self.layout.shapes[index], self._tp_layouts[index])

    def dtensor(self, local: torch.Tensor, index: int) -> DTensor:
        """`local` (this rank's part of parameter `index`) as a DTensor over the group's mesh."""
        with torch.no_grad():
            return dtensor(
                local, self.groups.mesh, self._placements[index], self.global_shape(index)
            )

    def aliased_dtensor(self, index: int) -> DTensor:
        """Main weight `index` as a new DTensor over a tensor of its own that aliases the main
        weight's memory at storage offset 0; `main_version` counts the writes through it.

        The main weights are views into one buffer, and a DTensor takes its local tensor's
        storage offset, which `torch.save` and `copy.deepcopy` cannot handle (they fail on
        "an invalid python storage"); a `state_dict()` value must survive both.
        """
        self._count_alias_writes()  # before an id of a dead alias can be reused
        with torch.no_grad():
            alias = torch.from_dlpack(self.local_main_weights[index].detach())
        self._aliases[id(alias)] = (weakref.ref(alias), alias._version)
        return self.dtensor(alias, index)

    # The main version.

    def main_version(self) -> int:
        """A number that changes whenever the main weights are written (module docstring)."""
        self._count_alias_writes()
        return self.untracked_writes + sum(map(_version, self._writable))

    def _count_alias_writes(self) -> None:
        """Adds the writes through the live `aliased_dtensor` tensors since last counted to
        `untracked_writes` (a running count, so an alias that dies takes nothing back), and
        forgets the dead ones."""
        if not self._aliases:  # the common case, once per root forward: no state_dict() alive
            return
        for key, (ref, counted) in list(self._aliases.items()):
            alias = ref()
            if alias is None:
                del self._aliases[key]
            elif alias._version != counted:
                self.untracked_writes += alias._version - counted
                self._aliases[key] = (ref, alias._version)

    def mark_written(self) -> None:
        """Records a write to the main weights that bumped no version counter."""
        self.untracked_writes += 1

    def observe_main_weights(self) -> None:
        """Reads the main version now, and makes each compute weight require a gradient where
        its main weight does (a main weight frozen since wrapping freezes its compute weight).
        Once per root forward (and per use of a unit outside one): the reads cost host time.

        Raises:
            ValueError: a main weight frozen when its group was made (which keeps no
                gradients) was unfrozen since.
        """
        self._observed_version = self.main_version()
        # Once per group and root forward: the common case, nothing frozen or unfrozen, in two
        # passes of C calls.
        if list(map(_requires_grad, self.unsharded_params)) == list(
            map(_requires_grad, self.main_weights)
        ):
            return
        for param, main, fqn in zip(self.unsharded_params, self.main_weights, self.fqns):
            if param.requires_grad != main.requires_grad:
                if main.requires_grad and not self.plan.requires_grad:
                    raise ValueError(
                        f"{fqn} was frozen (requires_grad=False) when fully_shard() grouped it, "
                        "so Megatron-FSDP keeps no gradients for it, and it was unfrozen since. "
                        "Set requires_grad before fully_shard(): wrap it trainable and freeze it "
                        "for the steps that leave it unused."
                    )
                param.requires_grad_(main.requires_grad)

    @property
    def is_stale(self) -> bool:
        """The compute weights were made from older main weights than last observed."""
        return self._observed_version != self._made_version

    # Loading.

    @torch.no_grad()
    def load_global_tensor(self, index: int, full: torch.Tensor) -> None:
        """Writes parameter `index` from its global value (`global_shape(index)`: all experts
        of an expert parameter, every TP rank's part), keeping only what this rank holds."""
        local = self.groups.leading.local_part(full, self._tp_layouts[index])
        self.load_full_tensor(index, local)

    @torch.no_grad()
    def load_full_tensor(self, index: int, full: torch.Tensor) -> None:
        """Writes parameter `index` from its whole value on this rank (the module's parameter:
        for an expert parameter, this rank's experts), keeping only what this rank holds.

        The main weights get this rank's part, and the compute weights that persist are written
        directly (no communication), so weights in sync before stay in sync.
        """
        in_sync = self._made_version == self.main_version()
        inner = _chunk(full, self.layout, index, self.rank)
        main = self._main_views[index]
        if self.outer_layout is not None:
            main.copy_(_chunk(inner, self.outer_layout, index, self.outer_rank))
        elif self.plan.shards_main:
            main.copy_(inner)
        else:
            main.copy_(full)
        if self.fp8 is not None:
            return  # stale: the next refresh casts (a collective, as loads are)
        if self.inner_shard is not None:
            self.inner_shard.local_views()[index].copy_(inner)
        elif not self.plan.transient_unsharded and not self.plan.main_is_unsharded:
            self._compute_views[index].copy_(full)
        forget_fp8_weights(self.unsharded_params[index : index + 1])
        if in_sync:
            self._made_version = self._observed_version = self.main_version()

    # Refresh, unshard, reshard.

    def start_fp8_refresh(self) -> Fp8ComputeWeights:
        """First step of the refresh of FP8 compute weights (`plan.fp8_gather`): HFSDP's inner
        shard, then this rank's amaxes (unless the optimizer step that wrote the main weights
        observed now recorded them: `step_amax_targets`); the caller reduces them with other
        groups' (`fp8_gather.Fp8Refresh`) before `refresh()`."""
        if self.plan.refresh is Refresh.OUTER_GATHER:
            self._gather_inner_shard()
        source = self._main_views if self.inner_shard is None else self.inner_shard.local_views()
        recorded = self._amaxes_version == self._observed_version
        self.fp8.start_refresh(source, amaxes_recorded=recorded)
        return self.fp8

    @property
    def records_step_amaxes(self) -> bool:
        """Whether an optimizer step records the amaxes of the FP8 compute weights: they are
        cast from the main weights (`fp8_gather`, no HFSDP inner shard)."""
        return self.fp8 is not None and self.inner_shard is None

    def step_amax_targets(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(amax slot, main weight part) pairs for the optimizer step about to write the main
        weights to record (`fused_adam.StepAmaxes`), the slots (`fp8.amax_buffer`) zeroed by
        the caller first (`step_amaxes`); none unless `records_step_amaxes`. Follow a step
        that recorded them with `step_amaxes_recorded()`."""
        if not self.records_step_amaxes:
            return []
        self._amaxes_version = None
        return self.fp8.step_amax_targets(self._main_views)

    def step_amaxes_recorded(self) -> None:
        """The step `step_amax_targets` prepared recorded the amaxes of the main weights it
        left: the refresh that follows them takes those (as long as nothing wrote them since)."""
        if self.records_step_amaxes:
            self._amaxes_version = self.main_version()

    @property
    def refreshes_on_device(self) -> bool:
        """Whether `refresh` queues device work (a cast or a gather). False for `Refresh.NONE`
        without FP8 compute weights: under ZeRO-3 (each use gathers from the main weights), or
        where the compute weights share the main weights' storage; it then only records the
        version it follows."""
        return self.fp8 is not None or self.plan.refresh is not Refresh.NONE

    @property
    def refresh_communicates(self) -> bool:
        """Whether `refresh` issues a collective: an all-gather into compute weights that stay
        whole over several ranks (ZeRO-1/2), or HFSDP's inner shard's."""
        if self.fp8 is not None:
            return self.fp8.gathers_at_refresh
        refresh = self.plan.refresh
        gathers = refresh is Refresh.GATHER and self.groups.all_gather.size() > 1
        return gathers or refresh is Refresh.OUTER_GATHER

    def refresh(self) -> None:
        """Makes the compute weights follow the main weights observed last (a cast, or an
        all-gather where the compute weights are replicated and the main weights sharded; under
        ZeRO-3 nothing but HFSDP's inner shard: every `unshard()` gathers from the main weights,
        and compute weights made from older ones must have been freed first). FP8 compute weights
        finish the refresh `start_fp8_refresh` began."""
        self._made_version = self._observed_version
        forget_fp8_weights(self.unsharded_params)
        refresh = self.plan.refresh
        if self.fp8 is not None:
            self.fp8.finish_refresh(self.comm)
        elif refresh is Refresh.OUTER_GATHER:
            self._gather_inner_shard()
        elif refresh is Refresh.GATHER:
            self._gather_into_unsharded()
        elif refresh is Refresh.CAST:
            self.unsharded.data.copy_(self.sharded_main.data)

    def _gather_inner_shard(self) -> None:
        """HFSDP: gathers this replica's inner shard from the outer shards of the main weights."""
        layout = self.outer_layout
        dtype = self.inner_shard.dtype
        gathered = _staging(layout, dtype, self.device)
        self.comm.all_gather(gathered.full, self.sharded_main.data, self.groups.outer)
        inner = _staging(layout.unsharded(), dtype, self.device)
        copy_chunks_out(gathered, inner)
        for dst, src, shape in zip(
            self.inner_shard.local_views(), inner.tensor_views(), layout.shapes
        ):
            dst.copy_(src[: shape[0]])

    def _gather_into_unsharded(self) -> None:
        """All-gathers the sharded weights (HFSDP's inner shard, else the main weights) over
        the all-gather group into the unsharded weights, cast to the compute dtype: each
        tensor's chunks straight into the tensor (with `use_symm_mem` the buffer lies in a
        symmetric window, `place_unsharded`, and NCCL runs its symmetric kernel). The writes
        bump none of the compute weights' version counters (`chunk_targets`; nor does the
        one-launch cast, `SegmentCopy`)."""
        cast = self._own_block_copy
        cast_in_place = cast is not None and cast.try_copy(
            self._gather_source.shard, self.unsharded.data
        )
        self.comm.all_gather_tensors(
            self._gather_outputs,
            self._gather_inputs,
            self.groups.all_gather,
            own_blocks=self._gather_blocks,
            inputs_in_place=cast_in_place,
        )

    def unshard(self) -> None:
        """Makes the compute weights whole (ZeRO-3: all-gathers them; otherwise they are)."""
        if self.fp8 is not None:
            self.fp8.unshard(self.comm)  # the FP8 shards the last refresh made
            return
        if not self.plan.transient_unsharded or self.unsharded.is_allocated:
            return
        self._made_version = self._observed_version
        forget_fp8_weights(self.unsharded_params)
        self.unsharded.reallocate_storage()
        self._gather_into_unsharded()

    def reshard(self) -> None:
        """Frees the whole compute weights (ZeRO-3 only), and their FP8 copies (FP8 compute
        weights: their transposes unless `plan.keeps_fp8_transposes`, and under ZeRO-3 the
        weights)."""
        if self.fp8 is not None:
            self.fp8.reshard()
        elif self.plan.transient_unsharded:
            self.unsharded.free_storage()
            forget_fp8_weights(self.unsharded_params)

    @property
    def holds_unsharded(self) -> bool:
        """Whether the whole compute weights are in memory now."""
        whole = self.unsharded if self.fp8 is None else self.fp8.unsharded
        return whole.is_allocated

    @property
    def gathers(self) -> bool:
        """Whether the whole compute weights are all-gathered over more than one rank: for
        each use (ZeRO-3), or after each change of the main weights (ZeRO-1/2)."""
        plan = self.plan
        gathered = plan.transient_unsharded or plan.refresh is Refresh.GATHER
        return gathered and self.groups.all_gather.size() > 1

    @torch.no_grad()
    def place_unsharded(self, window: torch.Tensor, offset: int) -> None:
        """Moves the unsharded weights into `window` (the bytes of a symmetric window) at byte
        `offset`: the buffer, its views and the compute weights, which stay the same
        `Parameter` objects. Weights that persist keep their values. The window is shared with
        other units' weights, so releasing the buffer only marks it free (`DBuffer` `shared`);
        `symmetric_memory.py` says who may use it when. Before any forward: no autograd graph
        may refer to the old buffer.
        """
        old = self.unsharded
        nbytes = old.data.nbytes
        data = window.narrow(0, offset, nbytes).view(old.dtype)
        self.unsharded = DBuffer(
            old.layout, old.dtype, self.device, sharded=False, rank=0, data=data, shared=True
        )
        if old.is_allocated:
            data.copy_(old.data)
        else:
            self.unsharded.free_storage()
        self._bind_unsharded_views()
        for param, view in zip(self.unsharded_params, self._compute_views):
            param.data = view

    # Registration.

    def register_unsharded(self) -> None:
        """Registers the compute weights on their modules (for forward and backward)."""
        self._unsharded_registration.register()

    def register_sharded(self) -> None:
        """Registers the DTensor main weights on their modules (between forwards)."""
        self._sharded_registration.register()


def _staging(layout: ShardLayout, dtype: torch.dtype, device: torch.device) -> DBuffer:
    """A whole buffer of `layout` for one collective, uninitialised."""
    return DBuffer(layout, dtype, device, sharded=False, rank=0, zeroed=False)


def _chunk(full: torch.Tensor, layout: ShardLayout, index: int, shard: int) -> torch.Tensor:
    """Shard `shard`'s rows of tensor `index` (torch.chunk semantics)."""
    rows = layout.chunk_rows[index]
    return full.narrow(0, min(shard * rows, full.shape[0]), layout.valid_rows(index, shard))


def step_amaxes(weights: Sequence[GroupWeights]) -> StepAmaxes | None:
    """What the optimizer step about to write the main weights of `weights` should record of
    them (`GroupWeights.step_amax_targets`), or None where nothing."""
    recording = [group for group in weights if group.records_step_amaxes]
    if not recording:
        return None
    torch._foreach_zero_([group.fp8.amax_buffer for group in recording])  # one launch for all
    targets = [target for group in recording for target in group.step_amax_targets()]
    if not targets:
        return None
    return StepAmaxes(targets, functools.partial(_step_amaxes_recorded, weights))


def _step_amaxes_recorded(weights: Sequence[GroupWeights]) -> None:
    """`StepAmaxes.recorded` of `step_amaxes(weights)`."""
    for group in weights:
        group.step_amaxes_recorded()
