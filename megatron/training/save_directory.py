"""The `--save` directory of a training run: `claim_save_directory()`, which `pretrain()` holds
from the run's start to its end.

A run writes into `--save` only while it holds the directory's lock (`checkpoint_lock`: no other
job writes there meanwhile), and only if the checkpoints already there, if any, are the ones it
continues (`--load` is that directory). A run that starts from scratch, finetunes, or resumes
from another directory counts its iterations anew or from elsewhere: its saves would replace the
checkpoints of the same iterations and point the tracker at its own, orphaning the later ones,
and a restart would resume the wrong run. Such a run is refused before it builds anything
(Megatron-LM writes regardless).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from megatron.training.checkpoint_layout import (
    CheckpointError,
    committed_iterations,
    holds_checkpoint,
    read_tracker,
    same_directory,
)
from megatron.training.checkpoint_lock import hold_save_lock
from megatron.training.rank_0_step import on_rank_0


@contextlib.contextmanager
def claim_save_directory(args: argparse.Namespace) -> Iterator[None]:
    """For the block (a training run): rank 0 holds the lock of `--save`, having checked that
    the directory holds no checkpoints the run does not continue (`check_save_target`). Every
    rank enters it; nothing happens without `--save`.

    Raises:
        CheckpointError: on every rank: another job holds the lock, `--save` holds checkpoints
            this run would replace, or it cannot be created.
    """
    if args.save is None:
        yield
        return
    with contextlib.ExitStack() as lock:

        def claim() -> None:
            lock.enter_context(hold_save_lock(args.save))
            check_save_target(args)

        on_rank_0(claim, lambda error: _claim_failure(args.save, error))
        yield


def _claim_failure(save: str, error: Exception) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    return f"--save {save} cannot be used ({type(error).__name__}: {error}); pass a directory."


def check_save_target(args: argparse.Namespace) -> None:
    """Refuses a `--save` directory that holds checkpoints this run does not continue: unless
    `--load` is that directory (however reached: symbolic links, bind mounts) and the run resumes
    from it (no `--finetune`; `--pretrained-checkpoint` loads `--load` once it holds one).

    Raises:
        CheckpointError: the directory, its checkpoints and latest iteration, and the fixes.
    """
    save = args.save
    if save is None or not holds_checkpoint(save):
        return
    if args.load is not None and same_directory(args.load, save) and not args.finetune:
        return
    iterations = committed_iterations(save)
    tracked = read_tracker(save)
    held = _iterations_text(iterations)
    if args.finetune:
        raise CheckpointError(
            f"--save {save} holds checkpoints already ({held}), and this run finetunes from "
            f"{args.load}: it starts again at iteration 0, and its saves would replace them. "
            f"To continue the run that saved them, load it with --load {save} (a job that "
            f"restarts itself: --pretrained-checkpoint {args.load} --load {save} --save "
            f"{save}, without --finetune); to start a new run, pass a new --save directory."
        )
    latest = tracked if tracked is not None else iterations[-1]
    if args.load is None:
        this_run = "this run starts from scratch (no --load)"
    elif args.pretrained_checkpoint is not None and not holds_checkpoint(args.load):
        this_run = (
            f"this run finetunes from --pretrained-checkpoint {args.pretrained_checkpoint} "
            f"(--load {args.load} holds no checkpoint)"
        )
    else:
        this_run = f"this run loads --load {args.load}"
    raise CheckpointError(
        f"--save {save} holds the checkpoints of another run ({held}; the latest is iteration "
        f"{latest}), and {this_run}: its saves would replace the checkpoints of the same "
        f"iterations and point the tracker at its own. To continue the run saved there, pass "
        f"--load {save}; to start another, pass a new or empty --save directory."
    )


def _iterations_text(iterations: list[int]) -> str:
    if len(iterations) <= 5:
        return f"iterations {iterations}"
    return f"{len(iterations)} checkpoints, iterations {iterations[0]} to {iterations[-1]}"
