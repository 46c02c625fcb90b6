"""What Megatron-FSDP shards: the ZeRO stages and their hybrid (two-level) variants.

Over the shard group (dp, or dp x cp) of size N:

| `ShardingStrategy`   | ZeRO | compute weights | gradients             | main weights, optimizer |
|----------------------|------|-----------------|-----------------------|-------------------------|
| `no_shard`           | 0    | replicated      | all-reduced per step  | replicated              |
| `optim`              | 1    | replicated      | all-reduced per step  | 1/N                     |
| `optim_grads`        | 2    | replicated      | reduce-scattered, 1/N | 1/N                     |
| `optim_grads_params` | 3    | 1/N             | reduce-scattered, 1/N | 1/N                     |

With an outer group of R replicas (hybrid sharding), the shard group is one replica and
(`OuterShardingStrategy`): `no_shard` (HSDP) all-reduces gradients over the replicas at the end
of the last microbatch; `optim` (HFSDP, ZeRO-3 inside only) further shards main weights,
gradients handed to the optimizer and optimizer state over the R replicas (1/(N*R) each), with a
reduce-scatter over the replicas at the end and an all-gather over them after the step.

`ShardingPolicy` is the validated pair that the engine plans with. These are the only checks of
the strategy rules: `DistributedDataParallelConfig` builds a `ShardingPolicy` from its
`data_parallel_sharding_strategy` and `outer_dp_sharding_strategy` (Megatron-LM's names, whose
string values are the enums' values), and the training flags report its errors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class _Choice(str, enum.Enum):
    """A string-valued choice, equal to, hashed and printed as its value (`enum.StrEnum`, which
    Python 3.10 lacks)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


def _does_not_exist(field: str, value: object, choices: type[_Choice]) -> ValueError:
    return ValueError(
        f"{field}={value!r} does not exist; choose one of "
        f"{', '.join(choice.value for choice in choices)}."
    )


class ShardingStrategy(_Choice):
    """What is sharded over the shard group (the ZeRO stage). The values are Megatron-LM's
    `data_parallel_sharding_strategy` strings, which convert: `ShardingStrategy("optim")`.

    Raises:
        ValueError: converting a string that is none of the values.
    """

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @classmethod
    def _missing_(cls, value: object) -> ShardingStrategy:
        raise _does_not_exist("data_parallel_sharding_strategy", value, cls)

    @property
    def shards_optimizer(self) -> bool:
        """Main weights and optimizer state are sharded over the shard group (ZeRO >= 1)."""
        return self is not ShardingStrategy.NO_SHARD

    @property
    def shards_grads(self) -> bool:
        """Gradients are reduce-scattered in every backward (ZeRO >= 2)."""
        return self in (ShardingStrategy.OPTIM_GRADS, ShardingStrategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_params(self) -> bool:
        """Compute weights are sharded and gathered around each use (ZeRO-3)."""
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS


class OuterShardingStrategy(_Choice):
    """What is sharded over the outer group of replicas: nothing (HSDP) or, as well, the main
    weights and optimizer state (HFSDP). The values are Megatron-LM's
    `outer_dp_sharding_strategy` strings.

    Raises:
        ValueError: converting a string that is none of the values.
    """

    NO_SHARD = "no_shard"
    OPTIM = "optim"

    @classmethod
    def _missing_(cls, value: object) -> OuterShardingStrategy:
        raise _does_not_exist("outer_dp_sharding_strategy", value, cls)


@dataclass(frozen=True)
class ShardingPolicy:
    """A validated pair (inner strategy, outer strategy); strings convert to the enums.

    Attributes:
        strategy: what is sharded over the shard group.
        outer: what is sharded over the outer group; only meaningful with one.

    Raises:
        ValueError: a strategy does not exist, or HFSDP is asked for with a strategy other than
            `optim_grads_params`.
    """

    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
    outer: OuterShardingStrategy = OuterShardingStrategy.NO_SHARD

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", ShardingStrategy(self.strategy))
        object.__setattr__(self, "outer", OuterShardingStrategy(self.outer))
        if self.shards_outer and not self.strategy.shards_params:
            raise ValueError(
                f"outer_dp_sharding_strategy='optim' (HFSDP) requires "
                f"data_parallel_sharding_strategy='optim_grads_params', got "
                f"{self.strategy.value!r}."
            )

    @property
    def shards_optimizer(self) -> bool:
        """Main weights and optimizer state are sharded over the shard group (ZeRO >= 1)."""
        return self.strategy.shards_optimizer

    @property
    def shards_grads(self) -> bool:
        """Gradients are reduce-scattered in every backward (ZeRO >= 2)."""
        return self.strategy.shards_grads

    @property
    def shards_params(self) -> bool:
        """Compute weights are sharded and gathered around each use (ZeRO-3)."""
        return self.strategy.shards_params

    @property
    def shards_outer(self) -> bool:
        """Main weights are also sharded over the outer group (HFSDP)."""
        return self.outer is OuterShardingStrategy.OPTIM

    def check_outer_group(self, outer_size: int) -> None:
        """Raises if HFSDP is asked for without an outer group to shard over.

        Args:
            outer_size: the number of replicas in the outer group (1: none), the
                `num_distributed_optimizer_instances` of a config.
        """
        if self.shards_outer and outer_size < 2:
            raise ValueError(
                "outer_dp_sharding_strategy='optim' (HFSDP) needs an outer data-parallel group "
                "of two or more replicas: set num_distributed_optimizer_instances > 1 (or pass a "
                "DeviceMesh / pg_collection with an outer group), or use "
                "outer_dp_sharding_strategy='no_shard'."
            )
