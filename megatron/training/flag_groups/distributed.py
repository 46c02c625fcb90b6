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
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Ranks that split each layer's weights (TP); data-parallel size = world / (TP x CP).",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Split the activations outside the TP GEMMs along the sequence (TP > 1; off at 1).",
    )
    group.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Ranks that split each sequence (CP); parameters shard over data x context ranks.",
    )
    group.add_argument(
        "--cp-comm-type",
        nargs="+",
        default=["p2p"],
        help="Context-parallel attention: p2p (ring), a2a (all-to-all) or allgather; one value.",
    )
    group.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Ranks that split the experts of each MoE layer (EP).",
    )
    group.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        help="Ranks that split each expert's weights (ETP); unset: the tensor-parallel size.",
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
        "--overlap-param-gather",
        action="store_true",
        help="Megatron-FSDP: prefetch all-gathers (accepted with --use-distributed-optimizer).",
    )
    group.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="DDP engine: shard optimizer state and main weights over data-parallel ranks.",
    )
    group.add_argument("--ddp-bucket-size", type=int, help="DDP engine; None: automatic.")
    group.add_argument("--ddp-average-in-collective", action="store_true", help="ReduceOp.AVG.")
    group.add_argument("--use-megatron-fsdp", action="store_true", help="Megatron-FSDP engine.")
    group.add_argument(
        "--data-parallel-sharding-strategy",
        default="optim_grads_params",
        choices=SHARDING_STRATEGIES,
        help="Megatron-FSDP: ZeRO-0/1/2/3 (no_shard/optim/optim_grads/optim_grads_params).",
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
    group.add_argument(
        "--suggested-communication-unit-size",
        type=int,
        default=None,
        help="Megatron-FSDP: parameter elements per unit; consecutive layers are gathered and "
        "reduced together up to this many (default: one layer per unit).",
    )
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
        "--megatron-fsdp-keep-unsharded-params",
        action="store_true",
        help="ZeRO-3 with gradient accumulation: gather each layer once per step and hold "
        "every layer's compute weights until the last microbatch's backward (more memory).",
    )
    group.add_argument(
        "--megatron-fsdp-accumulate-unsharded-grads",
        action="store_true",
        help="ZeRO-2/3 with gradient accumulation: sum whole gradients and reduce-scatter once "
        "per step, in the last microbatch (more memory).",
    )
    group.add_argument(
        "--init-model-with-meta-device",
        action="store_true",
        help="Build on meta; Megatron-FSDP materialises shards.",
    )


def validate_distributed(args: argparse.Namespace) -> None:
    """Refuses a `--distributed-timeout-minutes` below 1 and a `--data-parallel-sharding-strategy`
    other than its default without `--use-megatron-fsdp` (the DDP engine does not shard, so the
    value would be ignored), and applies upstream's rule for `--overlap-param-gather` with the
    distributed optimizer.

    The default (`optim_grads_params`, Megatron-LM's) cannot be told from the same value given
    explicitly; the DDP engine ignores it, as Megatron-LM's does. `--use-distributed-optimizer`
    with `--use-megatron-fsdp` is accepted and changes nothing (the sharding strategy already
    says what is sharded); upstream's Megatron-FSDP requires it.

    Raises:
        ValueError: a sharding strategy is chosen for the DDP engine,
            `--overlap-param-gather` with the DDP engine's distributed optimizer but without
            `--overlap-grad-reduce`, or `--distributed-timeout-minutes` below 1.
    """
    if args.distributed_timeout_minutes < 1:
        # Else the rendezvous fails at once, blaming the network (DistNetworkError: "timed out
        # after 0ms while trying to connect").
        raise ValueError(
            f"--distributed-timeout-minutes {args.distributed_timeout_minutes} must be >= 1: "
            "how long a collective may wait for the other ranks before the job fails."
        )
    if args.use_megatron_fsdp:
        return
    default = "optim_grads_params"
    if args.data_parallel_sharding_strategy != default:
        raise ValueError(
            f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} needs "
            "Megatron-FSDP: add --use-megatron-fsdp or drop --data-parallel-sharding-strategy."
        )
    gather = args.use_distributed_optimizer and args.overlap_param_gather
    if gather and not args.overlap_grad_reduce:
        raise ValueError(
            "--overlap-param-gather with --use-distributed-optimizer needs --overlap-grad-reduce "
            "(as in Megatron-LM): add --overlap-grad-reduce or drop --overlap-param-gather."
        )
