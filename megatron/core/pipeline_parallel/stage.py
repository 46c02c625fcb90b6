"""Where a model chunk sits in the pipeline: its stage, from the process groups; and a rank's
model chunks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection


def pipeline_group(pg_collection: ProcessGroupCollection | None) -> dist.ProcessGroup | None:
    """The pipeline group: `pg_collection.pp`, else parallel_state's when initialised, else
    None (one stage)."""
    if pg_collection is not None and pg_collection.pp is not None:
        return pg_collection.pp
    if pg_collection is None and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_pipeline_model_parallel_group()
    return None


def pipeline_rank(config, pg_collection: ProcessGroupCollection | None) -> int:
    """This rank's stage, checked against `config.pipeline_model_parallel_size`.

    Raises:
        ValueError: the pipeline group's size differs from the config's.
    """
    group = pipeline_group(pg_collection)
    size = 1 if group is None else group.size()
    if size != config.pipeline_model_parallel_size:
        raise ValueError(
            f"config.pipeline_model_parallel_size={config.pipeline_model_parallel_size}, but "
            f"the pipeline group has {size} rank(s); pass a pg_collection whose pp group (or "
            "initialise parallel_state with a pipeline_model_parallel_size) that matches."
        )
    return 0 if group is None else group.rank()


Model = torch.nn.Module | Sequence[torch.nn.Module]
"""A model, or the list of a rank's model chunks (its virtual pipeline stages, in order), as
Megatron-core's training loop and optimizer take them."""


def model_chunks(model: Model) -> list[torch.nn.Module]:
    """The model chunks of `model`: the list itself, or the one module."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def modules_of(chunks: list[torch.nn.Module]) -> torch.nn.Module:
    """One module holding every chunk (the chunk itself when there is one), for what walks a
    module's parameters or submodules."""
    return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
