"""How the data-parallel engines see expert parameters split by expert and expert tensor
parallelism.

An expert parameter (`is_expert_param`: its name contains `.experts.`) holds the experts of this
rank only: its dim 0 is the *local* expert index, and rank `r` of the expert-model-parallel
group (`ep`) holds the global experts `r * E_local ... (r + 1) * E_local - 1`. With expert tensor
parallelism each expert's weights are further split over the expert tensor-parallel group
(`expt_tp`), as the experts' `TensorParallelLayout`s say (those layouts are relative to
`expt_tp`, not to the dense `tp` group). Ranks holding the same part of the same experts form the
expert data-parallel group (`expt_dp`); expert gradients are reduced there, dense ones over the
whole data x context group.

Everything the engines show outside (main weights, gradients and optimizer states as DTensors,
checkpoints) is the *global* tensor `[num_experts, ...]`: split over `expt_tp` as its layout says
and over `ep` along dim 0 (the mesh's leading dimensions), then as the engine shards it over
`expt_dp`. So a checkpoint holds global experts and loads at any EP or ETP size, and the gradient
norm all-reduces the expert partial sums over `ep` and `expt_tp` but not over `expt_dp` replicas.

Gradient scaling: an expert's gradient is the sum of what every rank's tokens contributed, and
it must equal what it would be if the expert were replicated, i.e. averaged over the data x
context ranks. The reduction over `expt_dp` therefore divides by the dp x cp size, not by its
own size.

Experts are dense parameters, with the dense groups, when they have no groups of their own
(`experts_are_dense`): no expert parallelism and an `expt_tp` group that is none (every tp rank
then holds all experts whole, and the layer sums their gradients over tp) or the dense tp group
itself (they are then split over tp like any dense parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.utils import group_size


def is_expert_param(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: parameters under an `experts` module, or marked `allreduce=False`."""
    return ".experts." in f".{name}." or getattr(param, "allreduce", True) is False


@dataclass(frozen=True)
class ExpertGroups:
    """The groups expert parameters are split and replicated over; None for a size of 1.

    Attributes:
        ep: the expert-model-parallel group.
        etp: the expert tensor-parallel group (`expt_tp`).
        expt_dp: the expert data-parallel group.
    """

    ep: dist.ProcessGroup | None = None
    etp: dist.ProcessGroup | None = None
    expt_dp: dist.ProcessGroup | None = None


def expert_groups(pg_collection: ProcessGroupCollection | None) -> ExpertGroups:
    """The expert groups of `pg_collection`, else of `parallel_state` when initialised, else
    none: one rank holds every expert whole."""
    if pg_collection is None:
        if not parallel_state.model_parallel_is_initialized():
            return ExpertGroups()
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return ExpertGroups(
        ep=_multi_rank(pg_collection.ep),
        etp=_multi_rank(pg_collection.expt_tp),
        expt_dp=pg_collection.expt_dp,
    )


def _multi_rank(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    return group if group is not None and group.size() > 1 else None


def experts_are_dense(
    ep: dist.ProcessGroup | None, etp: dist.ProcessGroup | None, tp: dist.ProcessGroup | None
) -> bool:
    """Whether expert parameters use the dense groups (see the module docstring).

    Args:
        ep, etp, tp: the expert-model-parallel, expert tensor-parallel and tensor-parallel
            groups, None for a size of 1.
    """
    if ep is not None:
        return False
    if etp is None:
        return True
    return tp is not None and dist.get_process_group_ranks(etp) == dist.get_process_group_ranks(tp)


def global_expert_shape(local_shape: torch.Size, ep: dist.ProcessGroup | None) -> torch.Size:
    """The global shape `[num_experts, ...]` of an expert parameter of `local_shape`."""
    return torch.Size((local_shape[0] * group_size(ep), *local_shape[1:]))


def local_expert_rows(full: torch.Tensor, ep: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's experts (a view) of a global expert tensor `[num_experts, ...]`."""
    size = group_size(ep)
    if size == 1:
        return full
    rows = full.shape[0] // size
    return full.narrow(0, ep.rank() * rows, rows)
