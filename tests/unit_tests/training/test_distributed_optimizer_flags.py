"""`--use-distributed-optimizer`: parsed as upstream's flag, reaching the DDP config, accepted
with Megatron-FSDP, and upstream's rule for `--overlap-param-gather` with it."""

from __future__ import annotations

import pytest

from megatron.training.arguments import get_megatron_ddp_config
from tests.unit_tests.training.flag_checks import validated as validated_on


def validated(*flags: str):
    return validated_on(*flags, world_size=4)


def test_off_by_default_as_upstream():
    args = validated()
    assert args.use_distributed_optimizer is False
    assert get_megatron_ddp_config(args).use_distributed_optimizer is False


def test_reaches_the_ddp_config_of_the_ddp_engine():
    config = get_megatron_ddp_config(validated("--use-distributed-optimizer"))
    assert config.use_distributed_optimizer is True
    assert config.use_megatron_fsdp is False


def test_accepted_with_megatron_fsdp_without_changing_its_sharding():
    plain = get_megatron_ddp_config(validated("--use-megatron-fsdp"))
    both = get_megatron_ddp_config(validated("--use-megatron-fsdp", "--use-distributed-optimizer"))
    assert both.use_megatron_fsdp is True
    assert both.data_parallel_sharding_strategy == plain.data_parallel_sharding_strategy


def test_overlap_param_gather_is_accepted_with_it_and_overlap_grad_reduce():
    args = validated(
        "--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce"
    )
    config = get_megatron_ddp_config(args)
    assert config.overlap_param_gather and config.use_distributed_optimizer


def test_overlap_param_gather_needs_overlap_grad_reduce():
    with pytest.raises(ValueError, match="--overlap-grad-reduce"):
        validated("--use-distributed-optimizer", "--overlap-param-gather")


def test_overlap_param_gather_without_it_still_needs_megatron_fsdp():
    with pytest.raises(ValueError, match="--overlap-param-gather needs Megatron-FSDP"):
        validated("--overlap-param-gather", "--overlap-grad-reduce")
