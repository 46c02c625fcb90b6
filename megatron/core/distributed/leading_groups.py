"""The model-parallel dimensions that lead every split parameter's global DTensor mesh.

A module parameter split by tensor parallelism (over `tp`, or `expt_tp` for experts, as its
`TensorParallelLayout` says: `tensor_parallel_params.py`) and, for experts, by expert parallelism
(dim 0 over `ep`: `expert_parallel.py`) holds a part of a global tensor. Both data-parallel
engines show it as a DTensor over a mesh whose first dimensions are those groups, `tp` then
`ep`, followed by the engine's own data-parallel dimensions. `LeadingGroups` is the one place
that says which groups lead, in which order, how a parameter is placed over them, the global
shape it shows, and the way back from a global value to this rank's part; the DDP engine's
`GlobalView` and Megatron-FSDP's parameter groups both build on it and add only their
data-parallel placements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from megatron.core.distributed.expert_parallel import global_expert_shape, local_expert_rows
from megatron.core.distributed.tensor_parallel_params import global_shape, local_part
from megatron.core.tensor_parallel.layout import TensorParallelLayout, tensor_parallel_placement


@dataclass(frozen=True)
class LeadingGroups:
    """The groups of one kind of parameters (dense or expert) that lead their meshes.

    Attributes:
        tp: the group the parameters' layouts split over (`tp` for dense parameters, `expt_tp`
            for experts) when it has two or more ranks, else None.
        ep: the expert-model-parallel group splitting the global experts along dim 0 when it
            has two or more ranks, else None.
    """

    tp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None

    @property
    def dims(self) -> list[tuple[str, dist.ProcessGroup]]:
        """(mesh dimension name, group) of each leading dimension, outermost first (empty:
        the parameters are not split)."""
        pairs = (("tp", self.tp), ("ep", self.ep))
        return [(name, group) for name, group in pairs if group is not None]

    def placements(self, layout: TensorParallelLayout | None) -> tuple[Placement, ...]:
        """The placements over the leading dimensions of a parameter with tp `layout`.

        Raises:
            ValueError: under expert parallelism, `layout` splits dim 0, the experts' index,
                which ep splits already (an expert's own dims are 1 and up).
        """
        if self.ep is not None and layout is not None and layout.partition_dim == 0:
            raise ValueError(
                f"An expert parameter's tensor-parallel layout {layout} splits dim 0, the index "
                "of the experts that expert parallelism splits; split a dim of each expert "
                "(partition_dim >= 1) instead."
            )
        tp = (tensor_parallel_placement(layout),) if self.tp is not None else ()
        return (*tp, Shard(0)) if self.ep is not None else tp

    def global_shape(
        self, local_shape: torch.Size, layout: TensorParallelLayout | None
    ) -> torch.Size:
        """The global shape of a module parameter of `local_shape` with tp `layout`: for
        experts `[num_experts, ...]`, split dims at their TP = 1 size."""
        return global_shape(global_expert_shape(local_shape, self.ep), layout, self.tp)

    def local_part(self, full: torch.Tensor, layout: TensorParallelLayout | None) -> torch.Tensor:
        """This rank's part (the module parameter's value) of the global tensor `full`: its
        experts over `ep`, then its part over `tp` as `layout` says."""
        return local_part(local_expert_rows(full, self.ep), layout, self.tp)

    def mesh(
        self,
        inner: list[dist.ProcessGroup],
        inner_ranks: torch.Tensor,
        device_type: str,
        inner_names: tuple[str, ...],
    ) -> DeviceMesh:
        """The mesh (*leading dims, *inner dims): every rank of the leading groups holds its
        own inner ones.

        Args:
            inner: the groups of the other dimensions, in mesh order (may be empty).
            inner_ranks: this rank's global ranks of the inner dimensions, shaped like them (a
                0-d tensor of this rank when there are none).
            device_type: "cpu" or "cuda".
            inner_names: the names of the inner dimensions.

        Each leading group's name is appended to its dimension's name: DTensor caches sharding
        decisions by mesh, and meshes over destroyed groups with the same ranks compare equal
        otherwise. Every rank of every leading group must call it (the peers' ranks are
        all-gathered).
        """
        dims = self.dims
        ranks = inner_ranks
        for _, lead in reversed(dims):
            peers: list[list | int | None] = [None] * lead.size()
            dist.all_gather_object(peers, ranks.tolist(), group=lead)
            ranks = torch.tensor(peers, dtype=torch.int)
        names = tuple(f"{name}:{lead.group_name}" for name, lead in dims)
        return DeviceMesh.from_group(
            [lead for _, lead in dims] + list(inner),
            device_type,
            mesh=ranks,
            mesh_dim_names=names + tuple(inner_names),
        )
