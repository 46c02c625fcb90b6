"""Starts a training job: reads the flags, joins the process group, builds the process groups of
`parallel_state` and seeds the random generators (Megatron-LM's `initialize_megatron`).

Launched by torchrun, every process joins the default group from torchrun's environment
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...): NCCL bound to the GPU `LOCAL_RANK` names, or gloo on
CPU (`--distributed-backend`). Without torchrun the job is a world of one. A default group that
already exists (a test harness, a notebook) is reused as it is.
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import random
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.training.arguments import get_parallel_state_kwargs, parse_args, validate_args
from megatron.training.determinism import apply_deterministic_mode, restore_nondeterministic_mode
from megatron.training.flag_errors import InvalidFlagsError
from megatron.training.flag_groups.logs import set_logging_level
from megatron.training.flag_groups.unbuilt import TOKENIZER_UNBUILT, UNBUILT, unbuilt_dests
from megatron.training.global_vars import build_tokenizer, set_args, unset_tokenizer
from megatron.training.read_only_args import ReadOnlyArguments
from megatron.training.utils import get_device, logger, print_rank_0

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def initialize_megatron(
    extra_args_provider: ExtraArgsProvider | None = None,
    args_defaults: dict[str, Any] | None = None,
    ignore_unknown_args: bool = False,
    argv: list[str] | None = None,
) -> argparse.Namespace:
    """Parses and validates the flags, builds the tokenizer, joins the default process group,
    creates the `parallel_state` groups and seeds every random generator.

    Args:
        extra_args_provider: Adds a script's own flags (see `parse_args`).
        args_defaults: A script's defaults for any flag (dest name -> value); the command line
            still overrides them.
        ignore_unknown_args: Ignore flags nobody defined instead of exiting with an error.
        argv: The flags; None reads `sys.argv[1:]`.

    Returns:
        The validated arguments, also available from `get_args()`: read-only
        (`ReadOnlyArguments`), as every reader must see the same values; training progress
        lives in a `TrainState`.

    Raises:
        InvalidFlagsError: a flag is bad (before any process group is created; a `ValueError`).
        ValueError: the default group that already exists disagrees with
            `--distributed-backend`.
        RuntimeError: the `parallel_state` groups exist already.
    """
    provider = _with_defaults(extra_args_provider, args_defaults or {})
    args = parse_args(provider, ignore_unknown_args, args=argv)
    try:
        # A default group that exists already fixes the world size; otherwise torchrun's does.
        validate_args(args, world_size=dist.get_world_size() if dist.is_initialized() else None)
        build_tokenizer(args)  # sets --padded-vocab-size; its errors come before any group exists
    except ValueError as error:
        raise InvalidFlagsError(str(error)) from error
    args = ReadOnlyArguments.frozen_copy(args)
    set_args(args)
    setup_logging()
    set_logging_level(args)
    if args.deterministic_mode:
        # Before the process group: NCCL and cuBLAS read the environment when they start.
        apply_deterministic_mode()
    _initialize_distributed(args)
    parallel_state.initialize_model_parallel(**get_parallel_state_kwargs(args))
    _set_random_seed(args.seed)
    if args.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print_rank_0(
        f"> initialized {args.distributed_backend} on {args.world_size} rank(s) "
        f"({get_device().type}): tensor-parallel size {args.tensor_model_parallel_size}, "
        f"data-parallel size {args.data_parallel_size}, "
        f"context-parallel size {args.context_parallel_size}"
    )
    print_rank_0(_format_args(args))
    return args


def destroy_megatron(destroy_default_group: bool) -> None:
    """Tears down what `initialize_megatron()` and the training loop created, so another job
    can start in-process.

    Args:
        destroy_default_group: Also leave the default process group (when this job created it,
            not when it reused one).
    """
    parallel_state.destroy_model_parallel()
    if destroy_default_group and dist.is_initialized():
        dist.destroy_process_group()
    set_args(None)
    unset_tokenizer()
    restore_nondeterministic_mode()
    # Process-wide MoE state the training loop set: the next job or model starts from defaults.
    destroy_moe_metrics_tracker()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(()))


def setup_logging() -> None:
    """Makes the training loop's messages visible: level INFO unless the application chose one,
    and a timestamped stdout handler unless it attached handlers of its own."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    # Our handler prints them already: a root handler would print every line twice.
    logger.propagate = False


def _with_defaults(
    extra_args_provider: ExtraArgsProvider | None, args_defaults: dict[str, Any]
) -> ExtraArgsProvider:
    """`extra_args_provider`, then `args_defaults` made the parser's defaults."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        if args_defaults:
            # Every flag of Megatron's parser is optional, so parsing nothing lists them all.
            known = vars(parser.parse_known_args([])[0])
            unknown = sorted(set(args_defaults) - set(known))
            if unknown:
                raise ValueError(
                    f"args_defaults names {unknown}, which are no flag's destination; use the "
                    "flags' dest names (e.g. 'micro_batch_size' for --micro-batch-size)."
                )
            parser.set_defaults(**args_defaults)
        return parser

    return provider


def _initialize_distributed(args: argparse.Namespace) -> None:
    """Joins (or reuses) the default process group of `--distributed-backend`."""
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != args.distributed_backend:
            raise ValueError(
                f"--distributed-backend {args.distributed_backend}, but the process group "
                f"that already exists uses {backend}; pass --distributed-backend {backend}."
            )
        return
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    rendezvous = default_rendezvous()
    if args.distributed_backend == "gloo":
        dist.init_process_group("gloo", timeout=timeout, **rendezvous)
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"--distributed-backend nccl: LOCAL_RANK {local_rank} has no GPU (this node has "
            f"{torch.cuda.device_count()}); start at most one process per GPU, or use "
            "--distributed-backend gloo."
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    # Binding the device lets NCCL create its communicators eagerly, on the right GPU.
    dist.init_process_group("nccl", timeout=timeout, device_id=device, **rendezvous)


def default_rendezvous() -> dict[str, Any]:
    """torchrun's environment (the default), or a world of one on a free local port."""
    if "WORLD_SIZE" in os.environ:
        return {}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return dict(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _set_random_seed(seed: int) -> None:
    """The same seed on every rank: identical initial weights, which the DDP engine needs and
    from which Megatron-FSDP materialises each rank's shards. The RNG tracker's
    model-parallel state (dropout inside tensor-parallel regions) differs per tp rank."""
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    numpy.random.seed(seed)
    # Dropout draws from the generator of the device the model computes on (the CPU's on gloo
    # ranks, GPUs present or not).
    model_parallel_cuda_manual_seed(seed, device_type=get_device().type)


def _format_args(args: argparse.Namespace) -> str:
    """Every argument, one per line, as Megatron-LM prints them at start-up; enum values by
    the names the flags take. Those of features not built are left out: validation refused
    any that was set, so they all hold their defaults."""
    unbuilt = unbuilt_dests(UNBUILT + TOKENIZER_UNBUILT)
    lines = ["------------------------ arguments ------------------------"]
    for name, value in sorted(vars(args).items()):
        if name in unbuilt:
            continue
        shown = value.name if isinstance(value, enum.Enum) else value
        lines.append(f"  {name} {'.' * (48 - len(name))} {shown}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
