"""How the data-parallel engines see expert parameters split by expert parallelism (EP).

An expert parameter (`is_expert_param`: its name contains `.experts.`) holds the experts of this
rank only: its dim 0 is the *local* expert index, and rank `r` of the expert-model-parallel
group (`ep`) holds the global experts `r * E_local ... (r + 1) * E_local - 1`. Ranks with the
same experts form the expert data-parallel group (`expt_dp`, the world over EP ranks); expert
gradients are reduced there, dense ones over the whole data x context group.

Everything the engines show outside (main weights, gradients and optimizer states as DTensors,
checkpoints) is the *global* tensor `[num_experts, ...]`, split over `ep` along dim 0 first
(`Shard(0)` on the mesh's first dimension), then as the engine shards it over `expt_dp`. So a
checkpoint holds global experts and loads at any EP size, and the gradient norm all-reduces the
expert partial sums over `ep` (different experts) but not over `expt_dp` replicas.

Gradient scaling: an expert's gradient is the sum of what every rank's tokens contributed, and
it must equal what it would be if the expert were replicated, i.e. averaged over the data x
context ranks. The reduction over `expt_dp` therefore divides by the dp x cp size (the expert
data-parallel size times EP, over the tensor-parallel size), not by its own size. Under tensor
parallelism the ranks of one tp group hold different experts (EP is at least TP) and route
different parts of the sequence, so `expt_dp` holds no tp peers. With EP 1 there is no expert
parallelism: experts are dense parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from megatron.core import parallel_state
from megatron.core.distributed.tensor_parallel_params import LeadingGroupMeshes, dtensor
from megatron.core.process_groups_config import ProcessGroupCollection


def is_expert_param(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: parameters under an `experts` module, or marked `allreduce=False`."""
    return ".experts." in f".{name}." or getattr(param, "allreduce", True) is False


def expert_groups(
    pg_collection: ProcessGroupCollection | None,
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(ep, expt_dp) of `pg_collection`, else of `parallel_state` when initialised, else
    (None, None): one rank holds every expert (EP = 1)."""
    if pg_collection is None:
        if not parallel_state.model_parallel_is_initialized():
            return None, None
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return pg_collection.ep, pg_collection.expt_dp


def ep_size(group: dist.ProcessGroup | None) -> int:
    """The size of an ep group (None: 1)."""
    return 1 if group is None else group.size()


def global_expert_shape(local_shape: torch.Size, ep: dist.ProcessGroup | None) -> torch.Size:
    """The global shape `[num_experts, ...]` of an expert parameter of `local_shape`."""
    return torch.Size((local_shape[0] * ep_size(ep), *local_shape[1:]))


def local_expert_rows(full: torch.Tensor, ep: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's experts (a view) of a global expert tensor `[num_experts, ...]`."""
    size = ep_size(ep)
    if size == 1:
        return full
    rows = full.shape[0] // size
    return full.narrow(0, ep.rank() * rows, rows)


class ExpertLayout(LeadingGroupMeshes):
    """The expert groups of the DDP engine and the DTensors it shows its experts as.

    Args:
        ep: the expert-model-parallel group (size > 1).
        expt_dp: the expert data-parallel group.
        device_type: "cpu" or "cuda".
    """

    def __init__(self, ep: dist.ProcessGroup, expt_dp: dist.ProcessGroup, device_type: str):
        super().__init__(ep, "ep", expt_dp, "expt_dp", device_type)
        self.ep = ep
        self.expt_dp = expt_dp

    def replicated(self, local: torch.Tensor) -> DTensor:
        """`local`, this rank's experts (replicated over expt_dp), as the global DTensor."""
        shape = global_expert_shape(local.shape, self.ep)
        return dtensor(local, self.replicated_mesh, (Shard(0),), shape)

    def sharded(self, rows: torch.Tensor, local_shape: torch.Size) -> DTensor:
        """`rows`, this rank's dim-0 chunk over expt_dp of a parameter of `local_shape` (this
        rank's experts), as the global DTensor."""
        shape = global_expert_shape(local_shape, self.ep)
        return dtensor(rows, self.sharded_mesh, (Shard(0), Shard(0)), shape)
