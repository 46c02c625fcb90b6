"""`LeadingGroups`: on 4 gloo ranks (tp = 2 x ep = 2, tp alone, ep alone), every rank's
`local_part` of a global tensor, placed over the leading mesh as `placements` says with the
shape `global_shape` gives, is that global tensor again (DTensor's own reading of the
placements is the reference), for dense and expert-like layouts; an expert layout that splits
the experts' own dim 0 is refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.leading_groups import LeadingGroups
from megatron.core.distributed.tensor_parallel_params import dtensor
from megatron.core.tensor_parallel.layout import TensorParallelLayout, full_tensor
from tests.unit_tests.distributed_harness import current_device, run_distributed

WORLD = 4

DENSE_LAYOUTS = (None, TensorParallelLayout(0), TensorParallelLayout(0, 2), TensorParallelLayout(1))
# Expert layouts split a dim of each expert: dim 0 of the global tensor is the expert index.
EXPERT_LAYOUTS = (
    None,
    TensorParallelLayout(1),
    TensorParallelLayout(1, 2),
    TensorParallelLayout(2),
)


def _my_group(partition: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group of `partition` (every rank creates every group, in the same order)."""
    groups = [dist.new_group(ranks) for ranks in partition]
    return next(g for g, ranks in zip(groups, partition) if dist.get_rank() in ranks)


def _round_trips() -> tuple[list[tuple[str, str, bool, bool]], str]:
    """(case, layout, global shape right, DTensor of the local parts is the global tensor) of
    every case, and the refusal of an expert layout that splits the experts' dim."""
    tp = _my_group([[0, 1], [2, 3]])
    ep = _my_group([[0, 2], [1, 3]])
    cases = {
        "tp": (LeadingGroups(tp=tp), DENSE_LAYOUTS, (8, 4)),
        "ep": (LeadingGroups(ep=ep), (None,), (4, 3, 2)),
        "tp x ep": (LeadingGroups(tp=tp, ep=ep), EXPERT_LAYOUTS, (4, 4, 8)),
    }
    device = current_device()
    own = torch.tensor(dist.get_rank(), dtype=torch.int)
    results = []
    for case, (leading, layouts, shape) in cases.items():
        mesh = leading.mesh([], own, device.type, ())
        assert [name.split(":")[0] for name in mesh.mesh_dim_names] == case.split(" x ")
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32, device=device)
        full = full.view(shape)
        for layout in layouts:
            local = leading.local_part(full, layout)
            global_shape = leading.global_shape(local.shape, layout)
            placed = dtensor(local.contiguous(), mesh, leading.placements(layout), global_shape)
            rebuilt = full_tensor(placed)
            results.append((case, repr(layout), global_shape == full.shape, rebuilt.equal(full)))
    with pytest.raises(ValueError, match="splits dim 0") as refused:
        LeadingGroups(tp=tp, ep=ep).placements(TensorParallelLayout(0))
    for group in (tp, ep):
        dist.destroy_process_group(group)
    return results, str(refused.value)


def test_local_parts_placed_over_the_leading_mesh_rebuild_the_global_tensor():
    for rank, (results, refusal) in enumerate(run_distributed(_round_trips, WORLD)):
        assert "partition_dim >= 1" in refusal
        assert len(results) == len(DENSE_LAYOUTS) + 1 + len(EXPERT_LAYOUTS)
        for case, layout, shape_right, rebuilt_right in results:
            assert shape_right, f"rank {rank}, {case}, {layout}: wrong global shape"
            assert rebuilt_right, f"rank {rank}, {case}, {layout}: wrong local part or placement"
