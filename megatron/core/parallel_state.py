"""Process groups for tensor, data, context and expert parallelism, with Megatron-LM's getters.

`initialize_model_parallel()` splits the default process group (gloo or NCCL) into the groups the
model and the data-parallel engines communicate over; the `get_*` functions return this rank's
group of each kind, and `destroy_model_parallel()` tears them down.

Ranks follow Megatron's default order tp-cp-ep-dp-pp: pipeline stages are the slowest dimension
(stage s holds W/pp contiguous ranks, laid out inside as below); tensor-parallel groups are
contiguous ranks, context-parallel groups stride by tp inside blocks of tp x cp ranks, and
data-parallel groups stride by tp x cp, so the data x context group ("dp_cp") holds one rank of
each tensor-parallel group. Experts follow etp-ep-dp: expert
tensor-parallel groups (`expt_tp`, etp ranks; etp defaults to tp, as in Megatron-LM) are
contiguous ranks, expert-model-parallel groups stride by etp, and expert data-parallel groups
(the ranks holding the same part of the same experts) stride by etp x ep. With
R = `num_distributed_optimizer_instances` > 1 (hybrid sharding), every data-parallel group of n
ranks is cut into R contiguous chunks of n / R ranks (the "intra" group FSDP shards over) and
the ranks holding the same position in each chunk form the "inter" group FSDP replicates over.
Example, 8 ranks, tp=2, cp=2, ep=2, etp=1, R=2 (so dp = 8 / (tp x cp) = 2):

    name             groups (each rank is in exactly one group of each name)
    tp, mp           [0,1] [2,3] [4,5] [6,7]
    cp               [0,2] [1,3] [4,6] [5,7]
    dp               [0,4] [1,5] [2,6] [3,7]
    dp_cp            [0,2,4,6] [1,3,5,7]
    intra_dp_cp      [0,2] [4,6] [1,3] [5,7]
    inter_dist_opt   [0,4] [1,5] [2,6] [3,7]
    intra_dist_opt   [0,1,2,3] [4,5,6,7]
    tp_cp            [0,1,2,3] [4,5,6,7]
    tp_dp            [0,1,4,5] [2,3,6,7]
    tp_dp_cp         [0..7]
    ep, tp_ep        [0,1] [2,3] [4,5] [6,7]
    expt_dp          [0,2,4,6] [1,3,5,7]
    intra_expt_dp    [0,2] [4,6] [1,3] [5,7]
    pp, embd, expt_tp  [0] [1] ... [7]

With etp=2 instead, `expt_tp` would be [0,1] [2,3] ..., `ep` [0,2] [1,3] [4,6] [5,7], `tp_ep`
[0,1,2,3] [4,5,6,7] and `expt_dp` [0,4] [1,5] [2,6] [3,7].

Group names are those of `ProcessGroupCollection`'s fields (see `GROUP_NAMES`); the layout
itself is computed in `megatron.core.rank_layout`. Conventions:

- With R == 1, `intra_dp_cp` is the `dp_cp` group object and `intra_expt_dp` the `expt_dp` one,
  as in Megatron-LM; `inter_dist_opt` is then a group of one rank, so callers can always test
  `group.size() > 1` instead of checking for None.
- Splitting the expert data-parallel group by R yields the same inter groups as splitting dp_cp
  (ranks r, r + W/R, r + 2W/R, ... for W ranks), so dense and expert parameters share
  `inter_dist_opt`, as in Megatron-LM.
- A group whose ranks coincide with another group's is that group's object (`mp` is `tp`,
  `embd` is `pp`, `tp_cp` is `tp` when cp == 1, ...), so no communicator is created twice.
- With one stage `pp` and `embd` are groups of one rank each, so Megatron code asking for their
  size gets 1; so is `expt_tp` with `expert_tensor_parallel_size=1`. With P stages, `pp` holds
  one rank per stage and `embd` the first and last of them.
- Getters raise RuntimeError before initialization; those Megatron-LM gives a
  `check_initialized` argument return None instead when it is False.
- `create_all_gather_group=True` adds `dp_cp_ag` and `expt_dp_ag`: second communicators over the
  same ranks as the FSDP shard groups (`intra_dp_cp`, `intra_expt_dp`; i.e. `dp_cp`, `expt_dp`
  when R == 1), used only for parameter all-gathers so that NCCL can run an all-gather
  concurrently with a reduce-scatter on the main communicator. Megatron-LM builds its
  `_DATA_PARALLEL_GROUP_WITH_CP_AG` over the full dp_cp ranks even when R > 1; here it mirrors
  the group parameters are actually sharded over, since an all-gather of shards must run over
  exactly the ranks holding them.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch.distributed as dist

from megatron.core.rank_layout import rank_groups

GROUP_NAMES = (
    "dp",
    "dp_cp",
    "dp_cp_ag",
    "intra_dp_cp",
    "inter_dist_opt",
    "intra_dist_opt",
    "cp",
    "tp",
    "pp",
    "mp",
    "tp_cp",
    "tp_dp",
    "tp_dp_cp",
    "embd",
    "ep",
    "expt_tp",
    "tp_ep",
    "expt_dp",
    "expt_dp_ag",
    "intra_expt_dp",
)
"""Every group name `get_group_ranks()` accepts (`*_ag` ones exist only when requested)."""


@dataclasses.dataclass(frozen=True)
class _Group:
    group: dist.ProcessGroup
    ranks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _ParallelState:
    groups: dict[str, _Group]
    """This rank's group of each name; aliased names share one `_Group`."""
    num_distributed_optimizer_instances: int


_STATE: _ParallelState | None = None


def _check_sizes(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    context_parallel_size: int,
    expert_model_parallel_size: int,
    expert_tensor_parallel_size: int,
    num_distributed_optimizer_instances: int,
) -> None:
    pp = pipeline_model_parallel_size
    if pp < 1 or world_size % pp:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} does not divide the world size {world_size}; "
            f"choose a divisor of {world_size}."
        )
    # Every other dimension splits the ranks of one pipeline stage.
    world_size //= pp
    ranks = f"world size {world_size}" if pp == 1 else f"{world_size} ranks of a pipeline stage"
    etp = expert_tensor_parallel_size
    divisors = {
        "tensor_model_parallel_size": (tensor_model_parallel_size, ""),
        "context_parallel_size": (context_parallel_size, ""),
        "expert_model_parallel_size": (expert_model_parallel_size, ""),
        "expert_tensor_parallel_size": (etp, ""),
        "expert_tensor_parallel_size x expert_model_parallel_size": (
            etp * expert_model_parallel_size,
            f" ({etp} x {expert_model_parallel_size})",
        ),
    }
    for name, (size, what) in divisors.items():
        if size < 1 or world_size % size:
            raise ValueError(
                f"{name}={size} does not divide the {ranks}{what}; choose a divisor of "
                f"{world_size}."
            )
    model_size = tensor_model_parallel_size * context_parallel_size
    if world_size % model_size:
        raise ValueError(
            f"tensor_model_parallel_size={tensor_model_parallel_size} x context_parallel_size="
            f"{context_parallel_size} = {model_size} does not divide the world size "
            f"{world_size}; choose sizes whose product divides {world_size}."
        )
    instances = num_distributed_optimizer_instances
    data_sizes = {
        "data x context parallel size": (
            world_size // tensor_model_parallel_size,
            f"world size {world_size} / tensor_model_parallel_size={tensor_model_parallel_size}",
        ),
        "expert data-parallel size": (
            world_size // (etp * expert_model_parallel_size),
            f"world size {world_size} / (expert_tensor_parallel_size={etp} x "
            f"expert_model_parallel_size={expert_model_parallel_size})",
        ),
    }
    for what, (size, derivation) in data_sizes.items():
        if instances < 1 or size % instances:
            raise ValueError(
                f"num_distributed_optimizer_instances={instances} does not divide the {what} "
                f"{size} ({derivation}); lower one of the two."
            )


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    *,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    num_distributed_optimizer_instances: int = 1,
    create_all_gather_group: bool = False,
    distributed_timeout_minutes: int | None = None,
) -> None:
    """Creates the process groups described in the module docstring over the default group.

    Every rank must call this with the same arguments: each rank creates every group (torch
    requires all ranks to call `new_group` in the same order) and keeps the ones it belongs to.

    Args:
        tensor_model_parallel_size: ranks that split each layer's weights (tp); tp x cp divides
            the world size.
        pipeline_model_parallel_size: pipeline stages (the slowest dimension: stage s holds
            ranks s * W/pp .. (s+1) * W/pp - 1); divides the world size, and every other size
            divides the ranks of one stage.
        context_parallel_size: ranks that split each sequence; tp x cp divides the world size.
        expert_model_parallel_size: ranks that split the experts of an MoE layer; divides the
            world size.
        expert_tensor_parallel_size: ranks that split each expert's weights (expt_tp); None
            means tensor_model_parallel_size, as in Megatron-LM. etp x ep divides the world
            size.
        num_distributed_optimizer_instances: R outer replicas for hybrid sharding (HSDP); R must
            divide both the dp x cp size (world / tp) and the expert data-parallel size
            (world / (etp x ep)).
        create_all_gather_group: also create `dp_cp_ag` and `expt_dp_ag`, the all-gather
            communicators of the FSDP shard groups.
        distributed_timeout_minutes: timeout of the new groups; None keeps the default
            group's timeout.

    Raises:
        ValueError: a size is unsupported or does not divide the ranks it splits.
        RuntimeError: torch.distributed is not initialized, or the groups already exist.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel() needs torch.distributed: call "
            "torch.distributed.init_process_group() first."
        )
    if _STATE is not None:
        raise RuntimeError(
            "Model-parallel groups are already initialized; call destroy_model_parallel() "
            "before initialize_model_parallel() again."
        )
    world_size = dist.get_world_size()
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    _check_sizes(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        expert_tensor_parallel_size,
        num_distributed_optimizer_instances,
    )
    layout, aliases = rank_groups(
        world_size,
        tensor_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        num_distributed_optimizer_instances,
        create_all_gather_group,
        etp=expert_tensor_parallel_size,
        pp=pipeline_model_parallel_size,
    )
    timeout = None
    if distributed_timeout_minutes is not None:
        timeout = timedelta(minutes=distributed_timeout_minutes)
    rank = dist.get_rank()
    groups = {}
    created = {}
    for name, partition in layout.items():
        for ranks in partition:
            group = dist.new_group(ranks, timeout=timeout, group_desc=name)
            created[name, tuple(ranks)] = group
            if rank in ranks:
                groups[name] = _Group(group, tuple(ranks))
    for name, target in aliases.items():
        groups[name] = groups[target]
    if "embd" not in groups:
        # A middle pipeline stage: the embedding group of its pipeline, which it is not in.
        pipeline = groups["pp"].ranks
        ends = (pipeline[0], pipeline[-1])
        groups["embd"] = _Group(created["embd", ends], ends)
    _STATE = _ParallelState(groups, num_distributed_optimizer_instances)


def model_parallel_is_initialized() -> bool:
    """Whether `initialize_model_parallel()` ran (and `destroy_model_parallel()` did not)."""
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Destroys every group `initialize_model_parallel()` created; a no-op when none exist."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None or not dist.is_initialized():
        return
    # Aliases come after their targets, so this is creation order without repeats. Tearing down
    # in reverse creation order keeps every rank in step: NCCL teardown was collective in some
    # versions.
    created = dict.fromkeys(
        g.group for g in state.groups.values() if g.group is not dist.GroupMember.NON_GROUP_MEMBER
    )
    for group in reversed(created):
        dist.destroy_process_group(group)


def _state() -> _ParallelState:
    if _STATE is None:
        raise RuntimeError(
            "Model-parallel groups are not initialized: call "
            "megatron.core.parallel_state.initialize_model_parallel() first."
        )
    return _STATE


def _group(name: str, check_initialized: bool = True) -> dist.ProcessGroup | None:
    if _STATE is None and not check_initialized:
        return None
    return _state().groups[name].group


def _world_size(name: str) -> int:
    return len(_state().groups[name].ranks)


def _rank(name: str) -> int:
    return _state().groups[name].ranks.index(dist.get_rank())


def get_group_ranks(name: str) -> list[int]:
    """Global ranks of this rank's group called `name` (one of `GROUP_NAMES`), no collective.

    Raises:
        ValueError: `name` is unknown, or an all-gather group that was not created.
    """
    groups = _state().groups
    if name not in groups:
        raise ValueError(
            f"No process group named {name!r}; known names: {', '.join(GROUP_NAMES)} "
            "(the *_ag groups need create_all_gather_group=True)."
        )
    return list(groups[name].ranks)


def has_separate_all_gather_group() -> bool:
    """Whether `dp_cp_ag` / `expt_dp_ag` exist (`create_all_gather_group=True`)."""
    return _STATE is not None and "dp_cp_ag" in _STATE.groups


def _shard_group_name(base: str, partial: bool, independent_all_gather: bool) -> str:
    """Name of the `base` ("dp_cp" or "expt_dp") group a data-parallel getter asked for."""
    name = f"intra_{base}" if partial else base
    if not independent_all_gather:
        return name
    state = _state()
    if f"{base}_ag" not in state.groups:
        raise RuntimeError(
            "No separate all-gather group exists: pass create_all_gather_group=True to "
            "initialize_model_parallel()."
        )
    if state.num_distributed_optimizer_instances > 1 and not partial:
        # The all-gather group mirrors the shard group; returning it here would hand out a group
        # whose ranks differ from the one the caller named.
        raise ValueError(
            f"With num_distributed_optimizer_instances > 1 the all-gather group mirrors "
            f"intra_{base}, not {base}: pass independent_all_gather=True together with "
            "partial_data_parallel=True (partial_expert_data_parallel=True for experts)."
        )
    return f"{base}_ag"


def _data_parallel_name(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if with_context_parallel:
        return "intra_dp_cp" if partial_data_parallel else "dp_cp"
    if partial_data_parallel:
        raise ValueError("partial_data_parallel=True needs with_context_parallel=True.")
    return "dp"


def get_data_parallel_group(
    with_context_parallel: bool = False,
    partial_data_parallel: bool = False,
    independent_all_gather: bool = False,
) -> dist.ProcessGroup:
    """This rank's data-parallel group.

    Args:
        with_context_parallel: the dp x cp group (`dp_cp`) instead of `dp`.
        partial_data_parallel: the FSDP shard group of hybrid sharding (`intra_dp_cp`, which is
            `dp_cp` when R == 1); needs `with_context_parallel`.
        independent_all_gather: the all-gather communicator over the same ranks as the group the
            other flags select (`dp_cp_ag`); needs `with_context_parallel`, and
            `partial_data_parallel` when R > 1.
    """
    if not with_context_parallel:
        if independent_all_gather:
            raise ValueError("independent_all_gather=True needs with_context_parallel=True.")
        return _group(_data_parallel_name(with_context_parallel, partial_data_parallel))
    return _group(_shard_group_name("dp_cp", partial_data_parallel, independent_all_gather))


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """Size of the group `get_data_parallel_group()` returns for these flags."""
    return _world_size(_data_parallel_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_rank(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """This rank's index in the group `get_data_parallel_group()` returns for these flags."""
    return _rank(_data_parallel_name(with_context_parallel, partial_data_parallel))


def get_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's context-parallel group."""
    return _group("cp", check_initialized)


def get_context_parallel_global_ranks() -> list[int]:
    """Global ranks of this rank's context-parallel group, in ring order."""
    return get_group_ranks("cp")


def get_context_parallel_world_size() -> int:
    """Number of ranks splitting each sequence."""
    return _world_size("cp")


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group."""
    return _rank("cp")


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's tensor-parallel group (the ranks splitting each layer's weights)."""
    return _group("tp", check_initialized)


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks splitting each layer's weights."""
    return _world_size("tp")


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group."""
    return _rank("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 of this rank's group (Megatron's broadcast source)."""
    return _state().groups["tp"].ranks[0]


def get_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's model-parallel group: tensor x pipeline, which is `tp` with one stage."""
    return _group("mp", check_initialized)


def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
) -> dist.ProcessGroup | None:
    """This rank's tensor x data-parallel group (`tp_dp`; `tp_dp_cp` with context parallel)."""
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_tensor_and_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Size of the group `get_tensor_and_data_parallel_group()` returns for this flag."""
    return _world_size("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_context_parallel_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """This rank's tensor x context-parallel group (`tp_cp`)."""
    return _group("tp_cp", check_initialized)


def get_tensor_and_context_parallel_world_size() -> int:
    """Number of ranks in this rank's tensor x context-parallel group."""
    return _world_size("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    """This rank's index in its tensor x context-parallel group."""
    return _rank("tp_cp")


def get_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The ranks holding word embeddings that must stay tied: the first and last pipeline stage
    of this rank's pipeline (this rank alone with one stage). A middle stage gets a group of
    the pipeline's first and last rank, which it is not in: check `is_rank_in_embedding_group`
    first."""
    return _group("embd", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's pipeline group: one rank of each stage, in stage order."""
    return _group("pp", check_initialized)


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return _world_size("pp")


def get_pipeline_model_parallel_rank() -> int:
    """This rank's stage."""
    return _rank("pp")


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank is the first stage (and, unless `ignore_virtual`, `vp_stage` is its
    first virtual stage: None counts as the first)."""
    first_chunk = ignore_virtual or not vp_stage
    return get_pipeline_model_parallel_rank() == 0 and first_chunk


def is_pipeline_last_stage(
    ignore_virtual: bool = True, vp_stage: int | None = None, vp_size: int | None = None
) -> bool:
    """Whether this rank is the last stage (and, unless `ignore_virtual`, `vp_stage` is the
    last of its `vp_size` virtual stages: None counts as the last)."""
    last_chunk = ignore_virtual or vp_stage is None or vp_stage == (vp_size or 1) - 1
    last_rank = get_pipeline_model_parallel_world_size() - 1
    return get_pipeline_model_parallel_rank() == last_rank and last_chunk


def is_rank_in_embedding_group() -> bool:
    """Whether this rank holds a tied word-embedding copy: it is its pipeline's first or last
    stage."""
    return dist.get_rank() in _state().groups["embd"].ranks


def get_expert_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's expert-model-parallel group (the ranks splitting one layer's experts)."""
    return _group("ep", check_initialized)


def get_expert_model_parallel_world_size() -> int:
    """Number of ranks splitting the experts of an MoE layer."""
    return _world_size("ep")


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its expert-model-parallel group."""
    return _rank("ep")


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's expert tensor-parallel group (the ranks splitting each expert's weights)."""
    return _group("expt_tp", check_initialized)


def get_expert_tensor_parallel_world_size() -> int:
    """The size of this rank's expert tensor-parallel group."""
    return _world_size("expt_tp")


def get_expert_tensor_parallel_rank() -> int:
    """This rank's index in its expert tensor-parallel group."""
    return _rank("expt_tp")


def get_expert_tensor_and_model_parallel_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """This rank's expert tensor x expert-model-parallel group (`tp_ep`; `ep` while expert tp
    is 1)."""
    return _group("tp_ep", check_initialized)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Number of ranks in this rank's expert tensor x expert-model-parallel group."""
    return _world_size("tp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    """This rank's index in its expert tensor x expert-model-parallel group."""
    return _rank("tp_ep")


def get_expert_data_parallel_group(
    check_initialized: bool = True,
    partial_expert_data_parallel: bool = False,
    independent_all_gather: bool = False,
) -> dist.ProcessGroup | None:
    """This rank's expert data-parallel group (the ranks holding replicas of the same experts).

    Args:
        check_initialized: if False, return None instead of raising before initialization.
        partial_expert_data_parallel: the expert FSDP shard group of hybrid sharding
            (`intra_expt_dp`, which is `expt_dp` when R == 1).
        independent_all_gather: the all-gather communicator over the same ranks as the group the
            other flags select (`expt_dp_ag`); needs `partial_expert_data_parallel` when R > 1.
    """
    if _STATE is None and not check_initialized:
        return None
    return _group(
        _shard_group_name("expt_dp", partial_expert_data_parallel, independent_all_gather)
    )


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """Size of `expt_dp` (`intra_expt_dp` if `partial_expert_data_parallel`)."""
    return _world_size("intra_expt_dp" if partial_expert_data_parallel else "expt_dp")


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """This rank's index in `expt_dp` (`intra_expt_dp` if `partial_expert_data_parallel`)."""
    return _rank("intra_expt_dp" if partial_expert_data_parallel else "expt_dp")


def get_inter_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """The HSDP replicate group: one rank of each of the R instances (only this rank if R == 1).

    Dense and expert parameters share it (see the module docstring).
    """
    return _group("inter_dist_opt", check_initialized)


def get_intra_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """Every rank of this rank's optimizer instance: W / R contiguous ranks, tensor-parallel
    peers included (one `intra_dp_cp` chunk and its tp peers; every rank when R == 1)."""
    return _group("intra_dist_opt", check_initialized)
