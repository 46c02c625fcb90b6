"""Stopping a run early, on every rank together: `--exit-signal-handler` and
`--exit-duration-in-mins`.

Each rank sees its own signal and reads its own clock, so the decision to stop is reduced over
all ranks (any rank that received the signal, or whose time is up, stops them all), and every
rank saves the same checkpoint and leaves the loop after the same iteration. Megatron-LM's
`DistributedSignalHandler` and the duration check of its `train()`; here both conditions share
one all-reduce per iteration instead of an all-gather and an all-reduce.
"""

from __future__ import annotations

import argparse
import signal
import time
import types

import torch
import torch.distributed as dist

from megatron.training.utils import get_device


class DistributedSignalHandler:
    """Records that `sig` arrived (instead of its default action) while entered.

    Args:
        sig: the signal to catch.
    """

    def __init__(self, sig: signal.Signals = signal.SIGTERM):
        self.sig = sig
        self.received = False
        """Whether `sig` arrived on this rank since `__enter__`."""
        self._previous: signal.Handlers | None = None

    def __enter__(self) -> DistributedSignalHandler:
        self.received = False
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        signal.signal(self.sig, self._previous)

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.received = True


class ExitConditions:
    """The early exits the flags ask for; a context manager that installs the signal handler.

    Args:
        args: validated arguments (`exit_signal_handler`, `exit_signal`,
            `exit_duration_in_mins`).
        start_time: when the run started (`time.time()`); the duration counts from there.
    """

    def __init__(self, args: argparse.Namespace, start_time: float):
        self.start_time = start_time
        self.duration_in_mins = args.exit_duration_in_mins
        self.handler = (
            DistributedSignalHandler(args.exit_signal) if args.exit_signal_handler else None
        )

    def __enter__(self) -> ExitConditions:
        if self.handler is not None:
            self.handler.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.handler is not None:
            self.handler.__exit__(*exc_info)

    def reason(self) -> str | None:
        """Why every rank stops after this iteration (None: it goes on); the same on all
        ranks. With either flag on: one all-reduce (MAX of both conditions: the first rank
        signalled or past the limit stops them all) and one host read; none otherwise."""
        if self.handler is None and self.duration_in_mins is None:
            return None
        minutes = (time.time() - self.start_time) / 60.0
        signalled = self.handler is not None and self.handler.received
        time_up = self.duration_in_mins is not None and minutes > self.duration_in_mins
        flags = torch.tensor([signalled, time_up], dtype=torch.int32, device=get_device())
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, time_up = flags.tolist()
        if signalled:
            return f"received {self.handler.sig.name} (--exit-signal-handler)"
        if time_up:
            return f"after {minutes:.2f} minutes (--exit-duration-in-mins)"
        return None
