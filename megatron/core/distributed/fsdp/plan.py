"""`GroupPlan`: what one parameter group keeps and does, decided once from strategy x precision.

Every branch on the sharding strategy and the dtypes is taken here, when the group is built;
the weights (`weights.py`) and gradients (`gradients.py`) of the group then follow the plan
without asking the strategy again.

Two buffers hold weights:

- *unsharded*: the whole compute-dtype weights the module computes with; transient under ZeRO-3
  (all-gathered for each use and freed after), permanent otherwise;
- *sharded main*: what the optimizer steps, in `main_params_dtype`: this rank's shard when main
  weights are sharded, else a replica. Where it would equal the unsharded buffer (same dtype,
  not sharded, not transient) it *is* the unsharded buffer, and nothing is ever refreshed.

HFSDP adds the *inner shard*: this replica's shard of the compute-dtype weights, gathered over
the replicas from the (outer-sharded) main weights once per change, and all-gathered from for
each use.

A group with `fp8_gather` (trainable weights of FP8 linear layers under `fp8_param_gather`)
computes with FP8 weights: its main weights are always a buffer of their own, and its compute
weights are FP8 bytes made from them once per change (`fp8_gather.py`), gathered like the
unsharded buffer would be; the unsharded buffer of the model dtype is never used. `refresh` then
says only whether HFSDP's inner shard is gathered first. With `keeps_fp8_transposes` the
transposed copies that backward makes of them live until the next refresh rather than until the
next reshard.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from megatron.core.distributed.fsdp.distributed_index import ShardGroups
from megatron.core.distributed.fsdp.mixed_precision import ResolvedPrecision
from megatron.core.distributed.fsdp.strategy import ShardingPolicy


class Refresh(enum.Enum):
    """How the compute weights follow a change of the main weights."""

    NONE = "none"
    """They share storage (or are gathered from the main weights for each use: ZeRO-3)."""
    CAST = "cast"
    """A replicated main weight of another dtype: copied (cast) into the unsharded weights."""
    GATHER = "gather"
    """Sharded main weights, replicated compute weights (ZeRO-1/2): all-gathered into them."""
    OUTER_GATHER = "outer_gather"
    """HFSDP: the inner shard is all-gathered over the replicas from the main weights."""


class InnerReduction(enum.Enum):
    """What finalising a step's gradients reduces over the shard group."""

    DONE = "done"
    """Nothing: they were reduce-scattered in each backward (ZeRO-2/3)."""
    REDUCE_SCATTER = "reduce_scatter"
    """ZeRO-1: the local sums are reduce-scattered into this rank's shard."""
    ALL_REDUCE = "all_reduce"
    """Main weights not sharded (`no_shard`, or a shard group of one): the local sums are
    all-reduced."""


class OuterReduction(enum.Enum):
    """What finalising a step's gradients then reduces over the replicas of hybrid sharding."""

    NONE = "none"
    """No outer group."""
    ALL_REDUCE = "all_reduce"
    """HSDP: the shard group's result is all-reduced over the replicas."""
    REDUCE_SCATTER = "reduce_scatter"
    """HFSDP: this replica's gradient shard is reduce-scattered over the replicas."""


@dataclass(frozen=True)
class GroupPlan:
    """The decisions for one group.

    Attributes:
        requires_grad: the parameters train.
        model_dtype: dtype of the compute weights (the dtype the module was built in).
        main_dtype: dtype of the main weights (the model dtype for frozen groups).
        precision: the gradient dtypes.
        num_shards: N, shards of the main weights and of sharded gradients (1: none).
        transient_unsharded: the unsharded weights are gathered for each use and freed after.
        main_is_unsharded: the main weights are the unsharded buffer (no refresh, ever).
        shards_main: the main weights are sharded over the shard group.
        outer_sharded: HFSDP: main weights and optimizer gradients are sharded once more over
            the replicas (trainable groups only).
        refresh: how compute weights follow main weights.
        shards_grads: gradients are reduce-scattered in each backward (else accumulated locally
            and reduced when finalised).
        direct_grads: gradients are sharded over a shard group of one rank, with no dtype to
            change: the reduce-scatter would only copy them (and average them, for expert
            gradients averaged over more ranks), so a backward that starts `main_grad` afresh
            writes them there itself (`SendBuffer.begin_direct`) and averages them in place.
        inner_reduction: what finalising reduces over the shard group.
        outer_reduction: what finalising then reduces over the replicas (HSDP, HFSDP).
        separate_optim_grad: the optimizer reads its gradients from a buffer of its own (another
            dtype than the accumulation, a shard of locally accumulated gradients, or HFSDP's
            outer shard) instead of views of the accumulation buffer.
        placements: the DTensor placements of main weights and their gradients over the
            data-parallel dimensions of `ShardGroups.mesh` (those after its leading dimensions,
            over which each parameter is placed as `LeadingGroups.placements` says).
        fp8_gather: the compute weights are FP8 (module docstring).
        keeps_fp8_transposes: FP8 compute weights keep their transposes across reshards until
            the next refresh (`MixedPrecisionPolicy.keep_fp8_transpose_cache`).
    """

    requires_grad: bool
    model_dtype: torch.dtype
    main_dtype: torch.dtype
    precision: ResolvedPrecision
    num_shards: int
    transient_unsharded: bool
    main_is_unsharded: bool
    shards_main: bool
    outer_sharded: bool
    refresh: Refresh
    shards_grads: bool
    direct_grads: bool
    inner_reduction: InnerReduction
    outer_reduction: OuterReduction
    separate_optim_grad: bool
    placements: tuple[Placement, ...]
    fp8_gather: bool = False
    keeps_fp8_transposes: bool = False

    @property
    def held_itemsize(self) -> int:
        """Bytes per element the whole compute weights hold while gathered: FP8 bytes and,
        from the first backward on, their transposes; else the model dtype's."""
        return 2 if self.fp8_gather else self.model_dtype.itemsize

    @classmethod
    def make(
        cls,
        strategy: ShardingPolicy,
        precision: ResolvedPrecision,
        groups: ShardGroups,
        *,
        model_dtype: torch.dtype,
        requires_grad: bool,
        fp8_gather: bool = False,
        keep_fp8_transposes: bool = False,
    ) -> GroupPlan:
        num_shards = groups.shard_size if strategy.shards_optimizer else 1
        transient = strategy.shards_params
        main_dtype = precision.main_params if requires_grad else model_dtype
        # Frozen main weights follow the compute weights: no optimizer state to shard.
        shards_main = strategy.shards_optimizer and num_shards > 1 if requires_grad else transient
        outer_sharded = requires_grad and strategy.shards_outer
        if fp8_gather and not requires_grad:
            raise ValueError("fp8_gather is for trainable parameter groups only.")
        main_is_unsharded = (
            not outer_sharded
            and main_dtype == model_dtype
            and not shards_main
            and not transient
            and not fp8_gather
        )
        if outer_sharded:
            refresh = Refresh.OUTER_GATHER
        elif transient or main_is_unsharded:
            refresh = Refresh.NONE
        elif shards_main:
            refresh = Refresh.GATHER
        else:
            refresh = Refresh.CAST
        shards_grads = strategy.shards_grads
        direct_grads = (
            shards_grads and num_shards == 1 and precision.grad_comm == precision.main_grads
        )
        if shards_grads:
            inner_reduction = InnerReduction.DONE
        elif num_shards > 1:
            inner_reduction = InnerReduction.REDUCE_SCATTER
        else:
            inner_reduction = InnerReduction.ALL_REDUCE
        if outer_sharded:
            outer_reduction = OuterReduction.REDUCE_SCATTER
        elif groups.outer is not None:
            outer_reduction = OuterReduction.ALL_REDUCE
        else:
            outer_reduction = OuterReduction.NONE
        # ZeRO-1 accumulates whole local gradients and reduce-scatters them once: the
        # optimizer's shard is a buffer of its own, which outlives the accumulation buffer.
        separate = outer_sharded or precision.main_grads != precision.main_params
        separate = separate or inner_reduction is InnerReduction.REDUCE_SCATTER
        if outer_sharded:
            placements: tuple[Placement, ...] = (Shard(0), Shard(0))
        else:
            placements = (Shard(0),) if shards_main else (Replicate(),)
            if groups.outer is not None:
                placements = (*placements, Replicate())
        return cls(
            requires_grad=requires_grad,
            model_dtype=model_dtype,
            main_dtype=main_dtype,
            precision=precision,
            num_shards=num_shards,
            transient_unsharded=transient,
            main_is_unsharded=main_is_unsharded,
            shards_main=shards_main,
            outer_sharded=outer_sharded,
            refresh=refresh,
            shards_grads=shards_grads,
            direct_grads=direct_grads,
            inner_reduction=inner_reduction,
            outer_reduction=outer_reduction,
            separate_optim_grad=requires_grad and separate,
            placements=placements,
            fp8_gather=fp8_gather,
            keeps_fp8_transposes=fp8_gather and keep_fp8_transposes,
        )
