"""`ProcessGroupCollection`: the process groups a model or a data-parallel engine communicates over.

Engines take their groups from a collection (`pg_collection=...`) rather than from global state,
so tests and tools can hand-build groups and one process can hold models over different groups.
`ProcessGroupCollection.use_mpu_process_groups()` fills one from `megatron.core.parallel_state`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch.distributed as dist

from megatron.core import parallel_state

_ALL_GATHER_FIELDS = ("dp_cp_ag", "expt_dp_ag")


@dataclasses.dataclass(init=False, slots=True)
class ProcessGroupCollection:
    """Named process groups; every field is optional and defaults to None.

    Build one from explicit groups, `ProcessGroupCollection(dp=..., dp_cp=...)`, or from
    `parallel_state` with `use_mpu_process_groups()`. Field names follow Megatron-LM and the
    group names of `parallel_state`, whose module docstring shows the rank layout.

    Attributes:
        dp: data-parallel group (ranks with the same context-parallel rank).
        dp_cp: data x context parallel group; FSDP shards over it when R == 1, where R is the
            number of distributed optimizer instances (HSDP outer replicas).
        dp_cp_ag: a second communicator over the dense FSDP shard group's ranks, used only for
            parameter all-gathers so they can overlap reduce-scatters on the main communicator.
        intra_dp_cp: the dense FSDP shard group under HSDP (one of R chunks of dp_cp).
        inter_dist_opt: the HSDP replicate group (one rank per instance; size 1 when R == 1).
        intra_dist_opt: every rank of this rank's optimizer instance.
        cp: context-parallel group.
        tp: tensor-parallel group (the ranks splitting each layer's weights).
        pp: pipeline-parallel group.
        mp: model-parallel group (tensor x pipeline; `tp` with one pipeline stage).
        tp_cp: tensor x context parallel group.
        tp_dp_cp: tensor x data x context parallel group (every rank with one pipeline stage).
        embd: the ranks holding tied word embeddings (this rank alone with one pipeline stage).
        ep: expert-model-parallel group.
        expt_tp: expert tensor-parallel group (the ranks splitting each expert's weights).
        tp_ep: expert tensor x expert-model-parallel group.
        expt_dp: expert data-parallel group (ranks holding replicas of the same experts).
        expt_dp_ag: all-gather communicator over the expert FSDP shard group's ranks.
        intra_expt_dp: the expert FSDP shard group under HSDP.
    """

    dp: dist.ProcessGroup | None = None
    dp_cp: dist.ProcessGroup | None = None
    dp_cp_ag: dist.ProcessGroup | None = None
    intra_dp_cp: dist.ProcessGroup | None = None
    inter_dist_opt: dist.ProcessGroup | None = None
    intra_dist_opt: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    mp: dist.ProcessGroup | None = None
    tp_cp: dist.ProcessGroup | None = None
    tp_dp_cp: dist.ProcessGroup | None = None
    embd: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    expt_tp: dist.ProcessGroup | None = None
    tp_ep: dist.ProcessGroup | None = None
    expt_dp: dist.ProcessGroup | None = None
    expt_dp_ag: dist.ProcessGroup | None = None
    intra_expt_dp: dist.ProcessGroup | None = None

    def __init__(self, **groups: dist.ProcessGroup | None) -> None:
        """Sets the named groups; the others are None.

        Raises:
            ValueError: a keyword is not a field name.
        """
        _check_names(groups)
        for name in _FIELD_NAMES:
            setattr(self, name, groups.get(name))

    def __repr__(self) -> str:
        sizes = [
            f"{name}={group.size()}"
            for name in _FIELD_NAMES
            if (group := getattr(self, name)) is not None
        ]
        return f"ProcessGroupCollection({', '.join(sizes)})"

    @classmethod
    def use_mpu_process_groups(
        cls, required_pgs: list[str] | None = None
    ) -> ProcessGroupCollection:
        """Fills a collection with this rank's groups from `parallel_state`.

        Args:
            required_pgs: the fields to fill (the others stay None); None fills every field,
                leaving the all-gather fields None when they were not created.

        Raises:
            ValueError: a requested name is not a field.
            RuntimeError: `parallel_state` is not initialized, or an all-gather group was
                requested by name but not created.
        """
        if required_pgs is not None:
            _check_names(required_pgs)
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "ProcessGroupCollection.use_mpu_process_groups() needs parallel_state: call "
                "megatron.core.parallel_state.initialize_model_parallel() first."
            )
        if required_pgs is None:
            skip = () if parallel_state.has_separate_all_gather_group() else _ALL_GATHER_FIELDS
            required_pgs = [name for name in _FIELD_NAMES if name not in skip]
        getters = _mpu_getters()
        return cls(**{name: getters[name]() for name in required_pgs})


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ProcessGroupCollection))


def _check_names(names: Iterable[str]) -> None:
    unknown = sorted(set(names) - set(_FIELD_NAMES))
    if unknown:
        raise ValueError(
            f"Unknown ProcessGroupCollection field(s) {unknown}; "
            f"valid fields: {', '.join(_FIELD_NAMES)}."
        )


def _mpu_getters() -> dict[str, Callable[[], dist.ProcessGroup | None]]:
    ps = parallel_state
    return {
        "dp": ps.get_data_parallel_group,
        "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        # The all-gather group mirrors the shard group, which is intra_dp_cp (dp_cp when R == 1).
        "dp_cp_ag": lambda: ps.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True, independent_all_gather=True
        ),
        "intra_dp_cp": lambda: ps.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True
        ),
        "inter_dist_opt": ps.get_inter_distributed_optimizer_instance_group,
        "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group,
        "cp": ps.get_context_parallel_group,
        "tp": ps.get_tensor_model_parallel_group,
        "pp": ps.get_pipeline_model_parallel_group,
        "mp": ps.get_model_parallel_group,
        "tp_cp": ps.get_tensor_and_context_parallel_group,
        "tp_dp_cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        "embd": ps.get_embedding_group,
        "ep": ps.get_expert_model_parallel_group,
        "expt_tp": ps.get_expert_tensor_parallel_group,
        "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
        "expt_dp": ps.get_expert_data_parallel_group,
        "expt_dp_ag": lambda: ps.get_expert_data_parallel_group(
            partial_expert_data_parallel=True, independent_all_gather=True
        ),
        "intra_expt_dp": lambda: ps.get_expert_data_parallel_group(
            partial_expert_data_parallel=True
        ),
    }
