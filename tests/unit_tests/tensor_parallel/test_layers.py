"""The tensor-parallel layers against their unsharded computation: at TP 2 and 4 (gloo ranks),
with and without sequence parallelism, stride 1 and 2, each rank's output, input gradient and
weight / bias gradients equal the matching part of a plain `torch.nn.functional` computation
with the whole weight; the weights equal the T = 1 draw from the same seed. At T = 1 the layers
are drop-in replacements of the torch-only `Linear` / `Embedding`."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.models.common.embeddings.language_model_embedding import Embedding
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayout,
    VocabParallelEmbedding,
    shard_tensor,
)
from megatron.core.transformer.linear import Linear
from tests.unit_tests.distributed_harness import run_distributed

SEQ, BATCH = 8, 2
SEQUENCE = TensorParallelLayout(0)  # the sequence parts of sequence parallelism
INIT = functools.partial(torch.nn.init.normal_, std=0.5)


def _config(sequence_parallel: bool) -> ModelParallelConfig:
    return ModelParallelConfig(
        tensor_model_parallel_size=dist.get_world_size(), sequence_parallel=sequence_parallel
    )


def _part(full: torch.Tensor, layout: TensorParallelLayout | None) -> torch.Tensor:
    return shard_tensor(full, layout, dist.get_rank(), dist.get_world_size())


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def _reference(in_size: int, out_size: int) -> dict[str, torch.Tensor]:
    """The whole weight as T = 1 draws it after `torch.manual_seed(0)`, the draw after it, a
    bias, an input and an output gradient, identical on every rank."""
    torch.manual_seed(0)
    weight = INIT(torch.empty(out_size, in_size))
    after_init = torch.rand(4)
    generator = torch.Generator().manual_seed(1)
    data = dict(
        bias=torch.randn(out_size, generator=generator),
        x=torch.randn(SEQ, BATCH, in_size, generator=generator),
        grad=torch.randn(SEQ, BATCH, out_size, generator=generator),
    )
    return dict(weight=weight, after_init=after_init, **data)


def _full_grads(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    weight, bias, x = _leaf(ref["weight"]), _leaf(ref["bias"]), _leaf(ref["x"])
    y = F.linear(x, weight, bias)
    (y * ref["grad"]).sum().backward()
    return dict(y=y.detach(), x=x.grad, weight=weight.grad, bias=bias.grad)


def _check_linear(cls: type, sequence_parallel: bool, stride: int, skip_bias_add: bool) -> None:
    in_size, out_size = (16, 24) if cls is ColumnParallelLinear else (24, 16)
    ref = _reference(in_size, out_size)
    full = _full_grads(ref)
    kwargs = dict(config=_config(sequence_parallel), init_method=INIT, bias=True, stride=stride)
    kwargs.update(skip_bias_add=skip_bias_add, tp_group=dist.group.WORLD)
    torch.manual_seed(0)
    if cls is ColumnParallelLinear:
        layer = cls(in_size, out_size, **kwargs)
        in_layout, out_layout = None, TensorParallelLayout(2, stride)
        bias_layout = TensorParallelLayout(0, stride)
    else:
        layer = cls(in_size, out_size, input_is_parallel=True, **kwargs)
        in_layout, out_layout, bias_layout = TensorParallelLayout(2, stride), None, None
    # The same draws as T = 1: equal weights and an equally advanced generator.
    torch.testing.assert_close(torch.rand(4), ref["after_init"], rtol=0, atol=0)
    weight_layout = layer.tensor_parallel_layouts()["weight"]
    torch.testing.assert_close(layer.weight, _part(ref["weight"], weight_layout), rtol=0, atol=0)
    assert torch.count_nonzero(layer.bias) == 0
    with torch.no_grad():
        layer.bias.copy_(_part(ref["bias"], bias_layout))

    x = _part(ref["x"], in_layout)
    if sequence_parallel and cls is ColumnParallelLinear:
        x = _part(x, SEQUENCE)
    x = _leaf(x)
    expected_y, grad = _part(full["y"], out_layout), _part(ref["grad"], out_layout)
    if sequence_parallel and cls is RowParallelLinear:
        expected_y, grad = _part(expected_y, SEQUENCE), _part(grad, SEQUENCE)
    # A row-parallel layer adds a residual connection given to it, after the sum over tp.
    residual = None
    if cls is RowParallelLinear and not skip_bias_add:
        draws = torch.Generator().manual_seed(1)
        residual = _leaf(torch.randn(expected_y.shape, generator=draws))
        expected_y = expected_y + residual.detach()
        output, bias = layer(x, residual=residual)
    else:
        output, bias = layer(x)
    assert (bias is None) != skip_bias_add
    if skip_bias_add:
        output = output + bias
    torch.testing.assert_close(output, expected_y)
    (output * grad).sum().backward()
    if residual is not None:
        torch.testing.assert_close(residual.grad, grad)

    expected_dx = _part(full["x"], in_layout)
    if sequence_parallel and cls is ColumnParallelLinear:
        expected_dx = _part(expected_dx, SEQUENCE)
    torch.testing.assert_close(x.grad, expected_dx)
    torch.testing.assert_close(layer.weight.grad, _part(full["weight"], weight_layout))
    torch.testing.assert_close(layer.bias.grad, _part(full["bias"], bias_layout))


def _check_all_linears(sequence_parallel: bool) -> None:
    for cls in (ColumnParallelLinear, RowParallelLinear):
        for stride in (1, 2):
            for skip_bias_add in (False, True):
                _check_linear(cls, sequence_parallel, stride, skip_bias_add)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_parallel_linears_match_the_unsharded_linear(world, sequence_parallel):
    run_distributed(_check_all_linears, world, sequence_parallel)


def _check_column_gather_output_and_row_split_input() -> None:
    """The replicated-side options: column-parallel with `gather_output`, row-parallel
    splitting a whole input itself."""
    column_ref = _reference(16, 24)
    torch.manual_seed(0)
    column = ColumnParallelLinear(
        16,
        24,
        config=_config(False),
        init_method=INIT,
        gather_output=True,
        tp_group=dist.group.WORLD,
    )
    x = _leaf(column_ref["x"])
    output, _ = column(x)
    expected = _full_grads({**column_ref, "bias": torch.zeros(24)})
    torch.testing.assert_close(output, expected["y"])
    (output * column_ref["grad"]).sum().backward()
    torch.testing.assert_close(x.grad, expected["x"])

    row_ref = _reference(24, 16)
    torch.manual_seed(0)
    row = RowParallelLinear(
        24,
        16,
        config=_config(False),
        init_method=INIT,
        bias=False,
        input_is_parallel=False,
        skip_bias_add=False,
        tp_group=dist.group.WORLD,
    )
    x = _leaf(row_ref["x"])
    output, _ = row(x)
    weight = _leaf(row_ref["weight"])
    reference_x = _leaf(row_ref["x"])
    expected_y = F.linear(reference_x, weight)
    (expected_y * row_ref["grad"]).sum().backward()
    torch.testing.assert_close(output, expected_y)
    (output * row_ref["grad"]).sum().backward()
    torch.testing.assert_close(x.grad, reference_x.grad)
    torch.testing.assert_close(row.weight.grad, _part(weight.grad, TensorParallelLayout(1)))


def test_gather_output_and_row_split_input():
    run_distributed(_check_column_gather_output_and_row_split_input, 2)


def _saved_for_backward_by_column_layer() -> list[torch.Size]:
    layer = ColumnParallelLinear(
        16, 24, config=_config(True), init_method=INIT, tp_group=dist.group.WORLD
    )
    x = torch.randn(SEQ // 2, BATCH, 16, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, id):
        layer(x)
    return shapes


def test_sequence_parallel_column_layer_keeps_only_its_part_of_the_input_for_backward():
    # Backward gathers the sequence again, so the gathered [s, b, h] input is not kept alive.
    for shapes in run_distributed(_saved_for_backward_by_column_layer, 2):
        assert torch.Size([SEQ // 2, BATCH, 16]) in shapes
        assert torch.Size([SEQ, BATCH, 16]) not in shapes


def _padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocabulary padding: up to a multiple of divisible_by x tp."""
    multiple = divisible_by * tp
    return math.ceil(vocab / multiple) * multiple


def _check_embedding(reduce_scatter: bool) -> None:
    tp, hidden = dist.get_world_size(), 8
    vocab = _padded_vocab(50, 8, tp)
    torch.manual_seed(0)
    full_weight = INIT(torch.empty(vocab, hidden))
    generator = torch.Generator().manual_seed(1)
    # Ids from the whole (unpadded) vocabulary: most fall outside each rank's range.
    ids = torch.randint(0, 50, (BATCH, SEQ), generator=generator)
    grad = torch.randn(BATCH, SEQ, hidden, generator=generator)
    torch.manual_seed(0)
    layer = VocabParallelEmbedding(
        vocab,
        hidden,
        init_method=INIT,
        config=_config(reduce_scatter),
        reduce_scatter_embeddings=reduce_scatter,
        tp_group=dist.group.WORLD,
    )
    assert layer.tensor_parallel_layouts() == {"weight": TensorParallelLayout(0)}
    torch.testing.assert_close(layer.weight, _part(full_weight, TensorParallelLayout(0)))
    start, end = layer.vocab_range
    assert (start, end) == (dist.get_rank() * vocab // tp, (dist.get_rank() + 1) * vocab // tp)
    assert ((ids < start) | (ids >= end)).any()

    weight = _leaf(full_weight)
    expected = F.embedding(ids, weight)
    (expected * grad).sum().backward()
    output = layer(ids)
    if reduce_scatter:  # [b, s] ids give this rank's sequence part of [s, b, h]
        expected, grad = (
            _part(expected.transpose(0, 1), SEQUENCE),
            _part(grad.transpose(0, 1), SEQUENCE),
        )
    torch.testing.assert_close(output, expected)
    (output * grad).sum().backward()
    torch.testing.assert_close(layer.weight.grad, _part(weight.grad, TensorParallelLayout(0)))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_vocab_parallel_embedding_matches_the_whole_table(world, reduce_scatter):
    run_distributed(_check_embedding, world, reduce_scatter)


@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_tp1_layers_are_drop_in_replacements(skip_bias_add):
    config = ModelParallelConfig()
    x = torch.randn(SEQ, BATCH, 16)
    for cls, extra in (
        (ColumnParallelLinear, {}),
        (RowParallelLinear, {"input_is_parallel": True}),
    ):
        torch.manual_seed(0)
        plain = Linear(16, 24, config=config, init_method=INIT, skip_bias_add=skip_bias_add)
        torch.manual_seed(0)
        layer = cls(
            16,
            24,
            config=config,
            init_method=INIT,
            bias=True,
            skip_bias_add=skip_bias_add,
            **extra,
        )
        assert layer.tp_size == 1 and layer.tp_rank == 0 and layer.tp_group is None
        assert dict(plain.named_parameters()).keys() == dict(layer.named_parameters()).keys()
        for (_, expected), (_, actual) in zip(plain.named_parameters(), layer.named_parameters()):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        for expected, actual in zip(plain(x), layer(x)):
            if expected is None:
                assert actual is None
            else:
                torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.manual_seed(0)
    plain = Embedding(40, 16, init_method=INIT, dtype=torch.float32)
    torch.manual_seed(0)
    layer = VocabParallelEmbedding(40, 16, init_method=INIT, config=config)
    ids = torch.randint(0, 40, (BATCH, SEQ))
    torch.testing.assert_close(layer(ids), plain(ids), rtol=0, atol=0)


def test_bad_sizes_and_options_are_refused():
    config = ModelParallelConfig()
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        ColumnParallelLinear(16, 24, config=ModelParallelConfig(2), init_method=INIT)
    with pytest.raises(ValueError, match="pass the weight"):
        layer = ColumnParallelLinear(
            16, 24, config=config, init_method=INIT, skip_weight_param_allocation=True
        )
        layer(torch.randn(2, 16))
    row = RowParallelLinear(
        16,
        24,
        config=config,
        init_method=INIT,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=True,
    )
    with pytest.raises(ValueError, match="skip_bias_add leaves to the caller"):
        row(torch.randn(2, 16), residual=torch.randn(2, 24))


def _check_distributed_refusals() -> list[str]:
    config = _config(True)
    group = dist.group.WORLD
    messages = []
    attempts = [
        lambda: ColumnParallelLinear(16, 6, config=config, init_method=INIT, tp_group=group),
        lambda: ColumnParallelLinear(
            16, 24, config=config, init_method=INIT, gather_output=True, tp_group=group
        ),
        lambda: RowParallelLinear(
            16,
            24,
            config=config,
            init_method=INIT,
            bias=True,
            input_is_parallel=False,
            skip_bias_add=False,
            tp_group=group,
        ),
        lambda: VocabParallelEmbedding(50, 8, init_method=INIT, config=config, tp_group=group),
    ]
    for attempt in attempts:
        with pytest.raises(ValueError) as caught:
            attempt()
        messages.append(str(caught.value))
    return messages


def test_bad_sizes_and_options_are_refused_on_every_rank():
    for messages in run_distributed(_check_distributed_refusals, 4):
        assert "multiple of 4" in messages[0]
        assert "gather_output" in messages[1]
        assert "input_is_parallel=True" in messages[2]
        assert "pad the vocabulary" in messages[3]
