"""Base class of every model module (a `torch.nn.Module` that carries its config), and the
tensor-parallel group the model's layers use."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.utils import get_tensor_model_parallel_group_if_none
from megatron.core.transformer.transformer_config import TransformerConfig


def resolve_tp_group(pg_collection: ProcessGroupCollection | None) -> dist.ProcessGroup | None:
    """The tensor-parallel group of a model's layers: `pg_collection.tp` when given, else
    parallel_state's when initialised, else None (no tensor parallelism)."""
    tp_group = None if pg_collection is None else pg_collection.tp
    return get_tensor_model_parallel_group_if_none(tp_group)


class MegatronModule(torch.nn.Module):
    """A `torch.nn.Module` holding the `TransformerConfig` it was built from.

    Keeping the config on every module lets wrappers (FSDP, DDP, checkpointing) read shape and
    precision settings from any submodule without threading them through call sites.

    Args:
        config: The transformer configuration.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
