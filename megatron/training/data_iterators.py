"""This rank's data iterators for the train, validation and test splits, sized as Megatron-LM
sizes them, starting where a resumed run stopped."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from torch.utils.data import Dataset

from megatron.core import parallel_state
from megatron.core.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.flag_groups.data import PER_SPLIT_FLAGS
from megatron.training.flag_groups.training_schedule import batch_size_schedule
from megatron.training.train_state import TrainState
from megatron.training.utils import LoaderIterator, get_device, print_rank_0

DatasetProvider = Callable[[list[int]], tuple[Dataset | None, Dataset | None, Dataset | None]]
"""A script's `train_valid_test_dataset_provider(num_samples)`: one dataset (or None) per
split, each of at least the given number of samples."""

SPLITS = ("train", "validation", "test")


def train_valid_test_num_samples(args: argparse.Namespace, train_state: TrainState) -> list[int]:
    """The samples each split must hold (Megatron-LM's `get_train_valid_test_num_samples`):
    train for every iteration; validation for `--eval-iters` iterations at every
    `--eval-interval` and once more at the end; test for one evaluation.

    What was consumed before a resume (`train_state`; a fresh one for a run from scratch), plus
    what the iterations left consume: the sizes of an uninterrupted run when the batch size is
    unchanged (so the datasets, whose sample order depends on their size, are the same), and
    enough when it changed.
    """
    global_batch = args.global_batch_size
    iterations_left = max(args.train_iters - train_state.iteration, 0)
    evaluations_left = 0  # without --eval-interval: only the one at the end
    if args.eval_interval is not None:
        evaluations_left = (
            args.train_iters // args.eval_interval - train_state.iteration // args.eval_interval
        )
    train_samples = batch_size_schedule(args).samples_after(
        train_state.consumed_train_samples, iterations_left
    )
    if args.train_samples is not None:
        # Megatron-LM sizes the split by --train-samples (the last batch may not fill it).
        train_samples = max(train_samples, args.train_samples)
    return [
        train_samples,
        train_state.consumed_valid_samples
        + max(evaluations_left + 1, 0) * args.eval_iters * global_batch,
        args.eval_iters * global_batch,
    ]


def _why_no_dataset(args: argparse.Namespace, number: int) -> str:
    """Why the dataset provider gave split `number` no dataset, as far as the flags tell."""
    name = SPLITS[number]
    if getattr(args, "data_path", None) and getattr(args, "split", None):
        return (
            f"the {name} split is empty (--split {args.split} gives it no weight, or the corpus "
            "too few documents for its share)"
        )
    per_split = [getattr(args, f"{split}_data_path", None) for split in PER_SPLIT_FLAGS]
    if any(per_split) and not per_split[number]:
        return f"no --{PER_SPLIT_FLAGS[number]}-data-path was given"
    return f"the dataset provider returned no {name} dataset"


def build_train_valid_test_data_iterators(
    train_valid_test_dataset_provider: DatasetProvider,
    args: argparse.Namespace,
    train_state: TrainState | None = None,
) -> tuple[LoaderIterator | None, LoaderIterator | None, LoaderIterator | None]:
    """Iterators over this rank's micro-batches of each split (None for an absent split).

    The splits are sized by `train_valid_test_num_samples`. Training and validation start
    after `train_state`'s consumed training and validation samples (a resumed run's data
    continues where it stopped; None: a run from scratch); no training iterator when no
    training iteration is left.
    `close()` the iterators to stop their loaders' worker processes. Validation asked for
    (`--eval-iters` > 0) from a dataset provider that gives no validation split is said once,
    as a warning from rank 0 (no validation runs then).

    Raises:
        ValueError: no training dataset, or a dataset shorter than the run needs.
    """
    state = TrainState() if train_state is None else train_state
    num_samples = train_valid_test_num_samples(args, state)
    print_rank_0(f"> building train, validation, and test datasets of {num_samples} samples ...")
    datasets = train_valid_test_dataset_provider(num_samples)
    if datasets[0] is None:
        raise ValueError(
            f"No training data: {_why_no_dataset(args, 0)}; give the training split data."
        )
    if datasets[1] is None and num_samples[1] > state.consumed_valid_samples:
        why = _why_no_dataset(args, 1)
        print_rank_0(
            f"WARNING: --eval-iters {args.eval_iters} asks for validation, but {why}, so no "
            "validation runs; give the validation split a weight and documents (e.g. --split "
            "98,2,0), or set --eval-iters 0.",
            logging.WARNING,
        )
    sizing = (
        "--train-iters x --global-batch-size, with a checkpoint's consumed samples",
        "(--train-iters // --eval-interval + 1) x --eval-iters x --global-batch-size",
        "--eval-iters x --global-batch-size",
    )
    for split, dataset, needed, how in zip(SPLITS, datasets, num_samples, sizing):
        if dataset is not None and needed > 0 and len(dataset) < needed:
            raise ValueError(
                f"The {split} dataset has {len(dataset)} samples, but the run needs {needed} "
                f"({how}); provide a larger dataset or lower those flags."
            )
    consumed = [state.consumed_train_samples, state.consumed_valid_samples, 0]
    iterators = []
    for dataset, needed, skip in zip(datasets, num_samples, consumed):
        loader = None
        if dataset is not None and needed > skip:
            loader = build_pretraining_data_loader(
                dataset,
                consumed_samples=skip,
                micro_batch_size=args.micro_batch_size,
                data_parallel_rank=parallel_state.get_data_parallel_rank(),
                data_parallel_size=parallel_state.get_data_parallel_world_size(),
                num_workers=args.num_workers,
                pin_memory=get_device().type == "cuda",
            )
        iterators.append(None if loader is None else LoaderIterator(loader))
    train_iterator, valid_iterator, test_iterator = iterators
    return train_iterator, valid_iterator, test_iterator
