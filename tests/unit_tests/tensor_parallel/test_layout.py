"""Tensor-parallel layouts: the DTensor placement of each layout, `shard_tensor` agreeing with
DTensor's `Shard` / `_StridedShard` (the global tensor rebuilt from every rank's part on a gloo
mesh), and `named_tensor_parallel_layouts` on a small module tree with a tied weight."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayout,
    VocabParallelEmbedding,
    named_tensor_parallel_layouts,
    shard_tensor,
    tensor_parallel_placement,
)
from megatron.core.tensor_parallel.layout import full_tensor
from tests.unit_tests.distributed_harness import current_device, run_distributed


def test_placements():
    assert tensor_parallel_placement(None) == Replicate()
    assert tensor_parallel_placement(TensorParallelLayout(None)) == Replicate()
    assert tensor_parallel_placement(TensorParallelLayout(1)) == Shard(1)
    assert tensor_parallel_placement(TensorParallelLayout(0, 2)) == _StridedShard(0, split_factor=2)
    with pytest.raises(ValueError, match="partition_stride"):
        TensorParallelLayout(0, 0)


def test_shard_tensor_refuses_sizes_that_do_not_split():
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_tensor(torch.zeros(6, 3), TensorParallelLayout(0, 2), 0, 2)


def _rebuild_from_parts() -> list[bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(current_device().type, (world,))
    full = torch.arange(8 * world * 3, dtype=torch.float32).view(8 * world, 3)
    results = []
    for layout in (TensorParallelLayout(0), TensorParallelLayout(0, 2), TensorParallelLayout(1)):
        expected = full.t().contiguous() if layout.partition_dim == 1 else full
        local = shard_tensor(expected, layout, rank, world).to(current_device())
        placement = tensor_parallel_placement(layout)
        # `full_tensor` here also on torch releases that cannot gather `_StridedShard` alone.
        rebuilt = full_tensor(DTensor.from_local(local, mesh, [placement]))
        results.append(torch.equal(rebuilt.cpu(), expected))
    return results


def test_shard_tensor_is_dtensor_sharding():
    for results in run_distributed(_rebuild_from_parts, 2):
        assert results == [True, True, True]


def _strided_under_data_parallel_shards() -> list[bool]:
    """(tp=2, dp=2) mesh, stride-2 rows split over tp then chunked over dp: DTensor's own
    `full_tensor()` (which every torch release runs when another shard of the dimension
    follows the `_StridedShard`) and `full_tensor` here both rebuild the global tensor."""
    # tp first, as the engines' meshes are.
    mesh = init_device_mesh(current_device().type, (2, 2), mesh_dim_names=("tp", "dp"))
    tp_rank, dp_rank = mesh.get_coordinate()
    full = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)
    layout = TensorParallelLayout(0, 2)
    local = shard_tensor(full, layout, tp_rank, 2).chunk(2)[dp_rank].to(current_device())
    dtensor = DTensor.from_local(
        local, mesh, [tensor_parallel_placement(layout), Shard(0)], run_check=False,
        shape=full.shape, stride=full.stride(),
    )  # fmt: skip
    return [
        torch.equal(dtensor.full_tensor().cpu(), full),
        torch.equal(full_tensor(dtensor).cpu(), full),
    ]


def test_strided_layout_is_dtensors_strided_shard():
    for results in run_distributed(_strided_under_data_parallel_shards, 4):
        assert results == [True, True]


class _Tied(torch.nn.Module):
    """An output projection whose weight is the embedding's, declaring `layouts`."""

    def __init__(self, embedding: VocabParallelEmbedding, layouts: dict[str, TensorParallelLayout]):
        super().__init__()
        self.weight = embedding.weight
        self.layouts = layouts

    def tensor_parallel_layouts(self) -> dict[str, TensorParallelLayout]:
        return self.layouts


def _tree(tied_layouts: dict[str, TensorParallelLayout] | None = None) -> torch.nn.Module:
    config, init = ModelParallelConfig(), torch.nn.init.ones_
    model = torch.nn.Module()
    model.embedding = VocabParallelEmbedding(16, 8, init_method=init, config=config)
    model.layer = torch.nn.Module()
    model.layer.norm = torch.nn.LayerNorm(8)
    model.layer.fc1 = ColumnParallelLinear(8, 16, config=config, init_method=init, stride=2)
    model.layer.fc2 = RowParallelLinear(
        16,
        8,
        config=config,
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=True,
    )
    tied_layouts = {"weight": TensorParallelLayout(0)} if tied_layouts is None else tied_layouts
    model.output = _Tied(model.embedding, tied_layouts)
    return model


def test_named_layouts_of_a_module_tree():
    model = _tree()
    assert named_tensor_parallel_layouts(model) == {
        "embedding.weight": TensorParallelLayout(0),
        "layer.fc1.weight": TensorParallelLayout(0, 2),
        "layer.fc1.bias": TensorParallelLayout(0, 2),
        "layer.fc2.weight": TensorParallelLayout(1),
    }
    assert named_tensor_parallel_layouts(model.layer) == {
        "fc1.weight": TensorParallelLayout(0, 2),
        "fc1.bias": TensorParallelLayout(0, 2),
        "fc2.weight": TensorParallelLayout(1),
    }


def test_named_layouts_refuse_unknown_names_and_conflicts():
    with pytest.raises(ValueError, match="two tensor-parallel layouts"):
        named_tensor_parallel_layouts(_tree({"weight": TensorParallelLayout(1)}))
    with pytest.raises(ValueError, match="not one of its own parameters"):
        named_tensor_parallel_layouts(_tree({"bias": TensorParallelLayout(0)}))
