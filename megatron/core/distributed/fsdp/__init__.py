"""Megatron-FSDP: fully sharded data parallelism (ZeRO-1/2/3, hybrid sharding) for Megatron models.

Library use::

    for layer in model.decoder.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())  # any optimizer; or, the fast path:
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()), model)

or, for a Megatron model from a `DistributedDataParallelConfig`, `FullyShardedDataParallel`.

Glossary (one name per thing, in the code and in `docs/`):

- *unit*: a module `fully_shard` made an FSDP unit (typically a transformer layer): its
  parameters are gathered and reduced together. The *root* is the outermost unit; its
  `FsdpContext` is shared by every unit under it (`context.py`).
- *parameter group*: the parameters of one unit that share dtype, trainability and
  expert-ness (`FsdpParameterGroup`); buffers and collectives are per group.
- *shard group*: the ranks a group's tensors are split over (dp, or dp x cp; one replica's
  ranks under hybrid sharding). *Outer group*: the replicas of a shard (hybrid sharding).
  `FSDPDistributedIndex` names both (`distributed_index.py`).
- *main weights*: what the optimizer steps, in `main_params_dtype` (fp32 by default), sharded as
  the strategy says: DTensors (`main_weights`), each with its local shard
  (`local_main_weights`); a unit's registered parameters between passes.
- *compute weights*: the unsharded weights the modules compute with, in the model's dtype (FP8
  bytes under `fp8_param_gather`), registered around each forward and backward.
- *unshard* / *reshard*: all-gather a unit's compute weights / free them (ZeRO-3). A unit whose
  use is over is *released*: resharded once the bound on units holding compute weights needs
  the room (`Residency`). *Refresh*: bring the compute weights' shard up to the main weights
  after an optimizer step (`Refresh`, `weights.py`).
- *main grads*: where a step's reduced gradients accumulate, in `main_grads_dtype`; the
  optimizer reads views of them, or of a buffer of its own (`GradViews`). *Sends*: the
  gradients in `grad_comm_dtype` a reduce-scatter reads (`SendBuffer`). *Deferred sums*: whole
  gradients summed across microbatches and reduced once per step (`DeferredSums`).
- *free* a buffer: give its storage back now (`DBuffer.free_storage`); its views stay valid
  objects, read again only after `reallocate_storage`.
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
