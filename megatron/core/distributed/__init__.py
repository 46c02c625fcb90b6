"""Data-parallel engines: plain DDP (the reference) and Megatron-FSDP (`fsdp/`)."""

from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel


def data_parallel_class(ddp_config: DistributedDataParallelConfig) -> type[_BaseDataParallel]:
    """The wrapper `ddp_config` selects: `FullyShardedDataParallel` when `use_megatron_fsdp`,
    else `DistributedDataParallel`. Both take (config, ddp_config, module, ...)."""
    if ddp_config.use_megatron_fsdp:
        return FullyShardedDataParallel
    return DistributedDataParallel


__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "FullyShardedDataParallel",
    "data_parallel_class",
]
