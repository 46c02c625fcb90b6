"""`DistributedDataParallelConfig`: the switches of both data-parallel engines.

One config serves the plain DDP engine (`DistributedDataParallel`) and Megatron-FSDP
(`use_megatron_fsdp=True`), as in Megatron-LM, so a training script changes engines by changing
fields rather than classes. Field names and meanings follow Megatron-LM.

The Megatron-FSDP fields describe the engine's policies, which the config builds
(`sharding_policy()`, `mixed_precision_policy()`) when it is constructed: the policies check
their own rules (strategies, HFSDP, dtypes) and the config reports their errors under its field
names; it checks itself only what no policy sees (which engine reads a field, sizes, the
gradient-accumulation options, `grad_reduce_in_fp32` against the main-grads dtype).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.distributed.fsdp.mixed_precision import MixedPrecisionPolicy
from megatron.core.distributed.fsdp.strategy import (
    OuterShardingStrategy,
    ShardingPolicy,
    ShardingStrategy,
)

SHARDING_STRATEGIES = tuple(strategy.value for strategy in ShardingStrategy)
"""ZeRO stages by what they shard: nothing, optimizer state (ZeRO-1), + gradients (ZeRO-2),
+ parameters (ZeRO-3); the values of `ShardingStrategy`."""

OUTER_SHARDING_STRATEGIES = tuple(strategy.value for strategy in OuterShardingStrategy)
"""Over the outer (inter-replica) group: replicate (HSDP), or shard optimizer state (HFSDP); the
values of `OuterShardingStrategy`."""

_PRECISION_FIELDS = {
    "main_params_dtype": "megatron_fsdp_main_params_dtype",
    "main_grads_dtype": "megatron_fsdp_main_grads_dtype",
    "grad_comm_dtype": "megatron_fsdp_grad_comm_dtype",
}
"""`MixedPrecisionPolicy` fields whose config field has another name; the others share theirs."""


def _no_effect(default: Any) -> Any:
    """A Megatron-core field that only tunes speed here: any value, no effect."""
    return dataclasses.field(default=default, metadata={"no_effect": True})


def _unbuilt(default: Any, feature: str) -> Any:
    """A Megatron-core field asking for `feature`, which is not built: its default only."""
    return dataclasses.field(default=default, metadata={"unbuilt": feature})


@dataclass
class DistributedDataParallelConfig:
    """Configuration of data-parallel training (DDP or Megatron-FSDP)."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 even when parameters are bf16/fp16."""

    overlap_grad_reduce: bool = False
    """Reduce gradient buckets during backward as they become ready, instead of after it."""

    overlap_param_gather: bool = False
    """Megatron-FSDP: prefetch parameter all-gathers so they overlap compute. Accepted with the
    DDP engine's `use_distributed_optimizer`, whose all-gather still runs after the step."""

    use_distributed_optimizer: bool = False
    """DDP engine: reduce-scatter gradient buckets instead of all-reducing them, so that
    `get_megatron_optimizer` builds a distributed optimizer (ZeRO-1/2: main weights and
    optimizer state sharded over the data-parallel group, parameters all-gathered after each
    step). Megatron-FSDP accepts it and ignores it: its sharding strategy already shards."""

    num_distributed_optimizer_instances: int = 1
    """Number of outer data-parallel replicas (hybrid sharding). Each replica shards over
    dp_cp / num_distributed_optimizer_instances ranks; gradients are then reduced across
    replicas. 1 means one replica spanning the whole data-parallel group."""

    check_for_nan_in_grad: bool = False
    """Raise if a local gradient holds NaN or Inf, before it is communicated."""

    bucket_size: int | None = None
    """Maximum number of elements per gradient bucket. None: max(40M, 1M x dp size) when
    `overlap_grad_reduce`, else one bucket per dtype."""

    average_in_collective: bool = False
    """Average in the collective (ReduceOp.AVG) instead of pre-dividing by the data-parallel
    size and summing. Backends without AVG (gloo) sum and divide locally."""

    use_megatron_fsdp: bool = False
    """Use the Megatron-FSDP engine instead of plain DDP."""

    data_parallel_sharding_strategy: str = "no_shard"
    """Megatron-FSDP sharding over the (inner) data-parallel group; one of
    `SHARDING_STRATEGIES` (a `ShardingStrategy` value)."""

    outer_dp_sharding_strategy: str = "no_shard"
    """Megatron-FSDP sharding over the outer group when `num_distributed_optimizer_instances`
    > 1: 'no_shard' (HSDP) or 'optim' (HFSDP, optimizer state sharded over outer x inner); an
    `OuterShardingStrategy` value."""

    fsdp_all_gather_in_start_param_sync: bool = True
    """Megatron-FSDP: `start_param_sync()` issues the first unit's all-gather before the forward
    loop starts. Turn off for CUDA-graph capture; the first forward then gathers on demand."""

    use_symm_mem: bool = False
    """Megatron-FSDP: the whole compute weights live in persistent windows from PyTorch's NCCL
    symmetric-memory pool, where NCCL all-gathers them with its symmetric kernels (CUDA and
    NCCL >= 2.27 only; the windows' memory is held for the whole run)."""

    suggested_communication_unit_size: int | None = None
    """Megatron-FSDP: the number of parameter elements (per rank, before sharding) to gather
    and reduce at once. Consecutive transformer layers (of one parent) become one unit while
    their parameters total at most this many: one set of collectives and hooks per unit
    instead of per layer, for the memory of that many elements of compute weights (and
    gradients, while reduced) per unit, with two units held at once. None, or less than one
    layer: each layer is a unit of its own. Upstream Megatron-FSDP reads it as the size of its
    all-gather prefetch."""

    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    """Dtype of the main (optimizer) weights. None: the model weights are the main weights."""

    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    """Dtype of gradient accumulation. None: fp32 if `grad_reduce_in_fp32`, else the parameter
    dtype."""

    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    """Dtype gradients are communicated in. None: the main-grads dtype."""

    megatron_fsdp_keep_unsharded_params: bool = False
    """Megatron-FSDP, `optim_grads_params` only: under gradient accumulation each unit keeps its
    whole compute weights from their first all-gather in a step until the last microbatch's
    backward has used them (one all-gather per unit and step instead of two per microbatch), at
    the cost of holding every unit's compute weights at once (`accumulation_memory()`). Changes
    nothing in a step of one microbatch."""

    megatron_fsdp_accumulate_unsharded_grads: bool = False
    """Megatron-FSDP, `optim_grads` / `optim_grads_params` only: under gradient accumulation
    gradients are summed whole, in the main-grads dtype, and reduce-scattered once, in the last
    microbatch's backward (one reduce-scatter per unit and step instead of one per microbatch),
    at the cost of holding every unit's whole gradients from the first microbatch's backward to
    the last's (`accumulation_memory()`). Changes nothing in a step of one microbatch."""

    # Megatron-core's fields that only tune buckets, buffers or registration for speed: accepted
    # with any value and no effect, so that upstream code building this config runs
    # (`SPEED_ONLY_FIELDS`; the flags of a few are accepted likewise, `PERFORMANCE_HINTS`).
    num_buckets: int | None = _no_effect(None)
    align_param_gather: bool = _no_effect(False)
    fp8_param_gather: bool = False
    """All-gather the compute weights of the linear layers that train in FP8
    (`TransformerConfig.fp8`) as FP8 bytes with one scale per tensor, cast once per optimizer
    step from the main weights (half of bf16's all-gather traffic); the arithmetic is that of FP8
    training without it. Megatron-FSDP keeps them as FP8 too (half the whole-weight memory); the
    DDP engine gathers them so after its distributed optimizer's step, and needs
    `use_distributed_optimizer` (plain DDP all-reduces gradients and gathers no parameter)."""

    keep_fp8_transpose_cache: bool = False
    """Megatron-FSDP with `fp8_param_gather`: the transposed copy of each FP8 compute weight
    (the input-gradient GEMM's operand) is made once per optimizer step and kept until the
    next, instead of made in each backward that gathers the weight (ZeRO-3) and freed with it:
    one transpose per weight and step instead of one per microbatch, for 1 byte per element of
    the whole FP8 weights held for the whole step. ZeRO-0/1/2 keep the transposes that long
    anyway."""

    pad_buckets_for_high_nccl_busbw: bool = _no_effect(False)
    gradient_reduce_div_fusion: bool = _no_effect(True)
    nccl_ub: bool = _no_effect(False)
    fsdp_double_buffer: bool = _no_effect(False)
    fsdp_db_use_persist_buf_on_alloc_fail: bool = _no_effect(False)
    fsdp_manual_registration: bool = _no_effect(False)
    disable_symmetric_registration: bool = _no_effect(False)
    megatron_fsdp_max_pool_double_buffer: bool = _no_effect(False)
    megatron_fsdp_enable_fine_grained_param_gather: bool = _no_effect(False)

    # Megatron-core's fields of features not built here: refused unless at their defaults
    # (`UNBUILT_FIELDS`).
    check_for_large_grads: bool = _unbuilt(False, "a check of the local gradients for large values")
    reduce_scatter_with_fp32_accumulation: bool = _unbuilt(
        False, "fp32 accumulation inside the reduce-scatter (use grad_reduce_in_fp32)"
    )
    param_name_patterns_for_fp32_local_accumulation: tuple[str, ...] = _unbuilt(
        (), "fp32 local accumulation by name (use grad_reduce_in_fp32)"
    )
    fp4_param_gather: bool = _unbuilt(False, "FP4 parameter all-gathers")
    reuse_grad_buf_for_mxfp8_param_ag: bool = _unbuilt(False, "MXFP8 parameter all-gathers")
    use_custom_fsdp: bool = _unbuilt(False, "Megatron-FSDP by its old name (use use_megatron_fsdp)")
    delay_wgrad_compute: bool = _unbuilt(False, "delayed weight-gradient computation")
    megatron_fsdp_use_decoupled_grad: bool = _unbuilt(False, "decoupled Megatron-FSDP gradients")
    megatron_fsdp_cuda_graph_mode: bool = _unbuilt(
        False,
        "Megatron-FSDP's CUDA-graph mode (graph the whole iteration with --cuda-graph-impl local)",
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if "unbuilt" in field.metadata and value != field.default:
                raise ValueError(
                    f"DistributedDataParallelConfig.{field.name}={value!r} asks for "
                    f"{field.metadata['unbuilt']}, which is not built; leave it at its default."
                )
        # The engine's policies check their own rules (the choices of strategy, the dtypes);
        # building them here raises at construction, naming this config's fields.
        ShardingStrategy(self.data_parallel_sharding_strategy)
        OuterShardingStrategy(self.outer_dp_sharding_strategy)
        self.mixed_precision_policy()
        if self.num_distributed_optimizer_instances < 1:
            raise ValueError(
                "DistributedDataParallelConfig.num_distributed_optimizer_instances must be >= 1, "
                f"got {self.num_distributed_optimizer_instances}."
            )
        size = self.suggested_communication_unit_size
        if size is not None and size <= 0:
            raise ValueError(
                "DistributedDataParallelConfig.suggested_communication_unit_size must be a "
                f"positive number of elements or None (one layer per unit), got {size}."
            )
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(
                f"DistributedDataParallelConfig.bucket_size must be a positive number of "
                f"elements or None (automatic), got {self.bucket_size}."
            )
        if not self.use_megatron_fsdp:
            self._check_ddp_only()
            return
        self.sharding_policy().check_outer_group(self.num_distributed_optimizer_instances)
        self._check_accumulation_options()

    def sharding_policy(self) -> ShardingPolicy:
        """Megatron-FSDP's `ShardingPolicy` of `data_parallel_sharding_strategy` and
        `outer_dp_sharding_strategy`.

        Raises:
            ValueError: the policy refuses the pair (a strategy does not exist, or HFSDP with
                a strategy other than `optim_grads_params`).
        """
        return ShardingPolicy(self.data_parallel_sharding_strategy, self.outer_dp_sharding_strategy)

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """Megatron-FSDP's `MixedPrecisionPolicy` of the `megatron_fsdp_*_dtype` fields (main
        gradients in fp32 under `grad_reduce_in_fp32`), `fp8_param_gather` and
        `keep_fp8_transpose_cache`.

        Raises:
            ValueError: `grad_reduce_in_fp32` contradicts `megatron_fsdp_main_grads_dtype`, or
                the policy refuses the fields; the message names this config's fields.
        """
        main_grads_dtype = self.megatron_fsdp_main_grads_dtype
        try:
            policy = MixedPrecisionPolicy(
                main_params_dtype=self.megatron_fsdp_main_params_dtype,
                main_grads_dtype=(
                    torch.float32
                    if main_grads_dtype is None and self.grad_reduce_in_fp32
                    else main_grads_dtype
                ),
                grad_comm_dtype=self.megatron_fsdp_grad_comm_dtype,
                fp8_param_gather=self.fp8_param_gather,
                # Plain DDP refuses it by name (`_check_ddp_only`), for a fix that applies there.
                keep_fp8_transpose_cache=self.keep_fp8_transpose_cache and self.use_megatron_fsdp,
            )
        except ValueError as error:
            raise ValueError(_name_config_fields(str(error))) from error
        if self.grad_reduce_in_fp32 and main_grads_dtype not in (None, torch.float32):
            raise ValueError(
                f"grad_reduce_in_fp32=True contradicts megatron_fsdp_main_grads_dtype="
                f"{main_grads_dtype}: gradients accumulate in one dtype; set one of them only."
            )
        return policy

    def _check_accumulation_options(self) -> None:
        """Rejects an accumulation option for a strategy it would not change."""
        strategy = ShardingStrategy(self.data_parallel_sharding_strategy)
        if self.megatron_fsdp_keep_unsharded_params and not strategy.shards_params:
            raise ValueError(
                f"megatron_fsdp_keep_unsharded_params=True needs "
                f"data_parallel_sharding_strategy='optim_grads_params' (got {strategy.value!r}, "
                "whose compute weights are kept anyway): drop megatron_fsdp_keep_unsharded_params "
                "or shard the parameters."
            )
        if self.megatron_fsdp_accumulate_unsharded_grads and not strategy.shards_grads:
            raise ValueError(
                f"megatron_fsdp_accumulate_unsharded_grads=True needs sharded gradients, "
                f"data_parallel_sharding_strategy 'optim_grads' or 'optim_grads_params' (got "
                f"{strategy.value!r}, which accumulates whole gradients and reduces them once a "
                "step anyway): drop megatron_fsdp_accumulate_unsharded_grads."
            )

    def _check_ddp_only(self) -> None:
        """Rejects Megatron-FSDP options given to the plain DDP engine, which would ignore them."""
        if self.fp8_param_gather and not self.use_distributed_optimizer:
            # Megatron-LM refuses it too ("only supported with distributed optimizer").
            raise ValueError(
                "DistributedDataParallelConfig.fp8_param_gather=True needs "
                "use_distributed_optimizer=True or Megatron-FSDP (use_megatron_fsdp=True): the "
                "DDP engine without the distributed optimizer all-reduces gradients and gathers "
                "no parameter, so there is nothing to gather in FP8. Add one of them, or drop "
                "fp8_param_gather."
            )
        for field in dataclasses.fields(self):
            # The distributed optimizer gathers parameters too (after its step, not overlapped).
            if field.name == "overlap_param_gather" and self.use_distributed_optimizer:
                continue
            if field.name in _FSDP_ONLY_FIELDS and getattr(self, field.name) != field.default:
                raise ValueError(
                    f"DistributedDataParallelConfig.{field.name}={getattr(self, field.name)!r} "
                    "needs Megatron-FSDP: set use_megatron_fsdp=True, or leave it at its default "
                    f"({field.default!r}) for plain DDP."
                )


def _name_config_fields(message: str) -> str:
    """A `MixedPrecisionPolicy` error naming the config fields that set the policy's fields."""
    message = message.replace("MixedPrecisionPolicy.", "DistributedDataParallelConfig.")
    fields = "|".join(_PRECISION_FIELDS)
    return re.sub(rf"\b({fields})\b", lambda match: _PRECISION_FIELDS[match[1]], message)


_FSDP_ONLY_FIELDS = frozenset(
    {
        "overlap_param_gather",
        "num_distributed_optimizer_instances",
        "data_parallel_sharding_strategy",
        "outer_dp_sharding_strategy",
        "fsdp_all_gather_in_start_param_sync",
        "use_symm_mem",
        "suggested_communication_unit_size",
        "megatron_fsdp_main_params_dtype",
        "megatron_fsdp_main_grads_dtype",
        "megatron_fsdp_grad_comm_dtype",
        "megatron_fsdp_keep_unsharded_params",
        "megatron_fsdp_accumulate_unsharded_grads",
        "keep_fp8_transpose_cache",
    }
)
"""Fields only Megatron-FSDP reads."""

SPEED_ONLY_FIELDS = frozenset(
    field.name
    for field in dataclasses.fields(DistributedDataParallelConfig)
    if field.metadata.get("no_effect")
)
"""Megatron-core's fields that only tune buckets, buffers or registration: no effect here."""

UNBUILT_FIELDS = {
    field.name: field.metadata["unbuilt"]
    for field in dataclasses.fields(DistributedDataParallelConfig)
    if "unbuilt" in field.metadata
}
"""Megatron-core's fields of features not built here, by what they ask for: refused unless
left at their defaults."""
