"""The tensor-parallel column linear in FP8 (2 ranks): the communication of the bf16 layer around
the FP8 GEMMs of the gathered input. Each rank's output, input gradient and weight gradient equal
those of the FP8 linear applied to the whole input with this rank's weight rows, the input
gradient summed over the ranks as the layer's reduce-scatter / all-reduce does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.fp8.linear import Fp8LinearSlots
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.scaling import DelayedScalingState
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.grad_accumulation import linear
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from tests.unit_tests.distributed_harness import run_distributed


def _change_forward_scales(slots: Fp8LinearSlots) -> None:
    """What the end of the block's forward does before backward under delayed scaling."""
    if slots.state is not None:
        changed = slots.state.scaling_tensors()
        changed["scale_fwd"].fill_(100.0)
        slots.state.load_scaling_tensors(changed)


def _slots(kind: str) -> Fp8LinearSlots:
    recipe = Fp8Recipe("e4m3" if kind == "blockwise" else "hybrid", kind)
    if not recipe.delayed:
        return Fp8LinearSlots(recipe)
    return Fp8LinearSlots(recipe, DelayedScalingState(recipe, group=None))


def _column_parallel_run(kind: str, sequence_parallel: bool) -> list[bool]:
    group, rank = dist.group.WORLD, dist.get_rank()
    config = ModelParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel,
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    torch.manual_seed(0)
    layer = ColumnParallelLinear(
        64, 96, config=config, init_method=torch.nn.init.normal_, tp_group=group
    )
    with torch.no_grad():
        layer.bias.normal_()
    layer.fp8 = _slots(kind)
    generator = torch.Generator().manual_seed(1)
    whole = torch.randn(8, 2, 64, generator=generator).to(torch.bfloat16)
    grad = (torch.randn(8, 2, 48, generator=generator) * 1e-2).to(torch.bfloat16)
    x = (whole.chunk(2)[rank] if sequence_parallel else whole).clone().requires_grad_()
    output, _ = layer(x)
    _change_forward_scales(layer.fp8)  # backward must cast the input as forward did
    output.backward(grad)

    # The FP8 linear on the whole input, this rank's rows, its own (fresh) settings.
    weight = torch.nn.Parameter(layer.weight.detach().clone())
    bias = torch.nn.Parameter(layer.bias.detach().clone())
    total = whole.clone().requires_grad_()
    slots = _slots(kind)
    expected = linear(total, weight, bias, slots)
    _change_forward_scales(slots)
    expected.backward(grad)
    summed = total.grad.clone()
    dist.all_reduce(summed, group=group)
    expected_dx = summed.chunk(2)[rank] if sequence_parallel else summed
    return [
        torch.equal(output, expected),
        torch.equal(x.grad, expected_dx),
        torch.equal(layer.weight.grad, weight.grad),
        torch.equal(layer.bias.grad, bias.grad),
    ]


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("kind", ["tensorwise", "delayed", "blockwise"])
def test_column_parallel_fp8_equals_the_fp8_linear_of_the_whole_input(kind, sequence_parallel):
    ranks = run_distributed(_column_parallel_run, 2, kind, sequence_parallel)
    for rank, checks in enumerate(ranks):
        assert checks == [True] * 4, (rank, checks)
