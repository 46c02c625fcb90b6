"""The engine's policies (`ShardingStrategy`, `ShardingPolicy`, `MixedPrecisionPolicy`) are the
one check of their rules: `DistributedDataParallelConfig`, `fully_shard` and the flags raise the
policy's own error (renamed to their fields or flags), from the same function, once."""

from __future__ import annotations

import ast
import inspect
import types

import pytest
import torch

from megatron.core.distributed.distributed_data_parallel_config import (
    OUTER_SHARDING_STRATEGIES,
    SHARDING_STRATEGIES,
    DistributedDataParallelConfig,
)
from megatron.core.distributed.fsdp import fsdp_module, mixed_precision, strategy
from megatron.core.distributed.fsdp.fsdp_module import fully_shard
from megatron.core.distributed.fsdp.mixed_precision import MixedPrecisionPolicy
from megatron.core.distributed.fsdp.strategy import (
    OuterShardingStrategy,
    ShardingPolicy,
    ShardingStrategy,
)
from tests.unit_tests.training.flag_checks import FSDP, ZERO3, validated

FSDP_CONFIG = {"use_megatron_fsdp": True}


def _raised(call) -> ValueError:
    with pytest.raises(ValueError) as info:
        call()
    return info.value


def _origin(error: BaseException) -> types.CodeType:
    """The code that raised the first error of `error`'s chain (the one it was raised from)."""
    while error.__cause__ is not None:
        error = error.__cause__
    trace = error.__traceback__
    while trace.tb_next is not None:
        trace = trace.tb_next
    return trace.tb_frame.f_code


def _as_config(message: str) -> str:
    """A `MixedPrecisionPolicy` message as the config words it: its own fields' names."""
    message = message.replace("MixedPrecisionPolicy.", "DistributedDataParallelConfig.")
    for name in ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
        message = message.replace(f".{name}", f".megatron_fsdp_{name}")
    return message


# (rule, the policy's own raise, the config's, fully_shard's or None, the function that raises)
RULES = {
    "strategy choice": (
        lambda: ShardingStrategy("zero3"),
        lambda: DistributedDataParallelConfig(data_parallel_sharding_strategy="zero3"),
        lambda: fully_shard(torch.nn.Linear(2, 2), sharding_strategy="zero3"),
        ShardingStrategy._missing_,
    ),
    "outer choice": (
        lambda: OuterShardingStrategy("full"),
        lambda: DistributedDataParallelConfig(**FSDP_CONFIG, outer_dp_sharding_strategy="full"),
        lambda: fully_shard(torch.nn.Linear(2, 2), outer_dp_sharding_strategy="full"),
        OuterShardingStrategy._missing_,
    ),
    "HFSDP needs ZeRO-3": (
        lambda: ShardingPolicy("optim_grads", "optim"),
        lambda: DistributedDataParallelConfig(
            **FSDP_CONFIG,
            data_parallel_sharding_strategy="optim_grads",
            outer_dp_sharding_strategy="optim",
            num_distributed_optimizer_instances=2,
        ),
        lambda: fully_shard(
            torch.nn.Linear(2, 2),
            sharding_strategy="optim_grads",
            outer_dp_sharding_strategy="optim",
        ),
        ShardingPolicy.__post_init__,
    ),
    "HFSDP needs an outer group": (
        lambda: ShardingPolicy("optim_grads_params", "optim").check_outer_group(1),
        lambda: DistributedDataParallelConfig(
            **FSDP_CONFIG,
            data_parallel_sharding_strategy="optim_grads_params",
            outer_dp_sharding_strategy="optim",
        ),
        None,  # fully_shard calls the same check with its groups (test_fully_shard's "hfsdp")
        ShardingPolicy.check_outer_group,
    ),
    "dtype allow-list": (
        lambda: MixedPrecisionPolicy(main_grads_dtype=torch.int8),
        lambda: DistributedDataParallelConfig(megatron_fsdp_main_grads_dtype=torch.int8),
        None,
        MixedPrecisionPolicy.__post_init__,
    ),
    "fp16 main weights": (
        lambda: MixedPrecisionPolicy(main_params_dtype=torch.float16),
        lambda: DistributedDataParallelConfig(
            **FSDP_CONFIG, megatron_fsdp_main_params_dtype=torch.float16
        ),
        None,
        MixedPrecisionPolicy.__post_init__,
    ),
    "transposes need fp8_param_gather": (
        lambda: MixedPrecisionPolicy(keep_fp8_transpose_cache=True),
        lambda: DistributedDataParallelConfig(**FSDP_CONFIG, keep_fp8_transpose_cache=True),
        None,
        MixedPrecisionPolicy.__post_init__,
    ),
}


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_is_raised_by_its_policy_for_every_caller(rule):
    policy_call, config_call, fully_shard_call, checker = RULES[rule]
    policy_error = _raised(policy_call)
    config_error = _raised(config_call)
    assert _origin(policy_error) is checker.__code__
    assert _origin(config_error) is checker.__code__
    assert str(config_error) == _as_config(str(policy_error))
    if fully_shard_call is not None:
        shard_error = _raised(fully_shard_call)
        assert _origin(shard_error) is checker.__code__
        assert str(shard_error) == str(policy_error)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            f"{ZERO3} --outer-dp-sharding-strategy optim",
            "--outer-dp-sharding-strategy optim (HFSDP) needs an outer data-parallel group of "
            "two or more replicas: set --num-distributed-optimizer-instances > 1",
        ),
        (
            f"{FSDP} --data-parallel-sharding-strategy optim --outer-dp-sharding-strategy optim "
            "--num-distributed-optimizer-instances 2",
            "--outer-dp-sharding-strategy optim (HFSDP) requires "
            "--data-parallel-sharding-strategy optim_grads_params, got 'optim'.",
        ),
        (
            f"--fp16 {FSDP} --megatron-fsdp-main-params-dtype fp16",
            "--megatron-fsdp-main-params-dtype fp16 is not supported: fp16 main weights lose "
            "small updates",
        ),
        (
            f"{FSDP} --fp8-format hybrid --keep-fp8-transpose-cache",
            "--keep-fp8-transpose-cache keeps the transposes of the FP8 weights that "
            "--fp8-param-gather keeps",
        ),
        (
            f"{FSDP} --grad-reduce-in-fp32 --megatron-fsdp-main-grads-dtype bf16",
            "--grad-reduce-in-fp32 contradicts --megatron-fsdp-main-grads-dtype bf16: gradients "
            "accumulate in one dtype",
        ),
        (
            f"{FSDP} --accumulate-allreduce-grads-in-fp32 --megatron-fsdp-main-grads-dtype bf16",
            "--accumulate-allreduce-grads-in-fp32 contradicts --megatron-fsdp-main-grads-dtype "
            "bf16: gradients accumulate in one dtype",
        ),
    ],
)
def test_flags_report_the_policy_rule_once_naming_the_flags(flags, message):
    error = _raised(lambda: validated(*flags.split()))
    # One error, not the rule again in the flags' own words.
    assert str(error).startswith(message), str(error)
    assert "flag errors" not in str(error)


def test_grad_reduce_in_fp32_contradiction_is_the_configs_rule():
    error = _raised(
        lambda: DistributedDataParallelConfig(
            **FSDP_CONFIG, grad_reduce_in_fp32=True, megatron_fsdp_main_grads_dtype=torch.bfloat16
        )
    )
    assert _origin(error) is DistributedDataParallelConfig.mixed_precision_policy.__code__
    assert "grad_reduce_in_fp32=True contradicts megatron_fsdp_main_grads_dtype" in str(error)


def test_the_config_builds_the_policies_the_engine_shards_with():
    config = DistributedDataParallelConfig(
        **FSDP_CONFIG,
        data_parallel_sharding_strategy="optim_grads_params",
        outer_dp_sharding_strategy="optim",
        num_distributed_optimizer_instances=2,
        grad_reduce_in_fp32=True,
        megatron_fsdp_main_params_dtype=torch.bfloat16,
        megatron_fsdp_grad_comm_dtype=torch.bfloat16,
    )
    assert config.data_parallel_sharding_strategy == "optim_grads_params"  # kept as given
    assert config.sharding_policy() == ShardingPolicy(
        ShardingStrategy.OPTIM_GRADS_PARAMS, OuterShardingStrategy.OPTIM
    )
    assert config.mixed_precision_policy() == MixedPrecisionPolicy(
        main_params_dtype=torch.bfloat16,
        main_grads_dtype=torch.float32,  # grad_reduce_in_fp32
        grad_comm_dtype=torch.bfloat16,
    )
    # An enum member is accepted where Megatron-LM's string is, and is equal to it.
    zero1 = DistributedDataParallelConfig(
        **FSDP_CONFIG, data_parallel_sharding_strategy=ShardingStrategy.OPTIM
    )
    assert zero1.sharding_policy().strategy is ShardingStrategy.OPTIM


def test_strategy_values_are_megatron_lms_strings():
    assert SHARDING_STRATEGIES == ("no_shard", "optim", "optim_grads", "optim_grads_params")
    assert OUTER_SHARDING_STRATEGIES == ("no_shard", "optim")
    for name in SHARDING_STRATEGIES:
        member = ShardingStrategy(name)
        assert member == name and str(member) == name and f"{member}" == name
    zero = [(s.shards_optimizer, s.shards_grads, s.shards_params) for s in ShardingStrategy]
    assert zero == [(False,) * 3, (True, False, False), (True, True, False), (True,) * 3]


def test_the_policies_do_not_import_the_config():
    """The config module imports from the engine's policy modules, not the reverse."""
    for module in (strategy, mixed_precision, fsdp_module):
        imported = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        assert not any(
            name.endswith("distributed_data_parallel_config")
            or name.startswith("megatron.training")
            for name in imported
        ), module.__name__
