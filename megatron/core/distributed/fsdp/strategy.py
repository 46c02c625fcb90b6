"""What Megatron-FSDP shards: the ZeRO stages and their hybrid (two-level) variants.

Over the shard group (dp, or dp x cp) of size N:

| strategy             | ZeRO | model weights | gradients                | main weights, optimizer |
|----------------------|------|---------------|--------------------------|-------------------------|
| `no_shard`           | 0    | replicated    | all-reduced once a step  | replicated              |
| `optim`              | 1    | replicated    | all-reduced once a step  | 1/N                     |
| `optim_grads`        | 2    | replicated    | reduce-scattered, 1/N    | 1/N                     |
| `optim_grads_params` | 3    | 1/N           | reduce-scattered, 1/N    | 1/N                     |

With an outer group of R replicas (hybrid sharding), the shard group is one replica and:
`outer_dp_sharding_strategy="no_shard"` (HSDP) all-reduces gradients over the replicas at the end
of the last microbatch; `"optim"` (HFSDP, ZeRO-3 inside only) further shards main weights,
gradients handed to the optimizer and optimizer state over the R replicas (1/(N*R) each), with a
reduce-scatter over the replicas at the end and an all-gather over them after the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.distributed.distributed_data_parallel_config import (
    OUTER_SHARDING_STRATEGIES,
    SHARDING_STRATEGIES,
)


@dataclass(frozen=True)
class ShardingStrategy:
    """A validated pair (inner strategy, outer strategy).

    Attributes:
        name: one of `SHARDING_STRATEGIES`.
        outer: one of `OUTER_SHARDING_STRATEGIES`; only meaningful with an outer group.
    """

    name: str = "optim_grads_params"
    outer: str = "no_shard"

    def __post_init__(self) -> None:
        if self.name not in SHARDING_STRATEGIES:
            raise ValueError(
                f"data_parallel_sharding_strategy={self.name!r} does not exist; choose one of "
                f"{', '.join(SHARDING_STRATEGIES)}."
            )
        if self.outer not in OUTER_SHARDING_STRATEGIES:
            raise ValueError(
                f"outer_dp_sharding_strategy={self.outer!r} does not exist; choose one of "
                f"{', '.join(OUTER_SHARDING_STRATEGIES)}."
            )
        if self.outer == "optim" and self.name != "optim_grads_params":
            raise ValueError(
                f"outer_dp_sharding_strategy='optim' (HFSDP) requires "
                f"data_parallel_sharding_strategy='optim_grads_params', got {self.name!r}."
            )

    @property
    def shards_optimizer(self) -> bool:
        """Main weights and optimizer state are sharded over the shard group (ZeRO >= 1)."""
        return self.name != "no_shard"

    @property
    def shards_grads(self) -> bool:
        """Gradients are reduce-scattered in every backward (ZeRO >= 2)."""
        return self.name in ("optim_grads", "optim_grads_params")

    @property
    def shards_params(self) -> bool:
        """Model weights are sharded and gathered around each use (ZeRO-3)."""
        return self.name == "optim_grads_params"

    @property
    def shards_outer(self) -> bool:
        """Main weights are also sharded over the outer group (HFSDP)."""
        return self.outer == "optim"

    def check_outer_group(self, outer_size: int) -> None:
        """Raises if HFSDP is asked for without an outer group to shard over."""
        if self.shards_outer and outer_size < 2:
            raise ValueError(
                "outer_dp_sharding_strategy='optim' (HFSDP) needs an outer data-parallel group "
                "of two or more replicas: set num_distributed_optimizer_instances > 1 (or pass a "
                "DeviceMesh / pg_collection with an outer group), or use "
                "outer_dp_sharding_strategy='no_shard'."
            )
