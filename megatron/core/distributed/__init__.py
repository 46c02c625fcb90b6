"""Data-parallel engines: plain DDP (the reference) and Megatron-FSDP (`fsdp/`)."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig"]
