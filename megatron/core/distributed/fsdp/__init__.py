"""Megatron-FSDP: fully sharded data parallelism (ZeRO-1/2/3, hybrid sharding) for Megatron models.

Library use::

    for layer in model.decoder.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())  # any optimizer; or, the fast path:
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()), model)

or, for a Megatron model from a `DistributedDataParallelConfig`, `FullyShardedDataParallel`.
"""

from megatron.core.distributed.expert_parallel import is_expert_param
from megatron.core.distributed.fsdp.dbuffer import DBuffer, ShardLayout
from megatron.core.distributed.fsdp.distributed_index import FSDPDistributedIndex, ShardGroups
from megatron.core.distributed.fsdp.fsdp_module import FsdpModule, fully_shard
from megatron.core.distributed.fsdp.gradients import GradState
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.microbatch import (
    accumulation_memory,
    fsdp_contexts,
    fsdp_roots,
    microbatch,
    set_profiler_labels,
    unit_memory,
)
from megatron.core.distributed.fsdp.mixed_precision import MixedPrecisionPolicy
from megatron.core.distributed.fsdp.optimizer import (
    fully_shard_optimizer,
    local_main_weights,
    parameter_groups,
)
from megatron.core.distributed.fsdp.overlap import OverlapPolicy
from megatron.core.distributed.fsdp.param_group import FsdpParameterGroup
from megatron.core.distributed.fsdp.strategy import ShardingStrategy

__all__ = [
    "DBuffer",
    "FSDPDistributedIndex",
    "FsdpModule",
    "FsdpParameterGroup",
    "FullyShardedDataParallel",
    "GradState",
    "MixedPrecisionPolicy",
    "OverlapPolicy",
    "ShardGroups",
    "ShardLayout",
    "ShardingStrategy",
    "accumulation_memory",
    "fsdp_contexts",
    "fsdp_roots",
    "fully_shard",
    "fully_shard_optimizer",
    "is_expert_param",
    "local_main_weights",
    "microbatch",
    "parameter_groups",
    "set_profiler_labels",
    "unit_memory",
]
