"""The program table of a multi-tensor launch against a plain enumeration of every tensor's
chunks, and the addresses such a launch takes."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fusions.multi_tensor_tables import aligned, program_table


@pytest.mark.parametrize("per_program", [1, 4, 4096])
def test_every_chunk_of_every_tensor_is_one_program(per_program):
    numels = [0, 1, 4, 5, 4096, 4097, 0, 12_288]
    expected = [
        (tensor, chunk)
        for tensor, numel in enumerate(numels)
        for chunk in range(-(-numel // per_program))
    ]
    table = program_table(torch.tensor(numels, dtype=torch.int64), per_program)
    assert table.dtype == torch.int32
    assert [tuple(row) for row in table.tolist()] == expected


def test_aligned_addresses_are_real_16_byte_boundaries():
    assert aligned(4096, 10) and aligned(0, 0) and aligned(7, 0)
    assert not aligned(4100, 10)
    assert not aligned(0, 10)  # a DTensor's address: no storage of its own
