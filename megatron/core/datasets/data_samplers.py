"""`MegatronPretrainingSampler` and `build_pretraining_data_loader()`: which samples each
data-parallel rank reads, resumable from the number of samples consumed.

Samples are read in order. Each group of `micro_batch_size x data_parallel_size` consecutive
indices is one micro-batch on every rank: rank r takes the r-th `micro_batch_size` of them, so
the ranks read disjoint slices of every global batch. A run restarted with the
`consumed_samples` of its checkpoint continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from megatron.core.datasets.one_buffer_batch import collate_in_one_buffer


class MegatronPretrainingSampler:
    """A batch sampler: yields this rank's list of sample indices for each micro-batch.

    An incomplete last group of indices is dropped, so every rank yields the same number of
    micro-batches, all of `micro_batch_size` samples.

    Args:
        total_samples: the dataset length.
        consumed_samples: samples already trained on (over all ranks); iteration starts there.
        micro_batch_size: samples per rank per micro-batch.
        data_parallel_rank: this rank's index in the data-parallel group.
        data_parallel_size: the data-parallel group size.

    Raises:
        ValueError: a size is not positive, the rank is out of range, or no sample is left.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ):
        if total_samples < 1 or micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError(
                f"total_samples ({total_samples}), micro_batch_size ({micro_batch_size}) and "
                f"data_parallel_size ({data_parallel_size}) must be >= 1."
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={data_parallel_rank} is not in [0, {data_parallel_size})."
            )
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} leaves nothing of the {total_samples} "
                "samples to read; build a larger dataset (more train samples)."
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __len__(self) -> int:
        group = self.micro_batch_size * self.data_parallel_size
        return (self.total_samples - self.consumed_samples) // group

    def __iter__(self) -> Iterator[list[int]]:
        group = self.micro_batch_size * self.data_parallel_size
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for start in range(first, first + len(self) * group, group):
            yield list(range(start, start + self.micro_batch_size))


def build_pretraining_data_loader(
    dataset: Dataset | None,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader | None:
    """A loader of this rank's micro-batches of `dataset`, from `consumed_samples` on.

    Each batch is the dataset's sample dict with every tensor stacked ([micro_batch_size, ...]).
    Worker processes (`num_workers` > 0) belong to the loader's iterator: they exit when it is
    exhausted or freed (workers are not kept across iterators).

    Args:
        dataset: the samples (a map-style dataset); None gives None.
        consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size: see
            `MegatronPretrainingSampler`.
        num_workers: loader worker processes; 0 loads in this process.
        pin_memory: page-lock the batches, for faster copies to a GPU; set it when the model
            trains on CUDA (it only costs memory otherwise).

    Returns:
        None when `dataset` is None (as Megatron-LM's, for absent validation/test sets).
    """
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # From worker processes each batch crosses as one tensor (`collate_in_one_buffer`).
        collate_fn=collate_in_one_buffer if num_workers else None,
        # Each iterator draws a base seed for its workers: from a private generator, so that
        # building a loader leaves the global RNG (dropout's) as it was, and a run resumed from
        # a checkpoint draws the masks the uninterrupted run drew.
        generator=torch.Generator(),
    )
