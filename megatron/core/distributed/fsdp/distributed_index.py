"""`FSDPDistributedIndex`: which process groups Megatron-FSDP shards and communicates over.

It turns a `ProcessGroupCollection` (or a `DeviceMesh`) into, for dense and for expert
parameters, a `ShardGroups`: the shard group (dp, or dp x cp; one replica under hybrid sharding),
the outer group across replicas (hybrid sharding), the group parameter all-gathers run on (a
separate communicator when one was created, so all-gathers and reduce-scatters can overlap), and
the `DeviceMesh` the main weights are DTensors over. A parameter group asks once, when it builds
its buffers, and keeps the answer.

With tensor parallelism (`tensor_parallel_params.py`) the data-parallel groups exclude the TP
peers, and the dense mesh gains a first dimension, `tp`, over which the global tensors are split
as each parameter's layout says.

Expert parameters with groups of their own (see `expert_parallel.py`: split by expert or expert
tensor parallelism) are sharded over the expert shard group (`expt_dp`, `intra_expt_dp` under
hybrid sharding) and gathered over `expt_dp_ag`; their mesh leads with `tp` (the `expt_tp`
group, as their layouts say) and `ep` (the global experts split along dim 0), and their
gradients' shard-level reductions divide by the dp x cp size rather than the group's. Otherwise
experts are dense parameters. The leading dimensions, and how each parameter is placed over
them, are `LeadingGroups`' (`leading_groups.py`), shared with the DDP engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron.core import parallel_state
from megatron.core.distributed.data_parallel_base import resolve_data_parallel_group
from megatron.core.distributed.expert_parallel import experts_are_dense
from megatron.core.distributed.leading_groups import LeadingGroups
from megatron.core.distributed.tensor_parallel_params import check_excludes_tp_peers
from megatron.core.process_groups_config import ProcessGroupCollection

SHARD_DIM = "shard"
OUTER_DIM = "outer"


@dataclass(frozen=True)
class ShardGroups:
    """The groups of one kind of parameter (dense or expert).

    Attributes:
        shard: the group compute weights / gradients / main weights are sharded over.
        outer: the group across hybrid-sharding replicas, or None.
        all_gather: the communicator parameter all-gathers use (same ranks as `shard`).
        mesh: (shard,) or (shard, outer) device mesh, led by the dimensions of `leading`;
            main weights are DTensors over it.
        leading: the model-parallel groups the parameters are split over (`tp` for dense
            parameters; `expt_tp` and `ep` for experts), which lead the mesh.
    """

    shard: dist.ProcessGroup
    outer: dist.ProcessGroup | None
    all_gather: dist.ProcessGroup
    mesh: DeviceMesh
    leading: LeadingGroups = LeadingGroups()

    @property
    def shard_size(self) -> int:
        return self.shard.size()

    @property
    def outer_size(self) -> int:
        return 1 if self.outer is None else self.outer.size()

    grad_divisor: int = 0
    """What a shard-level gradient reduction divides the sum by: the dense shard group's size
    (dp x cp over the hybrid-sharding replicas, whose reduction divides by the outer size), also
    for experts, whose shard group holds 1/EP of the data-parallel ranks (and, under tensor
    parallelism, ranks of other tp groups); unused where `average_grads` is False."""

    average_grads: bool = True
    """Whether gradient reductions average over the data-parallel ranks (False: they sum, as
    Megatron-core's engines do under `calculate_per_token_loss`)."""


class FSDPDistributedIndex:
    """The process groups of Megatron-FSDP, for dense and expert parameters.

    Args:
        shard_group: dense shard group.
        outer_group: group across hybrid-sharding replicas (None or size 1: no hybrid sharding).
        expert_shard_group: shard group of expert parameters (None: the model has none).
        all_gather_group: separate communicator for dense all-gathers (None: `shard_group`).
        expert_all_gather_group: separate communicator for expert all-gathers.
        expert_model_parallel_group: the `ep` group splitting the experts (None or size 1:
            every rank holds every expert).
        tensor_model_parallel_group: the `tp` group of dense parameters (None or size 1: no
            tensor parallelism); it must not overlap the shard group.
        expert_tensor_parallel_group: the `expt_tp` group splitting each expert (None or size
            1: experts are not split by tensor parallelism).
        device: where buffers live; default: the current CUDA device under NCCL, else CPU.
        average_grads: gradient reductions average over the data-parallel ranks; False: they
            sum (Megatron-core's rule under `calculate_per_token_loss`, whose loop then divides
            by the global token count).

    Raises:
        ValueError: an all-gather group does not span the same ranks as its shard group; the
            tp group shares ranks other than this one with the shard group.
    """

    def __init__(
        self,
        shard_group: dist.ProcessGroup,
        *,
        outer_group: dist.ProcessGroup | None = None,
        expert_shard_group: dist.ProcessGroup | None = None,
        all_gather_group: dist.ProcessGroup | None = None,
        expert_all_gather_group: dist.ProcessGroup | None = None,
        expert_model_parallel_group: dist.ProcessGroup | None = None,
        tensor_model_parallel_group: dist.ProcessGroup | None = None,
        expert_tensor_parallel_group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        average_grads: bool = True,
    ):
        if outer_group is not None and outer_group.size() == 1:
            outer_group = None
        if expert_model_parallel_group is not None and expert_model_parallel_group.size() == 1:
            expert_model_parallel_group = None
        if tensor_model_parallel_group is not None and tensor_model_parallel_group.size() == 1:
            tensor_model_parallel_group = None
        if expert_tensor_parallel_group is not None and expert_tensor_parallel_group.size() == 1:
            expert_tensor_parallel_group = None
        _check_same_ranks(all_gather_group, shard_group, "dp_cp_ag", "the dense shard group")
        _check_same_ranks(
            expert_all_gather_group, expert_shard_group, "expt_dp_ag", "the expert shard group"
        )
        check_excludes_tp_peers(tensor_model_parallel_group, shard_group)
        self.shard_group = shard_group
        self.outer_group = outer_group
        self.expert_shard_group = expert_shard_group
        self.all_gather_group = all_gather_group
        self.expert_all_gather_group = expert_all_gather_group
        self.expert_model_parallel_group = expert_model_parallel_group
        self.tensor_model_parallel_group = tensor_model_parallel_group
        self.expert_tensor_parallel_group = expert_tensor_parallel_group
        if device is None:
            on_gpu = dist.get_backend(shard_group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
        self.device = device or torch.device("cpu")
        self.average_grads = average_grads
        self._groups: dict[bool, ShardGroups] = {}

    @classmethod
    def from_pg_collection(
        cls,
        pg_collection: ProcessGroupCollection | None,
        device: torch.device | None = None,
        average_grads: bool = True,
    ) -> FSDPDistributedIndex:
        """Reads the groups of `pg_collection` (None: parallel_state's, else the world).

        The dense shard group is `intra_dp_cp` when set (hybrid sharding), else `dp_cp`; the
        outer group is `inter_dist_opt`; the all-gather groups are `dp_cp_ag` / `expt_dp_ag`;
        experts are split over `ep` and `expt_tp`; dense parameters over `tp`.
        """
        if pg_collection is None:
            if not parallel_state.model_parallel_is_initialized():
                return cls(
                    resolve_data_parallel_group(None), device=device, average_grads=average_grads
                )
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        dp_cp = resolve_data_parallel_group(pg_collection)
        return cls(
            pg_collection.intra_dp_cp or dp_cp,
            outer_group=pg_collection.inter_dist_opt,
            expert_shard_group=pg_collection.intra_expt_dp or pg_collection.expt_dp,
            all_gather_group=pg_collection.dp_cp_ag,
            expert_all_gather_group=pg_collection.expt_dp_ag,
            expert_model_parallel_group=pg_collection.ep,
            tensor_model_parallel_group=pg_collection.tp,
            expert_tensor_parallel_group=pg_collection.expt_tp,
            device=device,
            average_grads=average_grads,
        )

    @classmethod
    def from_device_mesh(
        cls,
        mesh: DeviceMesh,
        *,
        shard_dim: str = SHARD_DIM,
        outer_dim: str | None = None,
    ) -> FSDPDistributedIndex:
        """Reads the shard (and outer) group from named dimensions of `mesh`.

        Raises:
            ValueError: a named dimension is not in the mesh.
        """
        names = mesh.mesh_dim_names or ()
        for dim in (shard_dim, outer_dim):
            if dim is not None and dim not in names:
                raise ValueError(
                    f"DeviceMesh has no dimension {dim!r} (it has {names}); name the mesh "
                    "dimensions with init_device_mesh(..., mesh_dim_names=...) and pass them "
                    "as shard_dim / outer_dim."
                )
        device = None
        if mesh.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(
            mesh.get_group(shard_dim),
            outer_group=mesh.get_group(outer_dim) if outer_dim is not None else None,
            device=device,
        )

    def groups(self, is_expert: bool) -> ShardGroups:
        """The groups of dense (`is_expert=False`) or expert parameters.

        Raises:
            ValueError: expert groups are asked for but none were given.
        """
        if is_expert not in self._groups:
            self._groups[is_expert] = self._build(is_expert)
        return self._groups[is_expert]

    def _build(self, is_expert: bool) -> ShardGroups:
        ep, etp = self.expert_model_parallel_group, self.expert_tensor_parallel_group
        if is_expert and experts_are_dense(ep, etp, self.tensor_model_parallel_group):
            # Every rank holds every expert, whole or split over the dense tp group: they are
            # dense parameters (which also keeps tp peers holding copies out of their
            # reductions).
            return self.groups(False)
        if is_expert:
            if self.expert_shard_group is None:
                raise ValueError(
                    "The module has expert parameters (under '.experts.') but no expert shard "
                    "group was given: pass a ProcessGroupCollection with expt_dp (or "
                    "intra_expt_dp), or initialise parallel_state."
                )
            shard, all_gather, tp = self.expert_shard_group, self.expert_all_gather_group, etp
        else:
            shard, all_gather = self.shard_group, self.all_gather_group
            ep, tp = None, self.tensor_model_parallel_group
        leading = LeadingGroups(tp=tp, ep=ep)
        return ShardGroups(
            shard=shard,
            outer=self.outer_group,
            all_gather=all_gather or shard,
            mesh=_device_mesh(shard, self.outer_group, self.device.type, leading),
            leading=leading,
            grad_divisor=self.shard_group.size(),
            average_grads=self.average_grads,
        )


def _device_mesh(
    shard: dist.ProcessGroup,
    outer: dist.ProcessGroup | None,
    device_type: str,
    leading: LeadingGroups,
) -> DeviceMesh:
    # DeviceMesh equality ignores which communicators a mesh holds, and DTensor caches sharding
    # results by mesh; dimension names that carry the group names keep a mesh over destroyed
    # groups (same ranks, earlier `parallel_state`) from being served for this one.
    names = [f"{SHARD_DIM}:{shard.group_name}"]
    groups = [shard]
    ranks = torch.tensor(dist.get_process_group_ranks(shard), dtype=torch.int)
    if outer is not None:
        # A 2-D mesh needs every replica's shard ranks; each outer peer holds one replica.
        replicas: list[list[int] | None] = [None] * outer.size()
        dist.all_gather_object(replicas, ranks.tolist(), group=outer)
        ranks = torch.tensor(replicas, dtype=torch.int).T  # [shard rank, outer rank]
        names.append(f"{OUTER_DIM}:{outer.group_name}")
        groups.append(outer)
    if leading.dims:
        return leading.mesh(groups, ranks, device_type, tuple(names))
    if outer is None:
        return DeviceMesh.from_group(shard, device_type, mesh_dim_names=tuple(names))
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=tuple(names))


def _check_same_ranks(
    group: dist.ProcessGroup | None, reference: dist.ProcessGroup | None, name: str, what: str
) -> None:
    if group is None or reference is None:
        return
    if dist.get_process_group_ranks(group) != dist.get_process_group_ranks(reference):
        raise ValueError(
            f"The all-gather group {name} spans ranks {dist.get_process_group_ranks(group)}, "
            f"but {what} spans {dist.get_process_group_ranks(reference)}; they must be the "
            "same ranks (create it with parallel_state.initialize_model_parallel("
            "create_all_gather_group=True))."
        )
