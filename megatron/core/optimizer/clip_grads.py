"""The global gradient norm, gradient clipping and zero counting, for both data-parallel engines
(`get_grad_norm_fp32` also takes the parameters' norm, which sums the same way).

A gradient enters as the tensor the optimizer steps with:

- DDP engine: `param.main_grad`, a plain tensor, all-reduced, so identical on every rank;
- Megatron-FSDP: `param.grad` of a DTensor main weight; its placements say what this rank holds.
  `Shard` over a mesh dimension: this rank holds one piece (ZeRO-1/2/3 over the shard group,
  HFSDP over the outer group too); `Replicate`: every rank of that dimension holds the same
  values (`no_shard`, and the outer group of HSDP).

Each element must be counted once, so a rank sums its local squares, and that partial sum is
all-reduced over the groups of the `Shard` dimensions only (never over `Replicate` ones, which
would count replicas again). Gradients are bucketed by that tuple of groups, and each bucket's
one fp32 scalar is all-reduced over each of its groups: typically one all-reduce over the dense
shard group, plus one over the expert shard group when a model has experts, plus one over the
outer group under HFSDP. Plain tensors count as replicated: no collective at all.

Experts split by expert parallelism differ across the ep group: both engines hand their
gradients over as global DTensors whose mesh starts with an ep dimension placed `Shard(0)`
(`expert_parallel.py`), so their partial sums are all-reduced over ep (each expert once) and
over the expert shard group, never over expert data-parallel replicas. Tensor parallelism
likewise: parameters split over tp are global DTensors with a `tp` mesh dimension placed
`Shard` (or `_StridedShard`, a shard too: each element on one rank) and are summed over it;
replicated ones are placed `Replicate` there and counted once.

The `*_on_device` variants compute the same values as device tensors, with no host
synchronisation, for a step a CUDA graph captures (`MegatronOptimizer.step_on_device`).

The optimizer's step clips through `clip_scale` / `clip_scale_on_device`: the coefficient goes
to the fused step, which multiplies each gradient as it reads it (`fused_adam.GradScale`), and
the gradients are scaled in place only where that kernel does not run.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from megatron.core.fusions.fused_adam import GradScale

# The groups a gradient's local sum is all-reduced over: () for replicated gradients.
GroupKey = tuple[dist.ProcessGroup, ...]


def _local_and_groups(grad: torch.Tensor) -> tuple[torch.Tensor, GroupKey]:
    """This rank's part of `grad` and the groups whose ranks hold the other parts.

    Raises:
        ValueError: `grad` is a DTensor with a `Partial` placement (not reduced yet).
    """
    if not isinstance(grad, DTensor):
        return grad, ()
    return grad.to_local(), _shard_groups(grad.device_mesh, grad.placements)


_GROUPS_OF_MESH: dict[int, dict[tuple[Placement, ...], GroupKey]] = {}
"""id(mesh) -> placements -> `_shard_groups`, while the mesh lives. Keyed by identity: equal
meshes of a later process-group world (`DeviceMesh.__eq__` compares ranks, not groups) hold
other groups."""


def _shard_groups(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> GroupKey:
    """The groups of `mesh`'s dimensions that `placements` shard over (of more than one rank).
    Cached per mesh: a model's gradients share a few layouts, and looking up a dimension's
    group for each of hundreds of gradients at every step costs the host milliseconds."""
    key = id(mesh)
    cache = _GROUPS_OF_MESH.get(key)
    if cache is None:
        cache = _GROUPS_OF_MESH[key] = {}
        # Dropped when the mesh dies, before its id can be reused.
        weakref.finalize(mesh, _GROUPS_OF_MESH.pop, key, None)
    groups = cache.get(placements)
    if groups is None:
        groups = cache[placements] = _groups_of(mesh, placements)
    return groups


def _groups_of(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> GroupKey:
    groups = []
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise ValueError(
                f"A gradient DTensor has placements {placements}: a Partial gradient is not "
                "reduced yet. Finish the gradient reduction (model.finish_grad_sync()) before "
                "computing its norm."
            )
        # Newer torch does not count a strided shard as `is_shard()`.
        if placement.is_shard() or isinstance(placement, _StridedShard):
            group = mesh.get_group(dim)
            if group.size() > 1:
                groups.append(group)
    return tuple(groups)


def _global_sum(
    grads: Iterable[torch.Tensor],
    local_sum: Callable[[list[torch.Tensor]], torch.Tensor],
    pp_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """Sum over ranks of `local_sum` of each group's local tensors, each element counted once,
    then over the pipeline stages (`pp_group`: each stage holds other parameters).

    Returns None when there are no gradients (with stages: a zero of `dtype` on `device`).
    Every rank of a stage must pass gradients of the same parameters in the same order, so
    that all issue the same all-reduces in the same order.
    """
    total = _stage_sum(grads, local_sum)
    if pp_group is None or pp_group.size() == 1:
        return total
    if total is None:  # every stage joins the reduction, one without gradients too
        total = torch.zeros((), dtype=dtype, device=device)
    dist.all_reduce(total, group=pp_group)
    return total


def _stage_sum(
    grads: Iterable[torch.Tensor], local_sum: Callable[[list[torch.Tensor]], torch.Tensor]
) -> torch.Tensor | None:
    buckets: dict[GroupKey, list[torch.Tensor]] = {}
    for grad in grads:
        local, groups = _local_and_groups(grad)
        buckets.setdefault(groups, []).append(local)
    total = None
    for groups, tensors in buckets.items():
        partial = local_sum(tensors)
        for group in groups:
            dist.all_reduce(partial, group=group)
        total = partial if total is None else total + partial
    return total


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    # Per-tensor fp32 norms in one foreach kernel; squaring them sums like the elements do.
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def _num_zeros(tensors: list[torch.Tensor]) -> torch.Tensor:
    # int64: an fp32 count stops being exact above 2**24 elements.
    return sum(t.numel() - torch.count_nonzero(t) for t in tensors)


_CLIP_EPS = 1.0e-6
"""Megatron-LM's epsilon: the clipped norm is max_norm * total / (total + 1e-6)."""


@torch.no_grad()
def get_grad_norm_fp32(
    grads: Iterable[torch.Tensor], pp_group: dist.ProcessGroup | None = None
) -> float:
    """The L2 norm of all gradients together, computed in fp32, the same on every rank.

    Args:
        grads: each parameter's gradient once: plain tensors (replicated, e.g. the DDP
            engine's `main_grad`) or DTensors (Megatron-FSDP's sharded gradients).
        pp_group: the pipeline group, whose stages hold the other parameters (None: one
            stage). A parameter held by two stages (tied embeddings) is passed by one only.

    Returns:
        The global norm; inf or nan when any gradient element is (on any rank).

    Raises:
        ValueError: a gradient is a DTensor with a `Partial` placement.
    """
    return grad_norm_on_device(grads, torch.device("cpu"), pp_group).item()


@torch.no_grad()
def clip_grad_by_total_norm_fp32(
    grads: Iterable[torch.Tensor], max_norm: float, total_norm: float
) -> None:
    """Scales `grads` in place so that their global norm becomes at most `max_norm`.

    Args:
        grads: the gradients `total_norm` was computed over.
        max_norm: the largest norm allowed.
        total_norm: their global norm, from `get_grad_norm_fp32`.
    """
    scale = clip_scale(grads, max_norm, total_norm)
    if scale is not None:
        scale.scale_in_place()


def clip_scale(
    grads: Iterable[torch.Tensor], max_norm: float, total_norm: float
) -> GradScale | None:
    """`clip_grad_by_total_norm_fp32` as the factor a step multiplies the gradients by
    (`step_and_copy`'s `grad_scale`); None where clipping leaves them as they are."""
    clip_coeff = max_norm / (total_norm + _CLIP_EPS)
    if clip_coeff >= 1.0:
        return None
    return GradScale(clip_coeff, functools.partial(_scale, list(grads), clip_coeff))


def _scale(grads: list[torch.Tensor], clip_coeff: float) -> None:
    torch._foreach_mul_([_local_and_groups(grad)[0] for grad in grads], clip_coeff)


@torch.no_grad()
def count_zeros_fp32(
    grads: Iterable[torch.Tensor], pp_group: dist.ProcessGroup | None = None
) -> int:
    """The number of zero gradient elements over all ranks, each element counted once.

    Args:
        grads: as for `get_grad_norm_fp32`.
    """
    return int(count_zeros_on_device(grads, torch.device("cpu"), pp_group).item())


@torch.no_grad()
def grad_norm_on_device(
    grads: Iterable[torch.Tensor],
    device: torch.device,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`get_grad_norm_fp32` as a 0-dim float64 tensor on `device`, with no host synchronisation.

    The same fp32 sum of squares, square-rooted in float64: the value equals
    `get_grad_norm_fp32`'s exactly.

    Args:
        grads: as for `get_grad_norm_fp32`.
        device: where the result lives when there is no gradient (the gradients' otherwise).
    """
    total = _global_sum(grads, _sum_of_squares, pp_group, device)
    if total is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    return total.double().sqrt()


@torch.no_grad()
def clip_grad_by_norm_on_device(
    grads: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor
) -> None:
    """`clip_grad_by_total_norm_fp32` with the norm a device tensor (`grad_norm_on_device`).

    The coefficient is computed as the host computes it (in float64, then 1 where it is not
    below 1, a multiplication that changes nothing) and applied in fp32, as `_foreach_mul_`
    applies a host number, so the clipped gradients equal the host path's bitwise.
    """
    clip_scale_on_device(grads, max_norm, total_norm).scale_in_place()


@torch.no_grad()
def clip_scale_on_device(
    grads: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor
) -> GradScale:
    """`clip_grad_by_norm_on_device` as the factor a step multiplies the gradients by
    (`step_and_copy`'s `grad_scale`): a 0-dim fp32 tensor, 1 where clipping changes nothing."""
    # full_like, not new_tensor: a copy from host memory cannot be captured.
    clip_coeff = torch.full_like(total_norm, max_norm) / (total_norm + _CLIP_EPS)
    clip_coeff = torch.clamp(clip_coeff, max=1.0).float()
    return GradScale(clip_coeff, functools.partial(_scale_on_device, list(grads), clip_coeff))


def _scale_on_device(grads: list[torch.Tensor], clip_coeff: torch.Tensor) -> None:
    locals_ = [_local_and_groups(grad)[0] for grad in grads]
    fp32 = [t for t in locals_ if t.dtype == torch.float32]
    if fp32:
        torch._foreach_mul_(fp32, clip_coeff)
    # Other dtypes: the product in fp32, rounded once to the gradient's dtype, as the host
    # path's foreach kernel does (a device scalar in their own dtype would be rounded first).
    for tensor in locals_:
        if tensor.dtype != torch.float32:
            tensor.copy_(tensor.float().mul_(clip_coeff))


@torch.no_grad()
def count_zeros_on_device(
    grads: Iterable[torch.Tensor],
    device: torch.device,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`count_zeros_fp32` as a 0-dim int64 tensor on `device`, with no host synchronisation."""
    total = _global_sum(grads, _num_zeros, pp_group, device, torch.int64)
    return torch.zeros((), dtype=torch.int64, device=device) if total is None else total
