"""Optimizer, regularization and learning-rate flags."""

from __future__ import annotations

import argparse
from typing import Any

from megatron.core.optimizer_param_scheduler import (
    LR_DECAY_STYLES,
    LR_WSD_DECAY_STYLES,
    WD_INCR_STYLES,
    ScheduleMismatchError,
)


def add_regularization_args(parser: argparse.ArgumentParser) -> None:
    """The "regularization" group: dropout, weight decay, clipping, optimizer hyper-parameters."""
    group = parser.add_argument_group(title="regularization")
    group.add_argument(
        "--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities."
    )
    group.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.1,
        help="Dropout on embeddings and residual branches.",
    )
    group.add_argument("--weight-decay", type=float, default=0.01, help="Constant weight decay.")
    group.add_argument("--start-weight-decay", type=float, help="Weight decay at iteration 0.")
    group.add_argument("--end-weight-decay", type=float, help="Weight decay at the end.")
    group.add_argument(
        "--apply-wd-to-qk-layernorm",
        action="store_true",
        help="Decay the query and key norms' weights and biases too (other 1-D ones never decay).",
    )
    group.add_argument(
        "--no-weight-decay-cond-type",
        type=_qk_layernorm_decay_condition,
        dest="apply_wd_to_qk_layernorm",
        metavar="apply_wd_to_qk_layernorm",
        help="Deprecated upstream: the same as --apply-wd-to-qk-layernorm.",
    )
    group.add_argument(
        "--weight-decay-incr-style",
        default="constant",
        choices=WD_INCR_STYLES,
        help="From --start- to --end-weight-decay.",
    )
    group.add_argument("--clip-grad", type=float, default=1.0, help="Max global grad norm.")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    group.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")


def _qk_layernorm_decay_condition(value: str) -> bool:
    """`--no-weight-decay-cond-type`'s one value, which turns on `--apply-wd-to-qk-layernorm`."""
    if value != "apply_wd_to_qk_layernorm":
        raise argparse.ArgumentTypeError(
            f"invalid choice {value!r}: the only condition is apply_wd_to_qk_layernorm (or use "
            "--apply-wd-to-qk-layernorm)"
        )
    return True


def add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    """The "learning rate" group: the schedule."""
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, help="Peak learning rate.")
    group.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=LR_DECAY_STYLES,
        help="Decay after warmup.",
    )
    group.add_argument("--lr-decay-iters", type=int, help="None: --train-iters.")
    group.add_argument(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=LR_WSD_DECAY_STYLES,
        help="Decay of the WSD annealing phase.",
    )
    group.add_argument("--lr-wsd-decay-iters", type=int, help="WSD annealing iterations.")
    group.add_argument(
        "--lr-decay-samples", type=int, help="Sample-based --lr-decay-iters; None: --train-samples."
    )
    group.add_argument(
        "--lr-wsd-decay-samples", type=int, help="Sample-based --lr-wsd-decay-iters."
    )
    group.add_argument(
        "--lr-warmup-fraction",
        type=float,
        help="Warmup as a fraction of the decay length (instead of --lr-warmup-iters/-samples).",
    )
    group.add_argument(
        "--lr-warmup-iters", type=int, default=0, help="Iterations of linear warmup."
    )
    group.add_argument("--lr-warmup-samples", type=int, default=0, help="Samples of linear warmup.")
    group.add_argument(
        "--lr-warmup-init", type=float, default=0.0, help="Learning rate warmup starts from."
    )
    group.add_argument(
        "--min-lr", type=float, default=0.0, help="Learning rate never decays below this."
    )
    group.add_argument(
        "--decoupled-lr",
        type=float,
        help="Peak learning rate of the word embeddings and the output layer.",
    )
    group.add_argument(
        "--decoupled-min-lr",
        type=float,
        help="Their --min-lr (needs --decoupled-lr); None: --min-lr.",
    )
    group.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="On loading, keep these flags' schedule (the checkpoint's step count only).",
    )
    group.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="On loading, take the checkpoint's schedule over these flags.",
    )


def lr_schedule_steps(args: argparse.Namespace) -> dict[str, float | int | None]:
    """The schedule's lengths in samples, as Megatron-LM's `get_optimizer_param_scheduler`:
    iteration flags times `--global-batch-size`, sample flags as given, `--lr-warmup-fraction`
    of the decay length.

    Returns:
        `lr_warmup_steps`, `lr_decay_steps`, `wsd_decay_steps` and `wd_incr_steps` of
        `OptimizerParamScheduler`, whose `step()` then advances by each iteration's global batch.
    """
    if args.train_samples is None:
        batch = args.global_batch_size
        decay = args.lr_decay_iters * batch
        warmup = args.lr_warmup_iters * batch
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * batch
        wd_incr = args.train_iters * batch
    else:
        decay, warmup = args.lr_decay_samples, args.lr_warmup_samples
        wsd, wd_incr = args.lr_wsd_decay_samples, args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return dict(
        lr_warmup_steps=warmup, lr_decay_steps=decay, wsd_decay_steps=wsd, wd_incr_steps=wd_incr
    )


_SCHEDULE_SOURCES = {
    "max_lr": ("lr",),
    "min_lr": ("min_lr",),
    "lr_warmup_steps": (
        "lr_warmup_iters",
        "lr_warmup_samples",
        "lr_warmup_fraction",
        "lr_decay_iters",
        "lr_decay_samples",
        "train_iters",
        "train_samples",
        "global_batch_size",
    ),
    "lr_decay_steps": (
        "lr_decay_iters",
        "lr_decay_samples",
        "train_iters",
        "train_samples",
        "global_batch_size",
    ),
    "lr_decay_style": ("lr_decay_style",),
    "start_wd": ("start_weight_decay", "weight_decay"),
    "end_wd": ("end_weight_decay", "weight_decay"),
    "wd_incr_steps": ("train_iters", "train_samples", "global_batch_size"),
    "wd_incr_style": ("weight_decay_incr_style",),
}
"""The flags (destinations) each value of the schedule a checkpoint is checked against comes
from (`lr_schedule_steps`, and the defaults validation fills in)."""

_DEFAULTS_TO = {
    "lr_decay_iters": "train_iters",
    "lr_decay_samples": "train_samples",
    "start_weight_decay": "weight_decay",
    "end_weight_decay": "weight_decay",
}
"""Flags whose default is another flag's value."""


def describe_schedule_mismatch(
    error: ScheduleMismatchError, saved: dict[str, Any], args: argparse.Namespace
) -> str:
    """What differs between a checkpoint's schedule and this run's, in the flags that set it
    rather than the schedule's samples, and how to resume: e.g. "--train-iters 250 here, 200 in
    the checkpoint". A difference no flag recorded in `saved` (the checkpoint's arguments)
    explains, and a parameter group's bound, keep the scheduler's words.

    Args:
        error: the scheduler's refusal.
        saved: the arguments the checkpoint was saved with (empty for one converted from
            weights).
        args: this run's.
    """
    dests: list[str] = []
    texts: list[str] = []
    for difference in error.differences:
        sources = () if difference.group else _SCHEDULE_SOURCES.get(difference.key, ())
        differing = [d for d in sources if d in saved and saved[d] != getattr(args, d, None)]
        if not differing:
            texts.append(str(difference))
        dests += [dest for dest in differing if dest not in dests]

    def follows(dest: str, source: str | None) -> bool:
        """Whether `dest` differs as its default `source` does, taking its value on both sides."""
        return (
            dest in dests
            and source in dests
            and all(values.get(dest) == values.get(source) for values in (saved, vars(args)))
        )

    flag_texts = []
    for dest in dests:
        if follows(dest, _DEFAULTS_TO.get(dest)):
            continue  # named with the flag it defaults to
        followers = [
            _flag(other)
            for other, source in _DEFAULTS_TO.items()
            if source == dest and follows(other, dest)
        ]
        verb = "defaults" if len(followers) == 1 else "default"
        also = f" (and {' and '.join(followers)}, which {verb} to it)" if followers else ""
        here, there = (_value(values.get(dest)) for values in (vars(args), saved))
        flag_texts.append(f"{_flag(dest)} {here} here, {there} in the checkpoint{also}")
    return (
        f"{'; '.join(flag_texts + texts)}. To resume it, pass --override-opt_param-scheduler "
        "to follow this run's flags from the checkpoint's step, "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule, or the "
        "checkpoint's values."
    )


def _value(value: Any) -> str:
    return "unset" if value is None else str(value)


_ITERATION_FLAGS = ("lr_decay_iters", "lr_wsd_decay_iters", "lr_warmup_iters")
_SAMPLE_FLAGS = ("lr_decay_samples", "lr_wsd_decay_samples", "lr_warmup_samples")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def validate_lr_schedule(args: argparse.Namespace) -> None:
    """Checks the schedule's lengths against the training length's unit and derives the decay
    length (`lr_decay_iters` from `--train-iters`, or `lr_decay_samples` from
    `--train-samples`). Runs after `train_iters` is known.

    Raises:
        ValueError: iteration and sample flags mixed; two warmups; a warmup not shorter than
            the decay; WSD without its annealing length; `--decoupled-min-lr` without
            `--decoupled-lr`, or out of range.
    """
    by_samples = args.train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    for dest in _ITERATION_FLAGS if by_samples else _SAMPLE_FLAGS:
        if getattr(args, dest):
            raise ValueError(
                f"{_flag(dest)} counts {other}, but the training length is given in {unit} "
                f"(--train-{unit}); use {_flag(dest).replace(other, unit)}."
            )
    warmup_dest = f"lr_warmup_{unit}"
    if args.lr_warmup_fraction is not None:
        if getattr(args, warmup_dest):
            raise ValueError(
                f"--lr-warmup-fraction and {_flag(warmup_dest)} are both set; keep one."
            )
    decay_dest = f"lr_decay_{unit}"
    if getattr(args, decay_dest) is None:
        setattr(args, decay_dest, args.train_samples if by_samples else args.train_iters)
    decay = getattr(args, decay_dest)
    if decay < 1:
        raise ValueError(f"{_flag(decay_dest)} must be >= 1, got {decay}.")
    if args.lr_warmup_fraction is None and not 0 <= getattr(args, warmup_dest) < decay:
        raise ValueError(
            f"{_flag(warmup_dest)} {getattr(args, warmup_dest)} must be in [0, "
            f"{_flag(decay_dest)} {decay}) ({_flag(decay_dest)} defaults to --train-{unit}); "
            "shorten the warmup or lengthen the decay."
        )
    wsd_dest = f"lr_wsd_decay_{unit}"
    if args.lr_decay_style == "WSD" and (
        getattr(args, wsd_dest) is None or not 0 < getattr(args, wsd_dest) <= decay
    ):
        raise ValueError(
            f"--lr-decay-style WSD needs {_flag(wsd_dest)} (the annealing phase), at most "
            f"{_flag(decay_dest)} {decay}."
        )
    _validate_decoupled_lr(args)


def _validate_decoupled_lr(args: argparse.Namespace) -> None:
    if args.decoupled_lr is None:
        if args.decoupled_min_lr is not None:
            raise ValueError(
                "--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's "
                "peak learning rate); add it or drop --decoupled-min-lr."
            )
        return
    if args.decoupled_lr < args.lr_warmup_init:
        raise ValueError(
            f"--decoupled-lr {args.decoupled_lr} must be >= --lr-warmup-init "
            f"{args.lr_warmup_init} (the warmup starts there); change one of them."
        )
    if args.decoupled_min_lr is not None and not 0 <= args.decoupled_min_lr <= args.decoupled_lr:
        raise ValueError(
            f"--decoupled-min-lr {args.decoupled_min_lr} must be in [0, --decoupled-lr "
            f"{args.decoupled_lr}]; change --decoupled-min-lr."
        )
