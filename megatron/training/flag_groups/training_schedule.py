"""Training-group flags of the run's length and batch schedule, and of how it stops early.

Megatron-LM's "training" group also holds these: `--train-samples` (sample-based training, the
alternative to `--train-iters`), the batch-size schedules (`--step-batch-size-schedule` and the
deprecated `--rampup-batch-size`), `--exit-duration-in-mins`, `--exit-signal-handler` /
`--exit-signal`, and `--calculate-per-token-loss` (upstream a `TransformerConfig` field; here it
is read by the training loop and `pretrain_gpt.loss_func`, the two places that act on it). They
live in this module, added to the "training" group by `add_training_args`.
"""

from __future__ import annotations

import argparse
import signal

from megatron.core.num_microbatches_calculator import BatchSizeSchedule, rampup_schedule

_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def _signal_by_name(name: str) -> signal.Signals:
    try:
        sig = signal.Signals[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a signal name such as SIGTERM") from None
    if sig in _UNCATCHABLE:
        raise argparse.ArgumentTypeError(
            f"{name} cannot be caught by a process; name one it can handle, such as SIGTERM or "
            "SIGUSR1"
        )
    return sig


def add_training_schedule_args(group: argparse._ArgumentGroup) -> None:
    """Adds this module's flags to the "training" group."""
    group.add_argument(
        "--rampup-batch-size",
        type=int,
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="Grow the global batch from START by INCREMENT over SAMPLES samples to "
        "--global-batch-size (deprecated upstream for --step-batch-size-schedule).",
    )
    group.add_argument(
        "--step-batch-size-schedule",
        help='"THRESHOLD:BS ...": global batch BS from THRESHOLD tokens on (suffixes K, M, B, '
        "T); the last BS is the global batch size.",
    )
    group.add_argument(
        "--train-samples", type=int, help="Samples to train on (instead of --train-iters)."
    )
    group.add_argument(
        "--exit-duration-in-mins", type=int, help="Save (with --save) and stop after this long."
    )
    group.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On --exit-signal (any rank), save (with --save) and stop after the iteration.",
    )
    group.add_argument(
        "--exit-signal",
        type=_signal_by_name,
        default=signal.SIGTERM.name,  # a name, which argparse converts with `type`
        choices=[sig for sig in signal.Signals if sig not in _UNCATCHABLE],
        metavar="SIGNAL",
        help="The signal --exit-signal-handler waits for.",
    )
    group.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Loss and gradients per unmasked token of the global batch, not per micro-batch.",
    )


def batch_size_schedule(args: argparse.Namespace) -> BatchSizeSchedule:
    """The global batch size by consumed samples that the validated flags describe."""
    if args.step_batch_size_schedule is not None:
        return BatchSizeSchedule.parse(args.step_batch_size_schedule, args.seq_length)
    if args.rampup_batch_size is not None:
        return rampup_schedule(*args.rampup_batch_size, args.global_batch_size)
    return BatchSizeSchedule.constant(args.global_batch_size)


def validate_batch_schedule(args: argparse.Namespace) -> None:
    """Derives `--global-batch-size` from a step schedule and checks every scheduled size.

    Runs after the data-parallel size is known and before the constant batch checks.

    Raises:
        ValueError: both schedules; a step schedule with another `--global-batch-size`; a
            schedule that does not parse, or a size not divisible by micro batch x data-parallel.
    """
    if args.step_batch_size_schedule is not None and args.rampup_batch_size is not None:
        raise ValueError(
            "--step-batch-size-schedule and --rampup-batch-size are both set; keep one "
            "(--rampup-batch-size is deprecated upstream)."
        )
    if args.step_batch_size_schedule is None and args.rampup_batch_size is None:
        return
    per_step = args.micro_batch_size * args.data_parallel_size
    flag = "--rampup-batch-size"
    try:
        if args.step_batch_size_schedule is not None:
            flag = "--step-batch-size-schedule"
            schedule = BatchSizeSchedule.parse(args.step_batch_size_schedule, args.seq_length)
            final = schedule.final_global_batch_size
            if args.global_batch_size not in (None, final):
                raise ValueError(
                    f"--global-batch-size {args.global_batch_size} is set too: the schedule's "
                    f"last size ({final}) is the global batch size; drop --global-batch-size"
                )
            args.global_batch_size = final
        else:
            if args.global_batch_size is None:
                args.global_batch_size = per_step
            schedule = batch_size_schedule(args)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None
    for _, size in schedule.steps:
        if size % per_step:
            raise ValueError(
                f"{flag} gives a global batch of {size}, not divisible by --micro-batch-size "
                f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = "
                f"{per_step}; use multiples of {per_step}."
            )


def validate_training_length(args: argparse.Namespace) -> None:
    """Derives `train_iters` from `--train-samples` and checks the early-exit flags.

    Raises:
        ValueError: neither or both of `--train-iters` / `--train-samples` (a `--train-iters`
            that is not the one `--train-samples` gives); a non-positive value.
    """
    for dest in ("train_samples", "exit_duration_in_mins"):
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ValueError(f"--{dest.replace('_', '-')} must be >= 1, got {value}.")
    if args.train_samples is None:
        if args.train_iters is None:
            raise ValueError(
                "--train-iters is required (the training length), or give --train-samples."
            )
        return
    derived = batch_size_schedule(args).iterations_for(args.train_samples)
    if args.train_iters not in (None, derived):
        raise ValueError(
            f"--train-iters {args.train_iters} and --train-samples {args.train_samples} are both "
            "set; train by iterations or by samples, not both."
        )
    if derived < 1:
        raise ValueError(
            f"--train-samples {args.train_samples} is less than one global batch "
            f"({args.global_batch_size}); raise it."
        )
    # Megatron-LM derives the iterations the same way (update_train_iters).
    args.train_iters = derived
