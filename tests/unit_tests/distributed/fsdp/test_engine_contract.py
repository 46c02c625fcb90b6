"""The engine contract, tried as a library user with their own loop would: any optimizer, any
number of backward passes, in-place writes, misuse of `microbatch()`, a failed backward, a unit
skipped on some ranks, rejected dtypes, and the DDP engine under a stock optimizer. Each result
is compared with a plain single-process torch run on the same global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES
from megatron.core.distributed.fsdp import (
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    fully_shard,
    fully_shard_optimizer,
    local_main_weights,
    microbatch,
)
from megatron.core.distributed.fsdp.roots import fsdp_contexts, parameter_groups
from tests.unit_tests.distributed.fsdp.fsdp_training import (
    BF16_MAX_UPDATE_ERROR,
    assert_update_close,
    build_model,
    full_state,
    hybrid_groups,
    make_batches,
    train_fsdp,
    train_reference,
)
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)

# Every strategy, and HSDP (ZeRO-3 inside two replicas of world_size / 2 ranks).
LAYOUTS = [(s, 1) for s in SHARDING_STRATEGIES] + [("optim_grads_params", 2)]
WORLD_SIZES = [2, 4]
# Below the uneven model's gradient norms (1.2 to 2.1): every step is clipped.
CLIP_NORM = 0.05


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated failure in backward")


def _sharded(strategy: str, index, model: torch.nn.Module) -> torch.nn.Module:
    for block in model.blocks:
        fully_shard(block, index, sharding_strategy=strategy)
    return fully_shard(model, index, sharding_strategy=strategy)


def _local_batch(inputs: torch.Tensor, labels: torch.Tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return shard_batch(inputs, rank, world_size), shard_batch(labels, rank, world_size)


def _global_mean(loss: torch.Tensor) -> float:
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _backward_twice_over_replaced_grads(model, loss, inputs, labels) -> None:
    """Backward, `.grad` replaced by new tensors (half of it), then another backward, which
    torch adds to what `.grad` holds."""
    loss.backward()
    for param in model.parameters():
        param.grad = param.grad * 0.5
    model(inputs, labels=labels).mean().backward()


def _train(case: str, strategy: str, replicas: int) -> tuple[list[float], dict]:
    """Three steps of the uneven model under `case`, on this rank's shard of each batch."""
    with hybrid_groups(replicas) as index:
        model = _sharded(strategy, index, build_model("uneven", False))
        if case == "stock_local":
            optimizer = torch.optim.AdamW(local_main_weights(model).values(), lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if case == "is_first_false":
            optimizer = fully_shard_optimizer(optimizer, model)
        losses = []
        for step, (inputs, labels) in enumerate(make_batches("uneven")):
            inputs, labels = _local_batch(inputs, labels)
            if case == "inplace_write" and step == 1:
                with torch.no_grad():
                    model(inputs, labels=labels)  # the no_grad forward refreshes nothing new
                    for param in model.parameters():
                        param.mul_(0.5)  # an EMA swap or re-init: written in place
            if case == "failed_backward" and step == 1:
                handle = model.blocks[0].register_forward_hook(
                    lambda module, args, output: _FailInBackward.apply(output)
                )
                with pytest.raises(RuntimeError, match="simulated failure"):
                    model(inputs, labels=labels).mean().backward()
                handle.remove()
                optimizer.zero_grad()
            if case == "is_first_false":
                for half in range(2):
                    with microbatch(model, is_first=False, is_last=half == 1):
                        rows = slice(half * len(inputs) // 2, (half + 1) * len(inputs) // 2)
                        model(inputs[rows], labels=labels[rows]).sum().div(len(inputs)).backward()
                with torch.no_grad():
                    losses.append(_global_mean(model(inputs, labels=labels).mean()))
            elif case == "two_backwards":
                out = model(inputs, labels=labels)
                half = len(out) // 2
                loss_a, loss_b = out[:half].sum() / len(out), out[half:].sum() / len(out)
                loss_a.backward(retain_graph=True)
                loss_b.backward()
                losses.append(_global_mean(loss_a + loss_b))
            elif case == "replaced_grad":
                loss = model(inputs, labels=labels).mean()
                _backward_twice_over_replaced_grads(model, loss, inputs, labels)
                losses.append(_global_mean(loss))
            else:
                loss = model(inputs, labels=labels).mean()
                loss.backward()
                losses.append(_global_mean(loss))
            if case == "clip_grad_norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            optimizer.step()
            optimizer.zero_grad()
        return losses, full_state(model)


def _reference(case: str) -> tuple[list[float], dict]:
    """The same steps in one process, on the whole batch."""
    model = build_model("uneven", False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, (inputs, labels) in enumerate(make_batches("uneven")):
        inputs, labels = inputs.to(current_device()), labels.to(current_device())
        if case == "inplace_write" and step == 1:
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(0.5)
        loss = model(inputs, labels=labels).mean()
        if case == "replaced_grad":
            _backward_twice_over_replaced_grads(model, loss, inputs, labels)
        else:
            loss.backward()
        losses.append(loss.item())
        if case == "clip_grad_norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return losses, full_state(model)


def _batch_of(strategy: str | None, inputs: torch.Tensor, labels: torch.Tensor):
    """This rank's shard of a global batch, or the whole batch for one process (None)."""
    if strategy is None:
        return inputs.to(current_device()), labels.to(current_device())
    return _local_batch(inputs, labels)


def _two_optimizers(strategy: str | None) -> dict:
    """The blocks' optimizer (given to `fully_shard_optimizer`) steps every iteration, the
    other weights' every second one, over two backwards' summed gradients (torch's rule while
    nothing zeroes them); `strategy` None: one process on the whole batch."""
    model = build_model("uneven", False)
    if strategy is not None:
        model = _sharded(strategy, None, model)
    blocks = list(model.blocks.parameters())
    others = [p for p in model.parameters() if all(p is not b for b in blocks)]
    every_step = torch.optim.SGD(blocks, lr=0.1)
    every_other = torch.optim.SGD(others, lr=0.1)
    if strategy is not None:
        fully_shard_optimizer(every_step, model)
    for step, (inputs, labels) in enumerate(make_batches("uneven")):
        inputs, labels = _batch_of(strategy, inputs, labels)
        model(inputs, labels=labels).mean().backward()
        every_step.step()
        every_step.zero_grad()
        if step % 2 == 1:
            every_other.step()
            every_other.zero_grad()
    return full_state(model)


def _two_optimizers_on_every_strategy() -> list[dict]:
    return [_two_optimizers(None), *map(_two_optimizers, SHARDING_STRATEGIES)]


def test_an_optimizer_consumes_only_its_own_gradients():
    """Before: `fully_shard_optimizer(every_step, model)` marked every group's gradients used at
    its step, so the other optimizer stepped on the last backward's gradients alone."""
    for reference, *sharded in run_distributed(_two_optimizers_on_every_strategy, 2):
        for strategy, state in zip(SHARDING_STRATEGIES, sharded):
            for name in reference:
                torch.testing.assert_close(state[name], reference[name], msg=f"{strategy} {name}")


def _compiled(strategy: str | None) -> dict:
    """Three AdamW steps of the model under `torch.compile` (wrapped with `strategy`, on this
    rank's shard of each batch), or of the plain model on the whole batch (None)."""
    model = build_model("uneven", False)
    if strategy is not None:
        model = _sharded(strategy, None, model)
    compiled = torch.compile(model, backend="aot_eager") if strategy is not None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for inputs, labels in make_batches("uneven"):
        inputs, labels = _batch_of(strategy, inputs, labels)
        compiled(inputs, labels=labels).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_state(model)


def _compiled_on_strategies() -> list[dict]:
    return [_compiled(None), _compiled("optim_grads_params"), _compiled("optim")]


def test_torch_compile_of_the_wrapped_model_trains_like_one_process():
    """The unit hooks run eagerly (before: Dynamo traced into them and failed on the process
    group's all-gather method)."""
    for reference, *compiled in run_distributed(_compiled_on_strategies, 2):
        for state in compiled:
            for name in reference:
                torch.testing.assert_close(state[name], reference[name], msg=name)


def _plain_tensor_as_grad() -> str:
    model = _sharded("optim_grads_params", None, build_model("uneven", False))
    inputs, labels = _local_batch(*make_batches("uneven")[0])
    model(inputs, labels=labels).mean().backward()
    param = next(model.parameters())
    param.grad = torch.zeros(param.shape, device=param.device)
    with pytest.raises(ValueError) as error:
        model(inputs, labels=labels).mean().backward()
    return str(error.value)


def test_a_plain_tensor_assigned_to_a_sharded_grad_is_refused_by_name():
    """Its values are the whole tensor's, not this rank's shard's: adding to them is refused."""
    for message in run_distributed(_plain_tensor_as_grad, 2):
        assert "the .grad assigned to inp.weight is not a DTensor placed like" in message


def _case_on_every_layout(case: str) -> list[tuple[list[float], dict]]:
    results = []
    for strategy, replicas in LAYOUTS:
        if dist.get_world_size() % (2 * replicas) == 0 or replicas == 1:
            results.append(_train(case, strategy, replicas))
    return [*results, _reference(case)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "case",
    [
        "stock_params",
        "stock_local",
        "inplace_write",
        "is_first_false",
        "two_backwards",
        "failed_backward",
        "replaced_grad",
        "clip_grad_norm",
    ],
)
def test_library_use_equals_single_process(case, world_size):
    """Cases 1-6: a stock optimizer over `parameters()` or `local_main_weights()` (no
    `fully_shard_optimizer`), an in-place write after a no_grad forward, `is_first=False` on
    every microbatch, two backward passes through one forward, and a backward that raised then
    `zero_grad()`; and a backward onto `.grad` the user replaced (before: the replacement was
    kept and the later backward's gradients lost), and torch's `clip_grad_norm_` over the
    DTensor gradients: every strategy and HSDP train as one process does."""
    for rank_results in run_distributed(_case_on_every_layout, world_size, case):
        *layouts, (ref_losses, ref_state) = rank_results
        assert len(layouts) == len(LAYOUTS) - (world_size == 2)
        for losses, state in layouts:
            torch.testing.assert_close(losses, ref_losses)
            for name, value in ref_state.items():
                torch.testing.assert_close(state[name], value, msg=name)


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_stock_optimizer_on_a_bf16_model_equals_single_process(strategy):
    """Case 1 with bf16 compute (fp32 main weights: the compute weights differ from them under
    every strategy), against one process with bf16 compute and fp32 masters. SGD's bound holds
    the error to bf16 rounding; weights never refreshed would miss the update entirely."""
    results = run_distributed(
        train_fsdp, 2, "uneven", strategy, 1, True, optimizer="sgd", connect_optimizer=False
    )
    expected = train_reference("uneven", True, optimizer="sgd", world_size=2)
    initial = full_state(build_model("uneven", True))
    assert_update_close(results, expected, initial, BF16_MAX_UPDATE_ERROR["sgd"])


def _grad_states(strategy: str) -> list[list[str]]:
    """The gradient state of every trainable group after each event of a step's lifecycle."""
    model = _sharded(strategy, None, build_model("uneven", False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = [g for g in parameter_groups(model) if g.requires_grad]
    inputs, labels = _local_batch(*make_batches("uneven")[0])
    seen = []

    def record() -> None:
        seen.append(sorted({g.grad_state.name for g in groups}))

    record()
    with microbatch(model, is_last=False):
        model(inputs, labels=labels).mean().backward()
    record()
    fsdp_contexts(model)[0].finalize_grads()
    record()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        model(inputs, labels=labels)  # the forward frees what the optimizer dropped
    record()
    model(inputs, labels=labels).mean().backward()
    fsdp_contexts(model)[0].zero_grad()
    record()
    return seen


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_gradient_state_machine(strategy):
    expected = [["EMPTY"], ["ACCUMULATING"], ["READY"], ["EMPTY"], ["EMPTY"]]
    assert run_distributed(_grad_states, 2, strategy) == [expected, expected]


class _Skipping(torch.nn.Module):
    """The uneven model, whose second block rank 1 skips (data-dependent skipping)."""

    def __init__(self):
        super().__init__()
        self.inner = build_model("uneven", False)
        self.blocks = self.inner.blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner.inp(x)
        for i, block in enumerate(self.blocks):
            if i == 1 and dist.get_rank() == 1:
                continue
            h = block(h)
        return self.inner.head(h).pow(2).mean()


def _skip_a_unit(strategy: str) -> str:
    model = _sharded(strategy, None, _Skipping())
    inputs, _ = _local_batch(*make_batches("uneven")[0])
    with pytest.raises(RuntimeError) as error:
        model(inputs).backward()
    return str(error.value)


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_a_unit_skipped_on_some_ranks_is_a_named_error_on_every_rank(strategy):
    """Case 7: every rank raises, naming the unit, instead of hanging (the harness bounds
    the call's time)."""
    for message in run_distributed(_skip_a_unit, 2, strategy, timeout=60, reuse_pool=False):
        assert "blocks.1 ran on rank 0 but not on rank 1" in message


def test_fp16_main_weights_are_rejected_naming_the_flag():
    """Case 8."""
    with pytest.raises(ValueError, match="main_params_dtype"):
        MixedPrecisionPolicy(main_params_dtype=torch.float16)
    with pytest.raises(ValueError, match="megatron_fsdp_main_params_dtype=fp16"):
        DistributedDataParallelConfig(
            use_megatron_fsdp=True, megatron_fsdp_main_params_dtype=torch.float16
        )


def _stock_optimizer_over(engine: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Case 9 and the adapter: a tiny GPT under `engine` with a stock SGD over the model's
    parameters, and the same in one process; the final weights of both."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_tiny_gpt()
    fsdp = engine != "ddp"
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=fsdp, data_parallel_sharding_strategy=engine if fsdp else "no_shard"
    )
    wrapper = (FullyShardedDataParallel if fsdp else DistributedDataParallel)(
        model.config, config, model
    )
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.5)
    reference = build_tiny_gpt()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for tokens, labels in make_token_batches(2, 8):
        wrapper.zero_grad_buffer()
        local = shard_batch(tokens, rank, world_size), shard_batch(labels, rank, world_size)
        out = wrapper(local[0], labels=local[1])
        # Two backward passes through one forward: the embedding and the root reduce twice.
        half = out.shape[0] // 2
        out[:half].sum().div(out.numel()).backward(retain_graph=True)
        out[half:].sum().div(out.numel()).backward()
        wrapper.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        reference(tokens.to(current_device()), labels=labels.to(current_device())).mean().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    state = full_state(wrapper.module)
    return [state[n] for n, _ in reference.named_parameters()], [
        p.detach() for p in reference.parameters()
    ]


@pytest.mark.parametrize("engine", ["ddp", *SHARDING_STRATEGIES])
def test_a_stock_optimizer_trains_every_engine_like_one_process(engine):
    for trained, expected in run_distributed(_stock_optimizer_over, 2, engine):
        for actual, want in zip(trained, expected):
            torch.testing.assert_close(actual, want)


def _ddp_bf16_stock_step() -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """bf16 parameters whose gradients reduce in fp32: `finish_grad_sync()` can hand out no
    view, so a stock optimizer gets each gradient, cast, as it steps."""
    config = tiny_gpt_config(bf16=True, params_dtype=torch.bfloat16)
    model = build_tiny_gpt(config)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    tokens, labels = make_token_batches(1, 4)[0]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokens, labels = shard_batch(tokens, rank, world_size), shard_batch(labels, rank, world_size)
    ddp(tokens, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    params = list(ddp.parameters())
    no_grad_before_step = all(p.grad is None for p in params)
    # SGD's update on the reduced gradients, in the parameters' dtype, written out.
    expected = [p.detach() - 0.5 * p.main_grad.to(p.dtype) for p in params]
    optimizer.step()
    return [p.detach() for p in params], expected, no_grad_before_step


def test_ddp_hands_a_cast_gradient_to_a_stock_optimizer_as_it_steps():
    for stepped, expected, no_grad_before_step in run_distributed(_ddp_bf16_stock_step, 2):
        assert no_grad_before_step, "a copy was made before any optimizer asked for it"
        for actual, want in zip(stepped, expected):
            torch.testing.assert_close(actual, want, rtol=0, atol=0)
