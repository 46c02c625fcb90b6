"""Backward passes that are not one plain forward + backward: data-dependent unused
parameters, a unit run twice or with several outputs, activation recompute, 1F1B order, a failed
backward, zero_grad modes, loading weights (also through the values `state_dict()` returns),
freezing after wrapping, and deleting a model."""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils._pytree
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from megatron.core.distributed.fsdp import (
    MixedPrecisionPolicy,
    OverlapPolicy,
    fully_shard,
    fully_shard_optimizer,
)
from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.roots import fsdp_contexts
from tests.unit_tests.distributed.fsdp.fsdp_training import (
    STEPS,
    train_reference,
)
from tests.unit_tests.distributed.fsdp.fsdp_training import full_state as gathered_weights
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)

DIM = 8


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(DIM, DIM)
        self.b = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return x + (self.b(h) if use_b else h)


class Net(torch.nn.Module):
    def __init__(self, inner_checkpoint: bool = False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(DIM, 1)
        self.inner_checkpoint = inner_checkpoint

    def forward(self, x: torch.Tensor, use_b=(True, True), fail: bool = False) -> torch.Tensor:
        for block, use in zip(self.blocks, use_b):
            x = block(x, use)
        if self.inner_checkpoint:
            # A recompute inside the root unit: re-reads the root's weights in backward.
            y = checkpoint(self.head, x, use_reentrant=False)
        else:
            y = self.head(x)
        if fail:
            y = _FailInBackward.apply(y)
        return y.pow(2).mean()


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated failure in backward")


def _build(strategy: str, dtype=torch.float32, **kwargs) -> Net:
    torch.manual_seed(0)
    model = Net(**kwargs).to(current_device(), dtype)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy)
    return fully_shard(model, sharding_strategy=strategy)


def _inputs(seed: int, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(seed))
    return x.to(current_device(), dtype)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.full_tensor().float() for n, p in model.named_parameters() if p.grad is not None
    }


def _averaged_reference_grads(batches) -> dict[str, torch.Tensor]:
    """Gradients of an unsharded Net over this rank's (x, use_b) batches, averaged over
    ranks."""
    torch.manual_seed(0)
    reference = Net().to(current_device())
    for x, use_b in batches:
        reference(x, use_b).backward()
    return _averaged_grads(reference)


def _averaged_grads(reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of an unsharded model (zeros where none), averaged over ranks."""
    averaged = {}
    for name, param in reference.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        averaged[name] = grad / dist.get_world_size()
    return averaged


def _one_backward(build, units, **fully_shard_kwargs) -> tuple[dict, dict]:
    """One backward on this rank's input of `build()` sharded (`units(model)`, bottom-up, each
    wrapped with `fully_shard_kwargs`) and unsharded: the sharded model's gradients and the
    unsharded one's averaged over ranks."""
    torch.manual_seed(0)
    reference = build().to(current_device())
    torch.manual_seed(0)
    model = build().to(current_device())
    for unit in units(model):
        fully_shard(unit, **fully_shard_kwargs)
    x = _inputs(dist.get_rank())
    model(x).backward()
    reference(x).backward()
    return _grads(model), _averaged_grads(reference)


def _assert_grads_match(results: list[tuple[dict, dict]]) -> None:
    for grads, expected in results:
        assert grads.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name], msg=name)


def _unused_on_some_ranks(strategy: str, one_f_one_b: bool) -> tuple[dict, dict]:
    rank = dist.get_rank()
    # Rank 0 never uses blocks[1].b; the others do.
    use_b = (True, rank != 0)
    batches = [(_inputs(10 * rank + i), use_b) for i in range(2 if one_f_one_b else 1)]
    model = _build(strategy)
    losses = [model(x, use) for x, use in batches]  # all forwards first (1F1B order)
    for loss in losses:
        loss.backward()
    return _grads(model), _averaged_reference_grads(batches)


@pytest.mark.parametrize("one_f_one_b", [False, True], ids=["1f1b-off", "1f1b"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim"])
def test_parameters_unused_on_some_ranks_reduce_correctly(strategy, one_f_one_b):
    _assert_grads_match(run_distributed(_unused_on_some_ranks, 2, strategy, one_f_one_b))


def _recompute_training(granularity: str | None, strategy: str) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = tiny_gpt_config(recompute_granularity=granularity) if granularity else None
    model = build_tiny_gpt(config)
    for layer in model.decoder.layers:
        fully_shard(layer, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    registered_after_backward = []
    for tokens, labels in make_token_batches(STEPS, 12):
        tokens, labels = (
            shard_batch(tokens, rank, world_size),
            shard_batch(labels, rank, world_size),
        )
        model(tokens, labels=labels).mean().backward()
        registered_after_backward.append(
            all(isinstance(p, DTensor) and p.grad is not None for p in model.parameters())
        )
        optimizer.step()
        optimizer.zero_grad()
    return dict(state=gathered_weights(model), registered=registered_after_backward)


@pytest.mark.parametrize("granularity", ["full", "selective"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_activation_recompute_trains_like_single_process(granularity, strategy):
    expected = train_reference("gpt", False)
    for r in run_distributed(_recompute_training, 2, granularity, strategy):
        assert all(r["registered"]), "compute weights left registered after backward"
        for name in expected:
            torch.testing.assert_close(r["state"][name], expected[name], msg=name)


class Pair(torch.nn.Module):
    """A unit with two outputs that both need gradients."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(DIM, DIM)
        self.b = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class Reuse(torch.nn.Module):
    """Runs one unit twice in a forward and reads both outputs of another."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.pair = Pair()
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.pair(self.block(x))
        return self.head(self.block(torch.tanh(a) * b)).pow(2).mean()


def _reused_units(strategy: str, max_units: int) -> tuple[dict, dict]:
    return _one_backward(
        Reuse,
        lambda model: (model.block, model.pair, model),
        sharding_strategy=strategy,
        overlap_policy=OverlapPolicy(max_unsharded_units=max_units),
    )


@pytest.mark.parametrize("max_units", [1, 2])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_a_unit_run_twice_and_a_unit_with_two_outputs_get_every_gradient(strategy, max_units):
    # The block's second run's backward reduces and releases it; the pair's backward, in
    # between, may free it (a bound of 1), so the first run's backward must gather it again and
    # reduce again. Either output's gradient starts the pair's backward.
    _assert_grads_match(run_distributed(_reused_units, 2, strategy, max_units))


@dataclasses.dataclass
class Hidden:
    """A unit output that pytree knows how to flatten (registered below)."""

    value: torch.Tensor


torch.utils._pytree.register_dataclass(Hidden)


class Wrapped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[Hidden, None]:
        return Hidden(torch.tanh(self.linear(x))), None


class WrappedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(DIM, DIM)  # so `first`'s backward reads its weight
        self.first = Wrapped()
        self.second = Block()
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.first(self.embed(x))
        return self.head(self.second(hidden.value)).pow(2).mean()


def _output_inside_a_pytree_node() -> tuple[dict, dict]:
    return _one_backward(
        WrappedNet,
        lambda model: (model.first, model.second, model),
        overlap_policy=OverlapPolicy(max_unsharded_units=1),
    )


def test_an_output_inside_a_registered_pytree_node_gathers_before_its_backward():
    # `first` is freed when the forward ends; only a hook on the tensor inside `Hidden` gathers
    # it again before its backward.
    _assert_grads_match(run_distributed(_output_inside_a_pytree_node, 2))


def _checkpoint_inside_root() -> tuple[dict, dict]:
    x = _inputs(dist.get_rank())
    model = _build("optim_grads_params", inner_checkpoint=True)
    model(x).backward()
    return _grads(model), _averaged_reference_grads([(x, (True, True))])


def test_checkpoint_inside_a_unit_sees_its_compute_weights():
    _assert_grads_match(run_distributed(_checkpoint_inside_root, 2))


def _after_failed_backward(strategy: str) -> tuple[dict, dict]:
    x = _inputs(dist.get_rank())
    model = _build(strategy)
    with pytest.raises(RuntimeError, match="simulated failure"):
        model(x, fail=True).backward()
    for param in model.parameters():
        param.grad = None
    model.zero_grad()
    for context in fsdp_contexts(model):
        context.zero_grad()
    model(x).backward()
    return _grads(model), _averaged_reference_grads([(x, (True, True))])


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_backward_after_a_failed_backward_is_complete(strategy):
    _assert_grads_match(run_distributed(_after_failed_backward, 2, strategy))


def _backward_with_create_graph(strategy: str) -> tuple[dict, dict]:
    """`backward(create_graph=True)` runs the engine's hooks with grad mode on: the reductions
    must record nothing, so the gradients handed to the optimizer carry no history."""
    x = _inputs(dist.get_rank())
    model = _build(strategy)
    model(x).backward(create_graph=True)
    with_history = [n for n, p in model.named_parameters() if p.grad.requires_grad]
    assert with_history == [], f"gradients with autograd history: {with_history}"
    return _grads(model), _averaged_reference_grads([(x, (True, True))])


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "no_shard"])
def test_backward_with_create_graph_reduces_without_recording(strategy):
    _assert_grads_match(run_distributed(_backward_with_create_graph, 2, strategy))


def _gradient_penalty(strategy: str, units: bool) -> tuple[dict, dict, list[bool]]:
    """A double backward: the loss plus a penalty on its gradient to the input (made with
    `create_graph=True`), one backward through both. Returns the gradients, an unsharded
    Net's averaged over ranks, and whether each group still holds compute weights after it."""

    def penalised(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        loss = model(x)
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        return loss + grad.pow(2).sum()

    x = _inputs(dist.get_rank())
    torch.manual_seed(0)
    model = Net().to(current_device())
    for unit in [*model.blocks, model] if units else [model]:
        fully_shard(unit, sharding_strategy=strategy)
    penalised(model, x).backward()
    torch.manual_seed(0)
    reference = Net().to(current_device())
    penalised(reference, x).backward()
    whole = [
        group.weights.unsharded.is_allocated
        for context in fsdp_contexts(model)
        for unit in context.units()
        for group in unit.groups
    ]
    return _grads(model), _averaged_grads(reference), whole


@pytest.mark.parametrize("units", [True, False], ids=["units", "root-only"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_a_gradient_penalty_trains_like_single_process(strategy, units):
    """ZeRO-3 keeps the compute weights the penalty's graph saved until the backward through it
    (it freed them, and that backward read freed memory), and frees them then."""
    results = run_distributed(_gradient_penalty, 2, strategy, units)
    _assert_grads_match([(grads, expected) for grads, expected, _ in results])
    if strategy == "optim_grads_params":
        assert [whole for _, _, whole in results] == [[False] * len(results[0][2])] * 2


def _second_step_grads(dtype_name: str, strategy: str, set_to_none: bool) -> dict:
    dtype = getattr(torch, dtype_name)
    model = _build(strategy, dtype)
    optimizer = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for step in range(2):
        model(_inputs(10 * step + dist.get_rank(), dtype)).backward()
        grads = _grads(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return grads


@pytest.mark.parametrize(
    "dtype_name, strategy",
    [("bfloat16", "optim_grads_params"), ("float32", "optim"), ("float32", "optim_grads")],
)
def test_zero_grad_without_set_to_none_does_not_leak_old_gradients(dtype_name, strategy):
    kept = run_distributed(_second_step_grads, 2, dtype_name, strategy, False)
    cleared = run_distributed(_second_step_grads, 2, dtype_name, strategy, True)
    for a, b in zip(kept, cleared):
        for name in b:
            torch.testing.assert_close(a[name], b[name], msg=name)


def _load_zeros(dtype_name: str, strategy: str) -> float:
    dtype = getattr(torch, dtype_name)
    model = _build(strategy, dtype)
    x = _inputs(0, dtype)
    with torch.no_grad():
        model(x)
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    with torch.no_grad():
        return model(x).item()


@pytest.mark.parametrize(
    "dtype_name, strategy",
    [("float32", "optim_grads_params"), ("bfloat16", "optim_grads_params"), ("float32", "optim")],
)
def test_load_state_dict_refreshes_compute_weights(dtype_name, strategy):
    assert run_distributed(_load_zeros, 2, dtype_name, strategy) == [0.0, 0.0]


def _written_through_state_dict(dtype_name: str, strategy: str, path: str) -> list[float]:
    """Losses after zeros are written into the values `state_dict()` returns, which alias the
    main weights: in place into their local tensors after a forward that followed
    `state_dict()`, then by `torch.distributed.checkpoint`'s load of a checkpoint of zeros
    (after ones). Each time a forward with autograd whose backward never ran came first
    (ZeRO-3's units then still hold compute weights)."""
    dtype = getattr(torch, dtype_name)
    model = _build(strategy, dtype)
    x = _inputs(0, dtype)
    values = model.state_dict().values()
    model(x)
    for value in values:
        value.to_local().zero_()
    losses = [model(x).item()]
    dcp.save({k: torch.zeros_like(v) for k, v in model.state_dict().items()}, checkpoint_id=path)
    for value in model.state_dict().values():
        value.to_local().fill_(1.0)
    model(x)
    dcp.load(model.state_dict(), checkpoint_id=path)
    with torch.no_grad():
        losses.append(model(x).item())
    return losses


@pytest.mark.parametrize(
    "dtype_name, strategy",
    [
        ("float32", "optim"),
        ("float32", "optim_grads"),
        ("float32", "optim_grads_params"),
        ("bfloat16", "no_shard"),
    ],
)
def test_writes_into_state_dict_values_refresh_compute_weights(dtype_name, strategy, tmp_path):
    """What `dcp.load(model.state_dict())` does on resume: the next forward computes with the
    loaded weights."""
    results = run_distributed(_written_through_state_dict, 2, dtype_name, strategy, str(tmp_path))
    assert results == [[0.0, 0.0]] * 2


def _saved_with_torch_save(strategy: str) -> list[float]:
    """`torch.save(model.state_dict())` and `copy.deepcopy` of it (before: "invalid python
    storage" for every tensor after the first of a group), then loaded into a model of other
    weights: the same output as the saved model's."""
    model = _build(strategy)
    x = _inputs(0)
    with torch.no_grad():
        expected = model(x).item()
    stream = io.BytesIO()
    torch.save(model.state_dict(), stream)
    copies = copy.deepcopy(model.state_dict())
    outputs = []
    for state in (torch.load(io.BytesIO(stream.getvalue())), copies):
        other = _build(strategy)
        with torch.no_grad():
            for param in other.parameters():
                param.add_(1.0)
        other.load_state_dict(state)
        with torch.no_grad():
            outputs.append(other(x).item() - expected)
    return outputs


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params", "no_shard"])
def test_state_dict_saves_with_torch_save_and_deepcopies(strategy):
    assert run_distributed(_saved_with_torch_save, 2, strategy) == [[0.0, 0.0]] * 2


def _freeze_after_wrap() -> dict:
    model = _build("optim_grads_params")
    optimizer = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    weight = model.blocks[0].a.weight
    weight.requires_grad_(False)
    before = weight.full_tensor().clone()
    model(_inputs(dist.get_rank())).backward()
    optimizer.step()
    return dict(
        grad_is_none=weight.grad is None, unchanged=torch.equal(before, weight.full_tensor())
    )


def test_freezing_a_main_weight_after_wrapping_stops_its_updates():
    assert run_distributed(_freeze_after_wrap, 2) == [dict(grad_is_none=True, unchanged=True)] * 2


def _unfreeze_after_wrap() -> str:
    torch.manual_seed(0)
    model = Net().to(current_device())
    model.blocks[0].requires_grad_(False)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.blocks[0].requires_grad_(True)
    with pytest.raises(ValueError) as error:
        model(_inputs(dist.get_rank()))
    return str(error.value)


def test_unfreezing_a_weight_frozen_before_wrapping_is_refused():
    """Its group keeps no gradients (before: it silently never trained again, while whole
    gradients piled up on its compute weights)."""
    for message in run_distributed(_unfreeze_after_wrap, 2):
        assert message.startswith("a.weight was frozen (requires_grad=False) when fully_shard")
        assert "Set requires_grad before fully_shard()" in message


def test_sparse_embeddings_are_refused():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4, sparse=True), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"0 \(Embedding\) makes sparse gradients"):
        fully_shard(model)


def _deleted_model_is_freed(strategy: str) -> bool:
    model = _build(strategy)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()), model)
    model(_inputs(0)).backward()
    optimizer.step()
    refs = [weakref.ref(model), weakref.ref(model.blocks[0])]
    del model, optimizer
    alive_without_gc = any(ref() is not None for ref in refs)
    gc.collect()
    return alive_without_gc


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_deleting_the_model_frees_it_without_garbage_collection(strategy):
    assert run_distributed(_deleted_model_is_freed, 2, strategy) == [False, False]


def _reduce_in(
    model_dtype: torch.dtype, comm_dtype: torch.dtype
) -> tuple[dict, dict, int, list[int]]:
    """One backward of a `model_dtype` Net reducing in `comm_dtype`: its gradients, the
    unsharded Net's (averaged over ranks in fp32), how many casts into a reduction buffer
    (`torch._foreach_copy_` outside the all-gathers, which cast the weights with it) it made,
    and how many inputs each reduce-scatter read."""
    torch.manual_seed(0)
    reference = Net().to(current_device(), model_dtype)
    torch.manual_seed(0)
    model = Net().to(current_device(), model_dtype)
    for unit in (*model.blocks, model):
        fully_shard(unit, mp_policy=MixedPrecisionPolicy(grad_comm_dtype=comm_dtype))
    x = _inputs(dist.get_rank(), model_dtype)
    foreach_copy, all_gather_tensors = torch._foreach_copy_, Collectives.all_gather_tensors
    reduce_scatter_tensors = Collectives.reduce_scatter_tensors
    gathering = [False]
    num_casts = [0]
    num_inputs = []

    def cast(*args, **kwargs):
        num_casts[0] += not gathering[0]
        return foreach_copy(*args, **kwargs)

    def gather(*args, **kwargs):
        gathering[0] = True
        try:
            return all_gather_tensors(*args, **kwargs)
        finally:
            gathering[0] = False

    def reduce_scatter(self, outputs, inputs, *args, **kwargs):
        num_inputs.append(len(inputs))
        return reduce_scatter_tensors(self, outputs, inputs, *args, **kwargs)

    with (
        mock.patch.object(torch, "_foreach_copy_", cast),
        mock.patch.object(Collectives, "all_gather_tensors", gather),
        mock.patch.object(Collectives, "reduce_scatter_tensors", reduce_scatter),
    ):
        model(x).backward()
    reference(x).backward()
    expected = {}
    for name, param in reference.named_parameters():
        grad = param.grad.float()
        dist.all_reduce(grad)
        expected[name] = grad / dist.get_world_size()
    return _grads(model), expected, num_casts[0], num_inputs


@pytest.mark.parametrize(
    "model_dtype, comm_dtype, num_casts",
    [
        # Each unit's gradients are cast once, whole, into the reduction buffer.
        (torch.bfloat16, torch.float32, 3),
        (torch.float32, torch.bfloat16, 3),
        # Already in the reduction dtype: the blocks' gradients are reduced in place; the
        # root's head (1 row over 2 ranks) has a padded chunk, so it is copied (padding zeroed).
        (torch.float32, torch.float32, 1),
    ],
)
def test_gradients_reduce_scatter_from_the_whole_tensors_in_any_dtype(
    model_dtype, comm_dtype, num_casts
):
    for grads, expected, casts, inputs in run_distributed(_reduce_in, 2, model_dtype, comm_dtype):
        # One input per tensor (4 per block, the head's weight and bias), none packed.
        assert (casts, sorted(inputs)) == (num_casts, [2, 4, 4])
        assert grads.keys() == expected.keys()
        if model_dtype == comm_dtype == torch.float32:
            for name in expected:
                torch.testing.assert_close(grads[name], expected[name])
        else:
            for name in expected:  # bf16 (compute or reduction): 8 mantissa bits
                torch.testing.assert_close(grads[name], expected[name], rtol=1e-2, atol=1e-3)
