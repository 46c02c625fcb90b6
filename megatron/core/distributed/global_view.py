"""The global DTensors the DDP engine and the distributed optimizer show split parameters as.

A module parameter split by tensor parallelism (over `tp`, or `expt_tp` for experts, as its
`TensorParallelLayout` says) and, for experts, by expert parallelism (dim 0 over `ep`) holds a
part of a global tensor. A `GlobalView` describes one kind of parameters (dense or expert) of the
DDP engine: the meshes (the leading tp and ep dimensions, then the data-parallel one), each
parameter's placements and global shape, and the way back from a global value (a checkpoint's) to
this rank's part. Megatron-FSDP builds the same placements in its own parameter groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from megatron.core.distributed.expert_parallel import global_expert_shape, local_expert_rows
from megatron.core.distributed.tensor_parallel_params import (
    dtensor,
    global_shape,
    local_part,
    mesh_with_leading_groups,
)
from megatron.core.tensor_parallel.layout import (
    TensorParallelLayout,
    full_tensor,
    tensor_parallel_placement,
)


class GlobalView:
    """The global DTensors of one kind of parameters, split over `tp` and/or `ep`.

    Args:
        dp: the data-parallel group these parameters are replicated (DDP) or sharded
            (distributed optimizer) over.
        device_type: "cpu" or "cuda".
        tp: the group the layouts split over (two or more ranks), or None.
        layouts: each parameter's layout over `tp`; parameters not in it are replicated.
        ep: the expert-model-parallel group splitting dim 0 (two or more ranks), or None.

    Every rank of `tp`, `ep` and `dp` must build it (the meshes gather their peers' ranks).
    """

    def __init__(
        self,
        dp: dist.ProcessGroup,
        device_type: str,
        *,
        tp: dist.ProcessGroup | None = None,
        layouts: dict[torch.nn.Parameter, TensorParallelLayout] | None = None,
        ep: dist.ProcessGroup | None = None,
    ):
        leads = [(name, group) for name, group in (("tp", tp), ("ep", ep)) if group is not None]
        if not leads:
            raise ValueError("A GlobalView needs a tp or an ep group of two or more ranks.")
        self.tp, self.ep, self.dp = tp, ep, dp
        self.layouts = layouts or {}
        own = torch.tensor(dist.get_rank(), dtype=torch.int)
        self.replicated_mesh = mesh_with_leading_groups(leads, [], own, device_type, ())
        dp_ranks = torch.tensor(dist.get_process_group_ranks(dp), dtype=torch.int)
        self.sharded_mesh = mesh_with_leading_groups(
            leads, [dp], dp_ranks, device_type, (f"dp:{dp.group_name}",)
        )

    def placements(self, param: torch.nn.Parameter) -> tuple[Placement, ...]:
        """`param`'s placements over the leading dimensions (tp, then ep)."""
        tp = (tensor_parallel_placement(self.layouts.get(param)),) if self.tp else ()
        return (*tp, Shard(0)) if self.ep else tp

    def global_shape(self, param: torch.nn.Parameter) -> torch.Size:
        """The shape of the global tensor `param` holds a part of."""
        shape = global_expert_shape(param.shape, self.ep)
        return global_shape(shape, self.layouts.get(param), self.tp)

    def replicated(self, local: torch.Tensor, param: torch.nn.Parameter) -> DTensor:
        """`local` (shaped like `param`, replicated over dp) as the global DTensor."""
        return dtensor(
            local, self.replicated_mesh, self.placements(param), self.global_shape(param)
        )

    def sharded(self, rows: torch.Tensor, param: torch.nn.Parameter) -> DTensor:
        """`rows`, this rank's dim-0 chunk over dp of a tensor shaped like `param`, as the
        global DTensor."""
        placements = (*self.placements(param), Shard(0))
        return dtensor(rows, self.sharded_mesh, placements, self.global_shape(param))

    def local_value(self, value: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
        """`param`'s part of `value`: a DTensor of `replicated()`'s form, another global
        DTensor, or a whole global tensor (a tensor shaped like `param` is taken as it is)."""
        if isinstance(value, DTensor):
            if value.device_mesh is self.replicated_mesh:
                return value.to_local()
            value = full_tensor(value)
        if value.shape == param.shape:
            return value
        value = local_expert_rows(value, self.ep)
        return local_part(value, self.layouts.get(param), self.tp)
