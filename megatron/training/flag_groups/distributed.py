"""Distributed flags: parallel sizes, the data-parallel engine and its options."""

from __future__ import annotations

import argparse

from megatron.core.distributed.distributed_data_parallel_config import (
    OUTER_SHARDING_STRATEGIES,
    SHARDING_STRATEGIES,
)
from megatron.training.configs_from_args import FSDP_DTYPES


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """The "distributed" group: parallel sizes and the data-parallel engine."""
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Only 1.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Only 1.")
    group.add_argument("--context-parallel-size", type=int, default=1, help="Only 1 for now.")
    group.add_argument(
        "--expert-model-parallel-size", type=int, default=1, help="Only 1 (no MoE layers yet)."
    )
    group.add_argument(
        "--distributed-backend", default="nccl", choices=("nccl", "gloo"), help="gloo on CPU."
    )
    group.add_argument(
        "--distributed-timeout-minutes", type=int, default=10, help="Collective timeout."
    )
    group.add_argument(
        "--overlap-grad-reduce", action="store_true", help="Reduce gradients during backward."
    )
    group.add_argument(
        "--overlap-param-gather", action="store_true", help="Megatron-FSDP: prefetch all-gathers."
    )
    group.add_argument("--ddp-bucket-size", type=int, help="DDP engine; None: automatic.")
    group.add_argument("--ddp-average-in-collective", action="store_true", help="ReduceOp.AVG.")
    group.add_argument("--use-megatron-fsdp", action="store_true", help="Megatron-FSDP engine.")
    group.add_argument(
        "--data-parallel-sharding-strategy",
        default="no_shard",
        choices=SHARDING_STRATEGIES,
        help="ZeRO-0/1/2/3.",
    )
    group.add_argument(
        "--outer-dp-sharding-strategy",
        default="no_shard",
        choices=OUTER_SHARDING_STRATEGIES,
        help="HSDP (no_shard) or HFSDP (optim).",
    )
    group.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="Outer replicas (HSDP / HFSDP).",
    )
    group.add_argument(
        "--fsdp-all-gather-in-start-param-sync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Off for CUDA-graph capture.",
    )
    group.add_argument(
        "--create-all-gather-group", action="store_true", help="Separate all-gather communicator."
    )
    group.add_argument("--use-symm-mem", action="store_true", help="CUDA and NCCL only.")
    dtypes = tuple(FSDP_DTYPES)
    group.add_argument(
        "--megatron-fsdp-main-params-dtype",
        default="fp32",
        choices=dtypes,
        help="Main (optimizer) weights.",
    )
    group.add_argument(
        "--megatron-fsdp-main-grads-dtype",
        default="auto",
        choices=dtypes,
        help="Gradient accumulation.",
    )
    group.add_argument(
        "--megatron-fsdp-grad-comm-dtype",
        default="auto",
        choices=dtypes,
        help="Gradient reduction.",
    )
    group.add_argument(
        "--init-model-with-meta-device",
        action="store_true",
        help="Build on meta; Megatron-FSDP materialises shards.",
    )
