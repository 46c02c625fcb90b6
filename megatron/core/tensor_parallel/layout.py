"""How a parameter is split over the tensor-parallel (tp) group, and the DTensor placement for it.

A `TensorParallelLayout` relates the *global* tensor `G` (the one a model without tensor
parallelism holds) to the module parameter `P` of tp rank `t` of `T`:

- stride 1: `P = G.chunk(T, dim)[t]`;
- stride `k`: `G` is `k` equal blocks along `dim`, each split over tp on its own:
  `P = cat([block.chunk(T, dim)[t] for block in G.chunk(k, dim)], dim)`.

The strided form is DTensor's `_StridedShard(dim, split_factor=k)`, which is how engines and
checkpoints describe these parameters as global DTensors. Some torch releases (2.11) cannot
redistribute a `_StridedShard` that is not followed by another shard of the same dimension, so
`full_tensor(dtensor)` here gathers such DTensors without asking torch to, and
`strided_to_shard` / `copy_from_shard` convert them for checkpoints. Layers say how their own
parameters are split through `tensor_parallel_layouts()`; `named_tensor_parallel_layouts`
collects them for a whole model under `named_parameters()` names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard


@dataclass(frozen=True)
class TensorParallelLayout:
    """The split of one parameter over tp.

    Attributes:
        partition_dim: Dimension of the module parameter split over tp; None: replicated.
        partition_stride: Number of blocks along `partition_dim`, each split over tp separately.
    """

    partition_dim: int | None
    partition_stride: int = 1

    def __post_init__(self) -> None:
        if self.partition_stride < 1:
            raise ValueError(f"partition_stride must be >= 1, got {self.partition_stride}.")


def tensor_parallel_placement(layout: TensorParallelLayout | None) -> Placement:
    """The DTensor placement over the tp mesh dimension of a parameter with `layout`.

    Args:
        layout: The parameter's layout; None means replicated.

    Returns:
        `Replicate()` for a replicated parameter, `Shard(dim)` for stride 1 and
        `_StridedShard(dim, split_factor=stride)` for a larger stride.
    """
    if layout is None or layout.partition_dim is None:
        return Replicate()
    if layout.partition_stride == 1:
        return Shard(layout.partition_dim)
    return _StridedShard(layout.partition_dim, split_factor=layout.partition_stride)


def shard_tensor(
    full: torch.Tensor, layout: TensorParallelLayout | None, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """The part of the global tensor `full` that tp rank `tp_rank` of `tp_size` holds.

    Args:
        full: The global (unsplit) tensor.
        layout: How it is split; None or a replicated layout returns `full` itself.
        tp_rank: This rank's index in the tp group.
        tp_size: Size of the tp group.

    Returns:
        A tensor of `full`'s shape with `partition_dim` divided by `tp_size` (a view when
        the stride is 1, a new tensor otherwise).

    Raises:
        ValueError: the split dimension is not a multiple of `stride * tp_size`.
    """
    if layout is None or layout.partition_dim is None or tp_size == 1:
        return full
    dim, stride = layout.partition_dim, layout.partition_stride
    if full.shape[dim] % (stride * tp_size) != 0:
        raise ValueError(
            f"cannot split dimension {dim} of size {full.shape[dim]} into {stride} block(s) over "
            f"{tp_size} tensor-parallel ranks: the size must be a multiple of "
            f"{stride * tp_size}; choose sizes divisible by the tensor-parallel size."
        )
    if stride == 1:
        return full.chunk(tp_size, dim)[tp_rank]
    return torch.cat([block.chunk(tp_size, dim)[tp_rank] for block in full.chunk(stride, dim)], dim)


def named_tensor_parallel_layouts(module: torch.nn.Module) -> dict[str, TensorParallelLayout]:
    """The parameters of `module` split over tp, with their layouts.

    Collected from every submodule that defines `tensor_parallel_layouts()` (a dict keyed by
    that submodule's own parameter names). Parameters not listed are replicated over tp. A
    parameter reachable under several names (tied embeddings) appears once, under the name
    `named_parameters()` gives it.

    Args:
        module: The root module.

    Returns:
        Fully qualified parameter names (as `module.named_parameters()` gives them) mapped to
        their layouts; replicated layouts are left out.

    Raises:
        ValueError: a submodule lists a name that is not one of its parameters, or one
            parameter is given two different layouts.
    """
    names = {id(param): name for name, param in module.named_parameters()}
    layouts: dict[str, TensorParallelLayout] = {}
    for prefix, submodule in module.named_modules():
        declare = getattr(submodule, "tensor_parallel_layouts", None)
        if declare is None:
            continue
        for local_name, layout in declare().items():
            if local_name not in submodule._parameters:
                raise ValueError(
                    f"{type(submodule).__name__} at {prefix or '<root>'!r} gives a tensor-parallel "
                    f"layout for {local_name!r}, which is not one of its own parameters "
                    f"({sorted(submodule._parameters)}); list direct parameters only."
                )
            param = submodule._parameters[local_name]
            if param is None or layout.partition_dim is None:
                continue
            name = names[id(param)]
            if layouts.setdefault(name, layout) != layout:
                raise ValueError(
                    f"parameter {name!r} is given two tensor-parallel layouts, {layouts[name]} "
                    f"and {layout}; modules sharing a parameter must split it the same way."
                )
    return layouts


def _stride_free(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)


def _strided(dtensor: DTensor) -> tuple[int, int, int] | None:
    """(mesh dimension, tensor dimension, blocks) of `dtensor`'s `_StridedShard`, or None."""
    for mesh_dim, placement in enumerate(dtensor.placements):
        if isinstance(placement, _StridedShard):
            return mesh_dim, placement.dim, placement.split_factor
    return None


def _regroup(x: torch.Tensor, dim: int, outer: int, inner: int) -> torch.Tensor:
    """`x`'s `dim` as [outer, inner, rest] parts, regrouped as [inner, outer, rest]."""
    return x.unflatten(dim, (outer, inner, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def full_tensor(dtensor: DTensor) -> torch.Tensor:
    """`dtensor.full_tensor()`, also for a `_StridedShard` placement on any torch release.

    The ranks' parts of a strided tensor, laid end to end in rank order, are a `Shard` DTensor
    of a tensor whose blocks' parts are grouped by rank; that one is gathered, then regrouped
    by block (every rank of the mesh must call it, as `full_tensor()`)."""
    strided = _strided(dtensor)
    if strided is None:
        return dtensor.full_tensor()
    mesh_dim, dim, blocks = strided
    by_rank = DTensor.from_local(
        dtensor.to_local(),
        dtensor.device_mesh,
        _stride_free(dtensor.placements),
        run_check=False,
        shape=dtensor.shape,
        stride=dtensor.stride(),
    ).full_tensor()
    return _regroup(by_rank, dim, dtensor.device_mesh.size(mesh_dim), blocks)


def strided_to_shard(dtensor: DTensor, *, values: bool = True) -> DTensor:
    """The same global tensor as `dtensor`, its `_StridedShard` placement made `Shard` (every
    rank's part one contiguous box, as checkpoints need); `dtensor` itself if it has none.

    Args:
        dtensor: The DTensor.
        values: Gather and place its values; False gives an uninitialised one of the same
            placement and no communication (a destination a checkpoint load fills).
    """
    if _strided(dtensor) is None:
        return dtensor
    placements = _stride_free(dtensor.placements)
    if values:
        return _distribute(full_tensor(dtensor), dtensor, placements)
    shaped = _distribute(torch.empty(dtensor.shape, device="meta"), dtensor, placements)
    local = torch.empty_like(shaped.to_local(), dtype=dtensor.dtype, device=dtensor.device)
    return DTensor.from_local(
        local, dtensor.device_mesh, placements, run_check=False, shape=dtensor.shape,
        stride=dtensor.stride(),
    )  # fmt: skip


def copy_from_shard(dtensor: DTensor, source: DTensor) -> None:
    """Writes into `dtensor` (placed `_StridedShard`) the values of `source`, the same global
    tensor placed as `strided_to_shard(dtensor)` is (every rank of the mesh must call it)."""
    mesh_dim, dim, blocks = _strided(dtensor)
    by_rank = _regroup(source.full_tensor(), dim, blocks, dtensor.device_mesh.size(mesh_dim))
    local = _distribute(by_rank, dtensor, _stride_free(dtensor.placements)).to_local()
    with torch.no_grad():
        dtensor.to_local().copy_(local)


def _distribute(full: torch.Tensor, like: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    """This rank's part of `full` (on every rank), placed `placements` over `like`'s mesh."""
    local = full
    mesh = like.device_mesh
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            rank, size = mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim)
            chunks = list(torch.chunk(local, size, dim=placement.dim))
            empty = local.narrow(placement.dim, 0, 0)
            local = chunks[rank] if rank < len(chunks) else empty
    return DTensor.from_local(
        local.contiguous(),
        mesh,
        placements,
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )
