"""Megatron-FSDP: fully sharded data parallelism (ZeRO-1/2/3, hybrid sharding) for Megatron models.

Library use::

    for layer in model.decoder.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())  # any optimizer; or, the fast path:
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()), model)

or, for a Megatron model from a `DistributedDataParallelConfig`, `FullyShardedDataParallel`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from megatron.core.distributed.fsdp.distributed_index import FSDPDistributedIndex
from megatron.core.distributed.fsdp.fsdp_module import FsdpModule, fully_shard
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.microbatch import (
    accumulation_memory,
    microbatch,
    set_profiler_labels,
    unit_memory,
)
from megatron.core.distributed.fsdp.mixed_precision import MixedPrecisionPolicy
from megatron.core.distributed.fsdp.optimizer import fully_shard_optimizer
from megatron.core.distributed.fsdp.overlap import OverlapPolicy
from megatron.core.distributed.fsdp.roots import local_main_weights
from megatron.core.distributed.fsdp.strategy import ShardingStrategy

__all__ = [
    "FSDPDistributedIndex",
    "FsdpModule",
    "FullyShardedDataParallel",
    "MixedPrecisionPolicy",
    "OverlapPolicy",
    "ShardingStrategy",
    "accumulation_memory",
    "fully_shard",
    "fully_shard_optimizer",
    "local_main_weights",
    "microbatch",
    "set_profiler_labels",
    "unit_memory",
]

# Internals this package once exported: still importable from here, with a warning naming the
# module they live in.
_MOVED = {
    "DBuffer": "megatron.core.distributed.fsdp.dbuffer",
    "ShardLayout": "megatron.core.distributed.fsdp.dbuffer",
    "ShardGroups": "megatron.core.distributed.fsdp.distributed_index",
    "GradState": "megatron.core.distributed.fsdp.gradients",
    "FsdpParameterGroup": "megatron.core.distributed.fsdp.param_group",
    "is_expert_param": "megatron.core.distributed.expert_parallel",
    "fsdp_roots": "megatron.core.distributed.fsdp.roots",
    "fsdp_contexts": "megatron.core.distributed.fsdp.roots",
    "parameter_groups": "megatron.core.distributed.fsdp.roots",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _MOVED[name]
    warnings.warn(
        f"{name} is an internal of Megatron-FSDP: import it from {module} (it is no longer "
        f"exported by {__name__}).",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
