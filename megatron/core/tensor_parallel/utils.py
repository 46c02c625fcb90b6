"""Small helpers of tensor parallelism: exact division, vocabulary ranges, the tp group to use.

A tp group of `None` stands for "no tensor parallelism" (size 1, rank 0) throughout
`megatron.core.tensor_parallel`, so single-process code needs no process group at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def divide(numerator: int, denominator: int) -> int:
    """`numerator // denominator`, refusing a remainder.

    Raises:
        ValueError: `numerator` is not a multiple of `denominator`.
    """
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(
            f"{numerator} is not divisible by {denominator}; choose sizes that are multiples of "
            "the parallel size they are split over."
        )
    return numerator // denominator


def get_tensor_model_parallel_group_if_none(
    tp_group: dist.ProcessGroup | None,
) -> dist.ProcessGroup | None:
    """The tp group a layer uses: `tp_group` when given, else parallel_state's tp group when
    model parallelism is initialised, else None (no tensor parallelism)."""
    if tp_group is not None:
        return tp_group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of `group`; 1 for None."""
    return 1 if group is None else group.size()


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in `group`; 0 for None."""
    return 0 if group is None else group.rank()


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Splits `tensor` into `num_partitions` equal parts along its last dimension.

    Args:
        tensor: The tensor to split.
        num_partitions: Number of parts; must divide the last dimension.
        contiguous_split_chunks: Return contiguous copies instead of views.

    Raises:
        ValueError: the last dimension is not a multiple of `num_partitions`.
    """
    size = divide(tensor.shape[-1], num_partitions)
    parts = torch.split(tensor, size, dim=-1)
    if contiguous_split_chunks:
        return tuple(part.contiguous() for part in parts)
    return parts


class VocabUtility:
    """The range `[first, last)` of token ids held by one rank of a vocabulary split over tp."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """Ids of `rank` when every rank holds `per_partition_vocab_size` rows."""
        del world_size  # kept for upstream's signature; the range depends on the rank only
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """Ids of `rank` of `world_size` for a vocabulary of `global_vocab_size` rows.

        Raises:
            ValueError: the vocabulary is not divisible by `world_size` (pad it).
        """
        if global_vocab_size % world_size != 0:
            raise ValueError(
                f"vocabulary size {global_vocab_size} is not divisible by the tensor-parallel "
                f"size {world_size}; pad the vocabulary to a multiple of it (the training "
                "script pads to a multiple of make_vocab_size_divisible_by * "
                "tensor_model_parallel_size)."
            )
        per_partition = global_vocab_size // world_size
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size
        )
