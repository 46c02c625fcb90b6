"""Units of several modules (`fully_shard([m0, m1])`, the adapter's
`suggested_communication_unit_size`): gradients equal an unsharded model's whatever the modules
do in a forward (run in a chain or side by side, one skipped, one recomputed, a forward that
fails midway, several backward passes), and the adapter's grouped GPT trains like the DDP
engine (bad groupings: `test_fully_shard.py`)."""

from __future__ import annotations

import argparse
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp import (
    FullyShardedDataParallel,
    fully_shard,
    fully_shard_optimizer,
    unit_memory,
)
from megatron.core.distributed.fsdp.gradients import GroupGrads
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import group_layers
from megatron.core.distributed.fsdp.roots import fsdp_contexts
from megatron.training.utils import unit_memory_note
from tests.unit_tests.distributed.fsdp.fsdp_training import LR, full_state, megatron_loop
from tests.unit_tests.distributed.fsdp.test_backward_edge_cases import (
    Block,
    _assert_grads_match,
    _averaged_grads,
    _grads,
    _inputs,
)
from tests.unit_tests.distributed.fsdp.test_mcore_fsdp_adapter import (
    _assert_matches_ddp,
    _train_ddp,
)
from tests.unit_tests.distributed.fsdp.test_overlap import _gpu_losses
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    device_batch,
    tiny_gpt_config,
)

DIM = 8


class Blocks(torch.nn.Module):
    """An input layer, four blocks and a head; `mode` says how the blocks run in a forward.
    (The input layer makes the blocks' inputs need gradients: a unit's backward then ends when
    they have them, not at the end of the whole backward.)"""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(DIM, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, mode: str = "chain", fail: bool = False) -> torch.Tensor:
        b = self.blocks
        x = self.inp(x)
        if mode == "side_by_side":  # both read x: each one's input is routed
            x = b[0](x) + b[1](x)
        elif mode == "recompute":  # the second block's forward runs again inside backward
            x = checkpoint(b[1], b[0](x), use_reentrant=False)
        elif mode == "reentrant":  # the first block's forward runs without autograd, then again
            x = b[1](checkpoint(b[0], x, use_reentrant=True))
        elif mode == "reentrant_whole":  # both blocks: no hook sees their backward
            x = checkpoint(lambda y: b[1](b[0](y)), x, use_reentrant=True)
        elif mode == "detached_view":  # only the second block's input is routed
            x = b[1](b[0](x.detach()).view_as(x))
        else:
            x = b[0](x)
            if fail:  # leaves the first unit's forward open
                raise RuntimeError("simulated failure between a unit's modules")
            x = b[1](x)
        x = b[2](x)
        if mode != "skip":  # the second unit ends with the root's forward
            x = b[3](x)
        return self.head(x).pow(2).mean()


def _grouped(strategy: str, grouped: bool = True) -> Blocks:
    """The blocks in units of two (or, not `grouped`, of one), and the root."""
    torch.manual_seed(0)
    model = Blocks().to(current_device())
    blocks = list(model.blocks)
    for unit in [blocks[:2], blocks[2:]] if grouped else blocks:
        fully_shard(unit, sharding_strategy=strategy)
    return fully_shard(model, sharding_strategy=strategy)


def _reference() -> Blocks:
    torch.manual_seed(0)
    return Blocks().to(current_device())


def _two_backwards(strategy: str, mode: str, grouped: bool = True) -> tuple[dict, dict, bool]:
    """Two forwards and backwards (gradients accumulated): the second forward must find
    the first one's units closed, whichever modules ran. Also whether the main weights were
    registered again after each forward, as between any unit's forward and backward."""
    model, reference = _grouped(strategy, grouped), _reference()
    registered = True
    for seed in (0, 1):
        x = _inputs(10 * dist.get_rank() + seed)
        loss = model(x, mode)
        registered &= all(isinstance(p, DTensor) for p in model.parameters())
        loss.backward()
        reference(x, mode).backward()
    return _grads(model), _averaged_grads(reference), registered


@pytest.mark.parametrize(
    "mode",
    ["chain", "side_by_side", "skip", "recompute", "reentrant", "reentrant_whole", "detached_view"],
)
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_grouped_units_get_the_unsharded_models_gradients(strategy, mode):
    results = run_distributed(_two_backwards, 2, strategy, mode)
    _assert_grads_match([(grads, expected) for grads, expected, _ in results])
    assert all(registered for _, _, registered in results)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_units_of_one_module_whose_backward_no_hook_announces_are_reduced(strategy):
    # Both blocks inside one reentrant checkpoint: their forward runs without autograd, and
    # their backward inside the checkpoint's; the end of the whole backward reduces them.
    results = run_distributed(_two_backwards, 2, strategy, "reentrant_whole", False)
    _assert_grads_match([(grads, expected) for grads, expected, _ in results])


def _passes(strategy: str) -> tuple[dict, dict, list[str], bool]:
    """A failed forward, an inference forward, two forwards then two backwards (1F1B order),
    and a backward run twice through one forward."""
    model, reference = _grouped(strategy), _reference()
    rank = dist.get_rank()
    with pytest.raises(RuntimeError, match="simulated failure"):
        model(_inputs(rank), fail=True)
    with torch.no_grad():
        model(_inputs(rank + 10))
    model.blocks[0](_inputs(rank + 50))  # alone: a whole forward of its unit
    registered_after_alone = all(isinstance(p, DTensor) for p in model.parameters())
    inputs = [_inputs(rank + 20), _inputs(rank + 30)]
    for loss in [model(x) for x in inputs]:
        loss.backward()
    twice = model(_inputs(rank + 40))
    twice.backward(retain_graph=True)
    twice.backward()
    for x in [*inputs, _inputs(rank + 40), _inputs(rank + 40)]:
        reference(x).backward()
    names = [unit.name for unit in fsdp_contexts(model)[0].units()]
    return _grads(model), _averaged_grads(reference), names, registered_after_alone


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_grouped_units_survive_failures_inference_and_several_backwards(strategy):
    """Also a module of a unit run alone, outside the root's forward, which is a whole forward
    of the unit: the main weights are registered again after it."""
    results = run_distributed(_passes, 2, strategy)
    _assert_grads_match([(grads, expected) for grads, expected, _, _ in results])
    for _, _, names, registered_after_alone in results:
        assert names[1:] == ["blocks.0+blocks.1", "blocks.2+blocks.3"]
        assert registered_after_alone


def _train_grouped(ddp_kwargs: dict, layers_per_unit: int) -> dict:
    model = build_tiny_gpt(tiny_gpt_config(num_layers=4))
    layer_numel = sum(p.numel() for p in model.decoder.layers[0].parameters())
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        suggested_communication_unit_size=layers_per_unit * layer_numel,
        **ddp_kwargs,
    )
    fsdp = FullyShardedDataParallel(model.config, config, model)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(fsdp.parameters(), lr=LR), fsdp)
    losses = megatron_loop(fsdp, optimizer, lambda opt: opt.step())
    names = [unit.name for unit in fsdp_contexts(fsdp.module)[0].units()]
    return dict(state=full_state(model), losses=losses, names=names)


def _train_ddp_4_layers() -> dict:
    return _train_ddp(config=tiny_gpt_config(num_layers=4))


@pytest.mark.parametrize(
    "ddp_kwargs",
    [
        {"data_parallel_sharding_strategy": "optim_grads_params"},
        {"data_parallel_sharding_strategy": "optim_grads", "grad_reduce_in_fp32": True},
    ],
    ids=lambda kwargs: kwargs["data_parallel_sharding_strategy"],
)
def test_adapter_groups_layers_up_to_the_suggested_size_and_trains_like_ddp(ddp_kwargs):
    fsdp = run_distributed(_train_grouped, 2, ddp_kwargs, 2)
    for rank in fsdp:
        layers = rank["names"][2:-1]  # after the root and the embedding, before the output
        assert layers == ["decoder.layers.0+decoder.layers.1", "decoder.layers.2+decoder.layers.3"]
    _assert_matches_ddp(fsdp, run_distributed(_train_ddp_4_layers, 2))


def _unit_memory(layers_per_unit: int) -> tuple[dict[str, int], int, str]:
    """`unit_memory` of a 4-layer GPT (fp32) in units of `layers_per_unit` layers, the bytes of
    that many layers' weights padded to N chunks (computed here), and the start-up note."""
    model = build_tiny_gpt(tiny_gpt_config(num_layers=4))
    layers = model.decoder.layers[:layers_per_unit]
    size = layers_per_unit * sum(p.numel() for p in layers[0].parameters())
    world = dist.get_world_size()
    params = [p for layer in layers for p in layer.parameters()]
    padded = sum(-(-p.shape[0] // world) * world * p[0].numel() for p in params)
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        suggested_communication_unit_size=size,
    )
    fsdp = FullyShardedDataParallel(model.config, config, model)
    args = argparse.Namespace(use_megatron_fsdp=True, suggested_communication_unit_size=size)
    return unit_memory(fsdp), padded * 4, unit_memory_note(fsdp, args)


def test_unit_memory_is_the_largest_units_whole_weights_and_gradients():
    for layers_per_unit in (1, 2):
        memory, expected, note = run_distributed(_unit_memory, 2, layers_per_unit)[0]
        assert memory == {"weights": expected, "grads": expected}  # fp32 weights and gradients
        mib = f"{expected / 2**20:,.1f} MiB"
        assert f"up to {mib} of compute weights while gathered and {mib} of whole gradients" in note


def _fused_weight_gradients(layers_per_unit: int) -> int:
    """How many weight gradients linear layers wrote into reduce-scatter inputs themselves (no
    gradient left to autograd) in the first backward of a 4-layer GPT with gradient-accumulation
    fusion, in units of that many layers. The layers ask at their forward whether to: a unit of
    several modules must answer before the first of them runs."""
    model = build_tiny_gpt(tiny_gpt_config(num_layers=4, gradient_accumulation_fusion=True))
    layer_numel = sum(p.numel() for p in model.decoder.layers[0].parameters())
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        suggested_communication_unit_size=layers_per_unit * layer_numel,
    )
    fsdp = FullyShardedDataParallel(model.config, config, model)
    tokens, labels = device_batch(2, seed=dist.get_rank())
    fused = []
    reduce = GroupGrads.reduce

    def counting(grads: GroupGrads, *args, **kwargs):
        params = grads.weights.unsharded_params
        fused.append(sum(p.grad is None and p.requires_grad for p in params))
        return reduce(grads, *args, **kwargs)

    with mock.patch.object(GroupGrads, "reduce", counting):
        fsdp(tokens, labels=labels).mean().backward()
    return sum(fused)


def test_linear_layers_of_a_unit_of_several_fuse_from_the_first_step():
    one, two = (run_distributed(_fused_weight_gradients, 2, n)[0] for n in (1, 2))
    assert one == two >= 4 * 4  # at least each layer's four linear weights


def test_group_layers_keeps_other_modules_alone_and_layers_larger_than_the_size():
    model = build_tiny_gpt(tiny_gpt_config(num_layers=5))
    layers = list(model.decoder.layers)
    layer = sum(p.numel() for p in layers[0].parameters())
    units = [model.embedding, *layers, model.output_layer]
    assert group_layers(model, units, None) == units
    assert group_layers(model, units, layer - 1) == units
    assert group_layers(model, units, 3 * layer) == [
        model.embedding,
        layers[:3],
        layers[3:],
        model.output_layer,
    ]


# GPU: the side streams and their events around units of several layers.

# Two of `_gpu_losses`' layers (width 1024: 12,596,224 elements each), not three.
_TWO_GPU_LAYERS = 26_000_000


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_units_of_two_layers_train_bitwise_as_units_of_one_on_gpu(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs (run on the GPU machine)")
    one = dict(overlap_param_gather=True, overlap_grad_reduce=True)
    two = dict(one, suggested_communication_unit_size=_TWO_GPU_LAYERS)
    grouped, single = (run_distributed(_gpu_losses, world_size, kw) for kw in (two, one))
    for r_two, r_one in zip(grouped, single):
        torch.testing.assert_close(r_two, r_one, rtol=0, atol=0)
