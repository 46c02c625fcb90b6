"""`Fp8ComputeWeights`: a parameter group's compute weights as FP8 bytes (`fp8_param_gather`).

With `MixedPrecisionPolicy(fp8_param_gather=True)` the trainable weights of linear layers that
compute in FP8 (`megatron.core.fp8`) form groups of their own, whose compute weights are E4M3
bytes with one scale per tensor instead of model-dtype values; the stacked weights of MoE experts
(`[num_experts, out, in]`, sharded along the experts) have one scale per expert, as the FP8
experts cast them (`Fp8ExpertWeights`), so each expert is a tensor here:

- *refresh*, once per change of the main weights, in two steps: each rank takes the absolute
  maximum of its part of each tensor (the main shard, HFSDP's inner shard, or the replicated
  main weights: `start_refresh`), and the groups refreshed together round those amaxes to the
  model dtype (the amax of the rounded weights) and all-reduce them with MAX in one collective
  per shard group (`Fp8Refresh`), so every rank holds each whole tensor's amax, and the
  scale `448 / amax`;
  then weights that stay whole (ZeRO-1/2, a shard group of one rank) are cast, the groups of
  one shard group and model dtype in few launches (`Fp8Refresh.cast`; Megatron-FSDP casts
  those of 1, 1, 2, 4, ... units at a time, in the units' order), and all-gathered unit by
  unit (`finish_refresh`). Like every refresh, it is collective: the ranks of a shard group
  refresh the same groups, which they do as long as the main weights change on all of them
  (optimizer steps, loads; an in-place write on some ranks only is `mark_written` on all).
- *unshard* (ZeRO-3): the first after a refresh casts this rank's part into its FP8 shard
  (on the all-gather stream, ahead of the unit's use as its gather is); then the FP8 shards
  are all-gathered into the whole FP8 weights, 1 byte per element where bf16 moves 2;
  *reshard* frees them.
- *use*: the FP8 linear layers ask `fp8_weight_of(weight)`, which this object answers
  (`register_fp8_weight`) with an `Fp8Weight` over the gathered bytes and the tensor's scale,
  made at the first use and kept, as gathers and refreshes rewrite both in place (an
  `Fp8ExpertWeights` with the experts' scales for stacked expert weights, made again after
  each refresh and reshard: it copies its scales).
  Its transposed copy, for the input-gradient GEMM, is made at the first backward that needs
  it (for a Megatron-FSDP unit's group with those of the group's other weights,
  `transpose_all`: the unit's backward needs them all), and lives as long as the whole FP8
  weights: under ZeRO-3, until the reshard after that backward, so each backward's gather
  makes it again. With `keep_transposes` (Megatron-LM's
  `keep_fp8_transpose_cache`) it lives until the next refresh instead, across reshards and
  microbatches: made once per change of the main weights, for 1 byte per element of the whole
  weights held between uses. Weights that stay whole keep theirs until the refresh anyway.

The bytes equal the cast of the whole model-dtype weight that an FP8 linear layer makes
without `fp8_param_gather` (`Fp8Weight.quantized`, `Fp8ExpertWeights.quantized`): the amax of a
tensor is the largest of its parts' amaxes (an expert lies whole in one part: the shards split
the experts), and rounding to the model dtype and the cast are elementwise. So the option
changes what travels and what is held, not the arithmetic. The model-dtype compute weights of
such a group are never allocated: the parameters the modules see during a pass keep their
shapes and dtypes for autograd, over no memory.

The DDP engine's distributed optimizer gathers its FP8 weights with it too, as ZeRO-1/2 does
(`megatron/core/distributed/fp8_param_gather.py`).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import DBuffer, ShardLayout, chunk_targets
from megatron.core.fp8.multi_tensor_cast import MultiTensorCast
from megatron.core.fp8.quantize import compute_scale, quantize, record_amax
from megatron.core.fp8.recipe import fp8_max
from megatron.core.fp8.tensor import Fp8Tensor
from megatron.core.fp8.weights import (
    WEIGHT_DTYPE,
    Fp8ExpertWeights,
    Fp8Weight,
    register_fp8_weight,
)
from megatron.core.utils import cuda_graph_capturing


class Fp8ComputeWeights:
    """The FP8 compute weights of one parameter group (module docstring).

    Args:
        layout: the group's layout over its shard group.
        rank: this rank's shard.
        params: the group's compute-weight parameters (what the modules compute with).
        fqns: their names, for messages.
        model_dtype: the dtype the weights are rounded to before the cast.
        transient: the compute weights are gathered for each use and freed after (ZeRO-3).
        amax_group: the shard group, over which each tensor's parts lie (None: not sharded).
        gather_group: the group the FP8 shards are all-gathered over.
        device: where the buffers live.
        keep_transposes: a reshard keeps the transposes made since the last refresh (module
            docstring); the next refresh frees them.
        transpose_together: the weights are one unit's, whose backward needs each one's
            transpose: the first need makes them all, in one call (`transpose_all`).
    """

    def __init__(
        self,
        layout: ShardLayout,
        rank: int,
        params: Sequence[torch.nn.Parameter],
        fqns: Sequence[str],
        *,
        model_dtype: torch.dtype,
        transient: bool,
        amax_group: dist.ProcessGroup | None,
        gather_group: dist.ProcessGroup,
        device: torch.device,
        keep_transposes: bool = False,
        transpose_together: bool = False,
    ):
        self._layout = layout
        self._rank = rank
        self._fqns = list(fqns)
        self._model_dtype = model_dtype
        self._device = device
        # Unsharded, the whole FP8 weights are the shard itself: nothing to gather or free.
        self._transient = transient and layout.num_shards > 1
        self._keep_transposes = keep_transposes
        self.amax_group = amax_group
        self._gather_group = gather_group
        # FP8 lives in uint8 buffers: collectives move bytes, whatever the backend's dtypes.
        self.unsharded = DBuffer(
            layout.unsharded(),
            torch.uint8,
            device,
            sharded=False,
            rank=0,
            zeroed=not self._transient,
        )
        whole = [
            view[: shape[0]] for view, shape in zip(self.unsharded.tensor_views(), layout.shapes)
        ]
        self._weights = [view.view(WEIGHT_DTYPE) for view in whole]
        self._shard: DBuffer | None = None
        if layout.num_shards > 1:
            self._shard = DBuffer(layout, torch.uint8, device, sharded=True, rank=rank)
            targets = chunk_targets(self.unsharded, layout)
            self._gather_outputs = [target.view(-1) for target in targets]
            self._gather_blocks = [target[gather_group.rank()] for target in targets]
            self._gather_inputs = list(self._shard.data.split(layout.chunk_numels))
            casts = self._shard.local_views()
        else:
            casts = whole
        self._cast_targets = [view.view(WEIGHT_DTYPE) for view in casts]
        # Each tensor's scales: one, or one per expert of stacked expert weights (3-D), each
        # expert's rows of this rank's part starting at its chunk of the experts.
        self._stacked = [len(shape) == 3 for shape in layout.shapes]
        self._first_scale = [0, *itertools.accumulate(self._scale_counts())][:-1]
        self._part_start = [rank * rows for rows in layout.chunk_rows]
        scales = sum(self._scale_counts())
        # One 16-byte row per scale: cuBLASLt refuses scale pointers that are not 16-byte
        # aligned (CUBLAS_STATUS_NOT_SUPPORTED).
        self._scale_inv_rows = torch.ones(scales, 4, dtype=torch.float32, device=device)
        self._scale_invs = [row[:1] for row in self._scale_inv_rows]
        self._scale_inv_column = self._scale_inv_rows[:, 0]
        # Where each tensor's amax (each expert's, of stacked expert weights) is recorded at a
        # refresh: views made once, not at every refresh.
        self._amax_buffer = torch.zeros(scales, dtype=torch.float32, device=device)
        self._amax_slots = [
            self._amax_buffer[units.start : units.stop]
            for units in map(self._scale_range, range(len(layout)))
        ]
        # `step_amax_targets`' pairs, with the sources they pair (made once, not every step).
        self._step_targets: tuple[Sequence[torch.Tensor], list] | None = None
        self._index = {id(param): i for i, param in enumerate(params)}
        self._matrices = [i for i, stacked in enumerate(self._stacked) if not stacked]
        # Weakly: the copies live in `_made`, which a reference back to self would make a cycle
        # (the group and its buffers then freed by the garbage collector only).
        self._transposes_with = (
            functools.partial(_transpose_all_of, weakref.ref(self)) if transpose_together else None
        )
        self._made: list[Fp8Weight | Fp8ExpertWeights | None] = [None] * len(layout)
        # Between a refresh and the cast (which ZeRO-3 leaves to the next gather): the parts to
        # cast, their amaxes until reduced, and the scales to cast them with (the group's slice
        # of the scales `Fp8Refresh` computed).
        self._sources: list[torch.Tensor] | None = None
        self.amaxes: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None
        # The casts in one launch where this group casts on its own (at its gather, or at a
        # refresh that cannot cast it with others: `Fp8Refresh`), made at the first cast and
        # again where the buffers moved (None: none made, the casts go piece by piece).
        self._multi_cast: MultiTensorCast | None = None
        if self._transient:
            self.unsharded.free_storage()
        for param in params:
            register_fp8_weight(param, self.weight_of)

    def __len__(self) -> int:
        return len(self._layout)

    @property
    def scale_count(self) -> int:
        """The scales (and amaxes) of the group: one per tensor, one per expert of stacked
        expert weights."""
        return len(self._scale_invs)

    def _scale_counts(self) -> list[int]:
        """How many scales each tensor has: one per expert of stacked expert weights."""
        return [
            shape[0] if stacked else 1 for shape, stacked in zip(self._layout.shapes, self._stacked)
        ]

    def _scale_range(self, index: int) -> range:
        """The scales of tensor `index`'s rows in this rank's part (its experts, or its one)."""
        first = self._first_scale[index]
        if not self._stacked[index]:
            return range(first, first + 1)
        start = first + self._part_start[index]
        return range(start, start + self._layout.valid_rows(index, self._rank))

    def _scaled_parts(self, index: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        """`tensor` (this rank's part of tensor `index`, or its FP8 target) as the pieces that
        have a scale of their own: each expert's `[out, in]`, or the whole part."""
        return list(tensor) if self._stacked[index] else [tensor]

    # Use.

    def weight_of(self, param: torch.nn.Parameter) -> Fp8Weight | Fp8ExpertWeights:
        """The FP8 weight of `param` (one of the group's compute weights), over the gathered
        bytes (module docstring: made at the first use; for stacked expert weights once per
        gather, ZeRO-3 unless `keep_transposes`, or refresh).

        Raises:
            RuntimeError: the whole FP8 weights are not gathered (the weight is used outside
                its unit's forward and backward).
        """
        index = self._index[id(param)]
        # Before the copy: one kept across a reshard (`keep_transposes`) views freed bytes.
        if not self.unsharded.is_allocated:
            raise RuntimeError(
                f"The FP8 weight {self._fqns[index]} is used while Megatron-FSDP holds only its "
                "shard (fp8_param_gather): call its unit (or FSDPModule.unshard()) to compute "
                "with it."
            )
        made = self._made[index]
        return made if made is not None else self._make(index)

    def _make(self, index: int) -> Fp8Weight | Fp8ExpertWeights:
        data = self._weights[index]
        first = self._first_scale[index]
        if self._stacked[index]:
            made = Fp8ExpertWeights(data, self._scale_inv_column[first : first + len(data)])
        else:
            made = Fp8Weight(Fp8Tensor(data, self._scale_invs[first]), self._transposes_with)
        self._made[index] = made
        return made

    def transpose_all(self, asking: Fp8Weight) -> None:
        """Makes the transposes of the group's weights (but stacked expert weights, which
        transpose their own) at once (`Fp8Weight.transpose_all`), at the first need of any
        (`asking`'s): the backward that needs one needs each, for its unit's linear layers'
        input gradients (a layer whose input needs no gradient has its transpose made too).
        Nothing while the whole weights are not held (`weight_of` refuses a use then)."""
        if not self.unsharded.is_allocated:
            return
        made = [self._made[i] for i in self._matrices]
        Fp8Weight.transpose_all(
            [w if w is not None else self._make(i) for w, i in zip(made, self._matrices)]
        )

    # Refresh.

    def step_amax_targets(
        self, sources: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Pairs each tensor's part of `sources` (this rank's parts, as `start_refresh` takes
        them) with its amax slots, the pairs made once per `sources`: an optimizer step that
        records them (`fused_adam.StepAmaxes`, the slots zeroed first: `amax_buffer`) spares the
        refresh after it a pass over the weights (`start_refresh(..., amaxes_recorded=True)`)."""
        if self._step_targets is None or self._step_targets[0] is not sources:
            self._step_targets = (sources, list(self._amax_targets(sources)))
        return self._step_targets[1]

    @property
    def amax_buffer(self) -> torch.Tensor:
        """Every amax slot of the group, `[scale_count]` fp32."""
        return self._amax_buffer

    def _amax_targets(
        self, sources: Sequence[torch.Tensor]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(amax slots, part of `sources`) for each tensor this rank holds any of: one slot, or
        for stacked expert weights one per expert of the part (`record_amax` records each
        expert's into its own in one pass)."""
        for i, (source, slots) in enumerate(zip(sources, self._amax_slots)):
            part = source[: len(slots)] if self._stacked[i] else source
            if part.numel() > 0:
                yield slots, part

    def start_refresh(self, sources: Sequence[torch.Tensor], amaxes_recorded: bool = False) -> None:
        """First step of a refresh: this rank's amax of each tensor's part `sources[i]` (in the
        main dtype, or the model dtype), of each expert's for stacked expert weights, for
        `Fp8Refresh` (0 where this rank holds none of it); `amaxes_recorded`: the optimizer
        step that wrote `sources` recorded them (`step_amax_targets`)."""
        self._forget()
        self._sources = list(sources)
        if not amaxes_recorded:
            self._amax_buffer.zero_()
            for slot, part in self._amax_targets(self._sources):
                record_amax(part, slot)
        # The buffer itself, as the main weights hold them: `Fp8Refresh`, which follows before
        # anything writes the buffer again (the next optimizer step or refresh), copies them out
        # rounded to the model dtype, for all groups at once.
        self.amaxes = self._amax_buffer

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the weights are rounded to before the cast (and their amaxes)."""
        return self._model_dtype

    @property
    def scale_inverses(self) -> torch.Tensor:
        """The inverses of the scales, `[scale_count]` fp32, which the GEMMs read: written in
        place (`Fp8Refresh`), as GEMMs captured in a CUDA graph read them at every replay."""
        return self._scale_inv_column

    def set_scales(self, scales: torch.Tensor) -> None:
        """The scales `Fp8Refresh` computed from the whole tensors' amaxes, `[scale_count]`
        fp32 (it writes their inverses into `scale_inverses`)."""
        self._scales = scales
        self.amaxes = None

    @property
    def gathers_at_refresh(self) -> bool:
        """Whether `finish_refresh` all-gathers the weights (they stay whole, sharded over
        several ranks: a collective)."""
        return not self._transient and self._shard is not None

    @property
    def casts_at_refresh(self) -> bool:
        """Whether a refresh casts the weights (they stay whole), rather than the next gather
        (ZeRO-3 over several ranks)."""
        return not self._transient

    def finish_refresh(self, comm: Collectives) -> None:
        """Last step of a refresh: casts and gathers the weights that stay whole now (the cast
        already made where `Fp8Refresh` made it with other groups'); those gathered for each
        use are cast at their next gather (so that a ZeRO-3 unit's cast overlaps the compute of
        the units before it, as its gather does)."""
        if not self._transient:
            if self._sources is not None:
                self.cast()
            self._gather(comm)

    def take_casts(
        self, first_scale: int = 0
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """The casts the refresh left, handed to the caller, which makes them with the scales
        it set (`set_scales`): this rank's parts that have a scale of their own, their FP8
        targets, and each part's scale index, counted from `first_scale` (where the group's
        scales start in a tensor of several groups' scales). None where already cast."""
        parts, outs, scale_indices = [], [], []
        for i, (source, target) in enumerate(zip(self._sources or (), self._cast_targets)):
            pieces = zip(self._scaled_parts(i, source), self._scaled_parts(i, target))
            for index, (part, out) in zip(self._scale_range(i), pieces):
                if part.numel() > 0:
                    parts.append(part)
                    outs.append(out)
                    scale_indices.append(first_scale + index)
        self._sources = self._scales = None
        return parts, outs, scale_indices

    def cast(self) -> None:
        """Casts this rank's parts into the FP8 shard, with the scales the refresh set, in this
        group's own launch (at its gather, or where `Fp8Refresh` cannot cast it with others)."""
        scales = self._scales
        parts, outs, scale_indices = self.take_casts()
        launch = _cast_parts(self._multi_cast, parts, outs, scale_indices, scales, self.model_dtype)
        if launch is not None:
            self._multi_cast = launch

    # Unshard, reshard.

    def unshard(self, comm: Collectives) -> None:
        """All-gathers the whole FP8 weights (ZeRO-3), if not held, casting the shard first
        after a refresh; weights that stay whole are held already."""
        if self._sources is not None:
            self.cast()
        if self.unsharded.is_allocated:
            return
        self.unsharded.reallocate_storage()
        self._gather(comm)

    def reshard(self) -> None:
        """Frees the whole FP8 weights (ZeRO-3 over several ranks) and their transposes, unless
        `keep_transposes`: then the copies stay, over the bytes the next gather writes again
        (the same values until a refresh), and keep their transposes."""
        if self._transient:
            self.unsharded.free_storage()
        if not self._keep_transposes:
            self._forget()

    def _gather(self, comm: Collectives) -> None:
        if self._shard is not None:
            comm.all_gather_tensors(
                self._gather_outputs,
                self._gather_inputs,
                self._gather_group,
                own_blocks=self._gather_blocks,
            )

    def _forget(self) -> None:
        """Drops the transposes (their bytes are stale or freed) and the expert weights' copies
        (which copy their scales); a tensor's `Fp8Weight` stays, over the same bytes and the
        scales written in place, so that a gather makes no objects."""
        for index, made in enumerate(self._made):
            if isinstance(made, Fp8Weight):
                made.drop_transpose()
            elif made is not None:
                self._made[index] = None


class Fp8Refresh:
    """The middle step of the refreshes `Fp8ComputeWeights.start_refresh` began, for one
    engine (which keeps it across steps, for its launches):

    - `scale`: one MAX all-reduce of the amaxes of all the groups that share a shard group,
      then each group's scales;
    - `cast`: the casts of the groups that a refresh casts (weights that stay whole: ZeRO-1/2,
      a shard group of one rank, the DDP engine's distributed optimizer), in one launch per
      shard group and model dtype where `MultiTensorCast` runs: a 1.34B GPT's 24 layers are 24
      groups, each cast a launch and the host's bookkeeping of it. Groups gathered for each use
      (ZeRO-3 over several ranks) are cast at their gathers, as they overlap compute there.

    Calling it does both for all the groups. Megatron-FSDP casts the scaled groups in a few
    launches instead, in the units' order, each queued ahead of its first unit's use, so that
    the first unit computes once its own weights are cast (`residency.py`).
    Every rank of a shard group must pass the same groups' weights in the same order (the
    units' order), as for any collective.
    """

    def __init__(self) -> None:
        # Per shard group, model dtype, and the groups cast together with where their scales
        # begin (the casts' scale indices): their casts' launch, or None where no launch takes
        # them (each group then casts on its own). A launch stays until another replaces it for
        # the same groups and scales (their memory moved): a CUDA graph may have captured it.
        self._launches: dict[tuple, MultiTensorCast | None] = {}
        # Between `scale` and `cast`: each scaled group's shard group, the scales of all the
        # groups scaled with it, and where its own begin in them. A group scaled again before
        # its cast (a refresh that stopped early, a unit unused in a pass) takes the new entry;
        # weakly keyed, an entry goes with the group's weights.
        self._scaled: weakref.WeakKeyDictionary[
            Fp8ComputeWeights, tuple[dist.ProcessGroup | None, torch.Tensor, int]
        ] = weakref.WeakKeyDictionary()

    def __call__(self, pending: Sequence[Fp8ComputeWeights], comm: Collectives) -> None:
        self.scale(pending, comm)
        self.cast(pending)

    def scale(self, pending: Sequence[Fp8ComputeWeights], comm: Collectives) -> None:
        """Sets the scales of `pending` from their amaxes, reduced over each shard group in one
        collective; hand each of them to `cast` once after (several refreshes may wait for
        their casts at once, as Megatron-FSDP's units do for their first use)."""
        by_group: dict[dist.ProcessGroup | None, list[Fp8ComputeWeights]] = {}
        for weights in pending:
            by_group.setdefault(weights.amax_group, []).append(weights)
        for group, members in by_group.items():
            amaxes = _rounded_amaxes(members)
            if group is not None:
                comm.all_reduce_max(amaxes, group)
            # The scales of all of them at once: each op is a launch.
            scales = compute_scale(amaxes, fp8_max(WEIGHT_DTYPE))
            counts = [weights.scale_count for weights in members]
            for weights, part in zip(members, scales.split(counts)):
                weights.set_scales(part)
            torch._foreach_copy_(
                [weights.scale_inverses for weights in members],
                list(scales.reciprocal().split(counts)),
            )
            for weights, first in zip(members, itertools.accumulate([0, *counts])):
                self._scaled[weights] = (group, scales, first)

    def cast(self, members: Sequence[Fp8ComputeWeights]) -> None:
        """Casts those of `members` (scaled by `scale`) that a refresh casts, in one launch per
        shard group, model dtype and `scale` call; the others cast at their gathers, and those
        whose scales another `cast` took since (a later refresh of their unit's) are skipped."""
        by_launch: dict[tuple, tuple[torch.Tensor, list[tuple[Fp8ComputeWeights, int]]]] = {}
        for weights in members:
            scaled = self._scaled.pop(weights, None)
            if scaled is None:
                continue
            group, scales, first = scaled
            if weights.casts_at_refresh:
                # Scale offsets index the scales of their own `scale` call.
                key = (group, weights.model_dtype, id(scales))
                by_launch.setdefault(key, (scales, []))[1].append((weights, first))
        for (group, dtype, _), (scales, casting) in by_launch.items():
            key = (group, dtype, tuple((id(weights), first) for weights, first in casting))
            if key in self._launches and self._launches[key] is None:
                for weights, _ in casting:
                    weights.cast()
                continue
            parts, outs, scale_indices = [], [], []
            for weights, first in casting:
                for pieces, taken in zip((parts, outs, scale_indices), weights.take_casts(first)):
                    pieces.extend(taken)
            launch = _cast_parts(self._launches.get(key), parts, outs, scale_indices, scales, dtype)
            if launch is not None:
                self._launches[key] = launch
            elif not cuda_graph_capturing():  # a capture makes no launch: not a verdict
                self._launches.setdefault(key, None)


def _cast_parts(
    launch: MultiTensorCast | None,
    parts: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    scale_indices: Sequence[int],
    scales: torch.Tensor,
    rounding: torch.dtype,
) -> MultiTensorCast | None:
    """Casts each of `parts` into its E4M3 `outs` with `scales[scale_indices[i]]`, rounded to
    `rounding` first: by `launch` where it casts these, else by one made now, and returns the
    launch that ran; else (no launch takes them, or a CUDA graph is being captured) piece by
    piece, the same bytes, and returns None."""
    if launch is None or not launch.casts(parts, outs, scale_indices):
        launch = MultiTensorCast.make(parts, outs, scale_indices, rounding)
    if launch is None:
        split = scales.split(1)
        for part, out, index in zip(parts, outs, scale_indices):
            quantize(part, WEIGHT_DTYPE, scale=split[index], rounding=rounding, out=out)
        return None
    launch(scales)
    return launch


def _transpose_all_of(owner: weakref.ref[Fp8ComputeWeights], asking: Fp8Weight) -> None:
    """`owner.transpose_all(asking)` while the owner lives (else `asking` makes its own)."""
    weights = owner()
    if weights is not None:
        weights.transpose_all(asking)


def _rounded_amaxes(members: Sequence[Fp8ComputeWeights]) -> torch.Tensor:
    """The amaxes of `members`, one tensor (a new one), each rounded to its model dtype: the
    amax of the rounded weights, as rounding is monotonic (and the max of rounded amaxes the
    rounded max). One rounding for all where they share a dtype."""
    dtypes = {weights.model_dtype for weights in members}
    if len(dtypes) == 1:
        return _rounded(torch.cat([weights.amaxes for weights in members]), dtypes.pop())
    return torch.cat([_rounded(weights.amaxes, weights.model_dtype) for weights in members])


def _rounded(amaxes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return amaxes if dtype == torch.float32 else amaxes.to(dtype).float()
