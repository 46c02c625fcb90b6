"""Small helpers of the training loop: the compute device, rank-0 logging, loss averaging, data
iterators that can be closed, the memory cost of Megatron-FSDP's accumulation options."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from megatron.core import parallel_state
from megatron.core.distributed.fsdp import accumulation_memory, unit_memory

logger = logging.getLogger("megatron.training")
"""Everything the training loop reports goes through this logger or its child `report_logger`
(tests attach handlers here)."""

report_logger = logging.getLogger("megatron.training.report")
"""The training report: the iteration lines, the evaluations, where training stopped. Megatron-LM
prints these, so they show whatever `--logging-level` says; this logger has a level of its own,
which `--logging-level` leaves alone, and hands its records to `logger`'s handlers."""
report_logger.setLevel(logging.INFO)


def get_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, the CPU otherwise."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_rank_0() -> bool:
    """Whether this process reports for the job (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank_0(message: str, level: int = logging.INFO) -> None:
    """Logs `message` once for the job, from rank 0, at `level` (which `--logging-level` may
    hide). Every rank holds the same (reduced) values, so one reporting rank suffices;
    Megatron-LM's last rank plays this part only because of pipeline parallelism, which does not
    exist here."""
    if is_rank_0():
        logger.log(level, message)


def report_rank_0(message: str) -> None:
    """Writes a line of the training report once for the job, from rank 0 (see
    `report_logger`): shown at any `--logging-level`, as Megatron-LM's `print_rank_last`."""
    if is_rank_0():
        report_logger.info(message)


def average_losses_across_data_parallel_group(losses: torch.Tensor) -> torch.Tensor:
    """The mean of `losses` (any shape) over the data-parallel ranks, the same on every rank.

    The data x context group only: the tensor-parallel peers of a rank compute the same losses
    from the same samples, so they add nothing to the mean.

    SUM then divide rather than `ReduceOp.AVG`, which gloo lacks.
    """
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    averaged = losses.detach().clone()
    dist.all_reduce(averaged, group=group)
    return averaged / dist.get_world_size(group)


def accumulation_memory_note(model: torch.nn.Module, args: argparse.Namespace) -> str:
    """What each Megatron-FSDP gradient-accumulation option the flags turn on holds
    (`accumulation_memory`), as "; --flag holds up to X MiB ...", or "" (none, or DDP)."""
    if not args.use_megatron_fsdp:
        return ""
    return "".join(
        f"; --megatron-fsdp-{option.replace('_', '-')} holds up to {nbytes / 2**20:,.1f} MiB per "
        "rank across a step's microbatches"
        for option, nbytes in accumulation_memory(model).items()
        if getattr(args, f"megatron_fsdp_{option}")
    )


def unit_memory_note(model: torch.nn.Module, args: argparse.Namespace) -> str:
    """What one unit holds whole with `--suggested-communication-unit-size` (`unit_memory`),
    as "; --suggested-communication-unit-size N: a unit holds up to X MiB ...", or ""."""
    size = args.suggested_communication_unit_size
    if not args.use_megatron_fsdp or size is None:
        return ""
    memory = unit_memory(model)
    return (
        f"; --suggested-communication-unit-size {size}: a unit holds up to "
        f"{memory['weights'] / 2**20:,.1f} MiB of compute weights while gathered and "
        f"{memory['grads'] / 2**20:,.1f} MiB of whole gradients while reduced, per rank"
    )


class LoaderIterator:
    """Iterates a `DataLoader` until `close()`, which frees the loader's iterator: its worker
    processes exit then (a `DataLoader` iterator shuts its workers down when it is freed), even
    while something still references this object, such as the traceback of an error."""

    def __init__(self, loader: DataLoader):
        self._iterator: Iterator[Any] | None = iter(loader)

    def __iter__(self) -> LoaderIterator:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            raise StopIteration
        return next(self._iterator)

    def close(self) -> None:
        """Stops the workers; iteration ends here."""
        self._iterator = None
