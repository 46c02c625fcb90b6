"""The global DTensors the DDP engine and the distributed optimizer show split parameters as.

A module parameter split by tensor parallelism and, for experts, by expert parallelism holds a
part of a global tensor, placed over the leading `tp` and `ep` mesh dimensions as
`LeadingGroups` (`leading_groups.py`) says. A `GlobalView` describes one kind of parameters
(dense or expert) of the DDP engine: its two meshes (the leading dimensions alone, for the
replicated values, and then the data-parallel one, for the distributed optimizer's shards), each
parameter's placements and global shape, and the way back from a global value (a checkpoint's)
to this rank's part. Megatron-FSDP's parameter groups build on the same `LeadingGroups`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from megatron.core.distributed.leading_groups import LeadingGroups
from megatron.core.distributed.tensor_parallel_params import dtensor
from megatron.core.tensor_parallel.layout import TensorParallelLayout, full_tensor


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
        self.leading = LeadingGroups(tp=tp, ep=ep)
        if not self.leading.dims:
            raise ValueError("A GlobalView needs a tp or an ep group of two or more ranks.")
        self.dp = dp
        self.layouts = layouts or {}
        own = torch.tensor(dist.get_rank(), dtype=torch.int)
        self.replicated_mesh = self.leading.mesh([], own, device_type, ())
        dp_ranks = torch.tensor(dist.get_process_group_ranks(dp), dtype=torch.int)
        self.sharded_mesh = self.leading.mesh([dp], dp_ranks, device_type, (f"dp:{dp.group_name}",))

    def placements(self, param: torch.nn.Parameter) -> tuple[Placement, ...]:
        """`param`'s placements over the leading dimensions (tp, then ep)."""
        return self.leading.placements(self.layouts.get(param))

    def global_shape(self, param: torch.nn.Parameter) -> torch.Size:
        """The shape of the global tensor `param` holds a part of."""
        return self.leading.global_shape(param.shape, self.layouts.get(param))

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
        return self.leading.local_part(value, self.layouts.get(param))
