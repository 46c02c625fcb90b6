"""How the data-parallel engines see parameters split by tensor parallelism (TP).

A module parameter under TP holds this rank's part of a *global* (TP = 1) tensor, as its module
declares with a `TensorParallelLayout` (`named_tensor_parallel_layouts`): split along one dim
over the tensor-parallel group (`Shard(dim)`), in `stride` blocks each split separately
(`_StridedShard(dim, split_factor=stride)`), or replicated. The engines shard and replicate
that TP-local tensor over the data-parallel groups, which exclude the TP peers, as they would a
whole parameter; everything they show outside (main weights, gradients, optimizer states,
checkpoints) is the global tensor, a DTensor over a mesh whose first dimension is `tp` (placed
as the layout says), then the data-parallel dimensions. So a checkpoint holds global tensors
and loads at any TP size, and the gradient norm all-reduces partial sums over `tp` only for
TP-split parameters (replicated ones are counted once).

The engines shard along dim 0. A strided parameter split along dim 0 whose data-parallel chunk
spans two of its blocks has no DTensor description (torch rejects it in `full_tensor()` and
checkpoint planning): `check_data_parallel_chunks` refuses it when the model is wrapped.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layout import (
    TensorParallelLayout,
    copy_from_shard,
    shard_tensor,
    strided_to_shard,
)


def tensor_parallel_group(
    pg_collection: ProcessGroupCollection | None,
) -> dist.ProcessGroup | None:
    """`pg_collection.tp`, else parallel_state's tp group when initialised; None when there is
    no group of two or more ranks (TP = 1)."""
    if pg_collection is None:
        if not parallel_state.model_parallel_is_initialized():
            return None
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    group = pg_collection.tp
    return group if group is not None and group.size() > 1 else None


def is_split(layout: TensorParallelLayout | None) -> bool:
    """Whether `layout` splits its parameter over tp (rather than replicating it)."""
    return layout is not None and layout.partition_dim is not None


def global_shape(
    local_shape: torch.Size, layout: TensorParallelLayout | None, tp: dist.ProcessGroup | None
) -> torch.Size:
    """The global shape of a module parameter of `local_shape` split as `layout` says."""
    if tp is None or not is_split(layout):
        return torch.Size(local_shape)
    shape = list(local_shape)
    shape[layout.partition_dim] *= tp.size()
    return torch.Size(shape)


def local_part(
    full: torch.Tensor, layout: TensorParallelLayout | None, tp: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's part of the global tensor `full` (the module parameter's value)."""
    if tp is None:
        return full
    return shard_tensor(full, layout, tp.rank(), tp.size())


def check_excludes_tp_peers(tp: dist.ProcessGroup | None, dp: dist.ProcessGroup) -> None:
    """Refuses a data-parallel group `dp` that holds tensor-parallel peers of this rank.

    Raises:
        ValueError: `tp` and `dp` share ranks other than this one.
    """
    if tp is None:
        return
    shared = set(dist.get_process_group_ranks(tp)) & set(dist.get_process_group_ranks(dp))
    if len(shared) > 1:
        raise ValueError(
            f"The tensor-parallel group {dist.get_process_group_ranks(tp)} shares ranks "
            f"{sorted(shared)} with the data-parallel group {dist.get_process_group_ranks(dp)}"
            ": the data-parallel groups must exclude the tensor-parallel peers "
            "(parallel_state.initialize_model_parallel(tensor_model_parallel_size=...) builds "
            "them so)."
        )


def check_data_parallel_chunks(
    name: str,
    local_shape: torch.Size,
    layout: TensorParallelLayout | None,
    chunk_counts: list[int],
) -> None:
    """Refuses a strided dim-0 layout whose data-parallel chunks span two of its blocks.

    Args:
        name: the parameter's name (for the message).
        local_shape: the module parameter's (TP-local) shape.
        layout: its tensor-parallel layout.
        chunk_counts: how many dim-0 chunks each data-parallel sharding level cuts it into, in
            mesh order (`torch.chunk` of the previous level's chunk).

    Raises:
        ValueError: a chunk spans a block boundary.
    """
    if layout is None or layout.partition_dim != 0 or layout.partition_stride == 1:
        return
    rows = local_shape[0]
    block = rows // layout.partition_stride
    ranges = [(0, rows)]
    for count in chunk_counts:
        ranges = [piece for start, end in ranges for piece in _chunks(start, end, count)]
    for start, end in ranges:
        # A rank holding every row holds every block whole: no chunk to describe.
        if (start, end) != (0, rows) and start // block != (end - 1) // block:
            raise ValueError(
                f"Parameter {name!r} (tensor-parallel shape {tuple(local_shape)}) holds "
                f"{layout.partition_stride} blocks of {block} rows, each split over tensor "
                f"parallelism; sharding it over {' x '.join(map(str, chunk_counts))} data-"
                f"parallel ranks gives a chunk of rows {start}..{end - 1}, which spans two "
                "blocks and has no DTensor placement. Choose a data-parallel size whose chunk "
                f"of the {rows} rows (ceil({rows} / size)) divides {block}, or a sharding "
                "that keeps this parameter whole (no_shard, or the DDP engine without the "
                "distributed optimizer)."
            )


def _chunks(start: int, end: int, count: int) -> list[tuple[int, int]]:
    """The non-empty [start, end) row ranges `torch.chunk` cuts [start, end) into."""
    size = math.ceil((end - start) / count)
    if size == 0:
        return []
    return [(s, min(s + size, end)) for s in range(start, end, size)]


def dtensor(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: torch.Size
) -> DTensor:
    """`local` as the DTensor of global `shape` over `mesh` (no communication, no check).

    Differentiable where autograd records (`local` requires grad, grad mode on); otherwise
    made directly, as FSDP2 makes its sharded parameters: `DTensor.from_local`'s autograd
    function costs about three times the construction itself, once per parameter and view
    when an engine wraps a model.
    """
    stride = _contiguous_strides(shape)
    if local.requires_grad and torch.is_grad_enabled():
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, local.dtype))
    # A view, as `from_local` makes: the DTensor's local tensor is not `local` itself.
    return DTensor(local.view_as(local), spec, requires_grad=False)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# Checkpoints. torch.distributed.checkpoint describes a rank's part of a DTensor as one box
# (offset, shape); a `_StridedShard` part spans several boxes whenever it holds rows of two or
# more blocks, and is then saved at the wrong place. Such DTensors are checkpointed as their
# `Shard` redistribution (contiguous parts; the same global tensor) and loaded back through it.


def stride_free_for_checkpoint(
    tree: dict | list, *, values: bool = True
) -> list[tuple[dict | list, str | int, DTensor]]:
    """Replaces, in place in the nested dicts and lists `tree`, every DTensor placed
    `_StridedShard` with its redistribution to `Shard` (a copy) for checkpointing.

    Args:
        tree: The state dict.
        values: Copy the values (saving); False leaves the replacements uninitialised, with no
            communication (loading, which overwrites them).

    Returns:
        (container, key, original DTensor) of each replacement, for `restore_after_load`.
    """
    swaps = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in list(items):
        if isinstance(value, (dict, list)):
            swaps.extend(stride_free_for_checkpoint(value, values=values))
        elif isinstance(value, DTensor):
            with torch.no_grad():
                converted = strided_to_shard(value, values=values)
            if converted is not value:
                tree[key] = converted
                swaps.append((tree, key, value))
    return swaps


@torch.no_grad()
def restore_after_load(swaps: list[tuple[dict | list, str | int, DTensor]]) -> None:
    """Copies what a checkpoint load wrote into the replacements of
    `stride_free_for_checkpoint` back into the original DTensors, and puts those back."""
    for container, key, original in swaps:
        copy_from_shard(original, container[key])
        container[key] = original
