"""Training loops shared by the Megatron-FSDP tests: the engine on N ranks, and single-process
references on the concatenated batch (fp32, and bf16 compute with fp32 master weights)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.distributed.fsdp import (
    FSDPDistributedIndex,
    MixedPrecisionPolicy,
    fully_shard,
    fully_shard_optimizer,
    local_main_weights,
    microbatch,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.distributed_harness import current_device
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)

STEPS = 3
GLOBAL_BATCH = 12
LR = 1e-3
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR),
    # Plain SGD is linear in the gradient, so it catches scaling errors Adam normalises away.
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5),
}
UNEVEN_IN, UNEVEN_OUT = 5, 3


class UnevenBlock(torch.nn.Module):
    """Residual MLP with a (7, 15) weight and a 7-element bias: no dim divides 2 or 4."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(15, 7)
        self.fc2 = torch.nn.Linear(7, 15)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class UnevenNet(torch.nn.Module):
    """Small regression model; its head has fewer rows (3) than 4 ranks."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(UNEVEN_IN, 15)
        self.blocks = torch.nn.ModuleList(UnevenBlock() for _ in range(2))
        self.head = torch.nn.Linear(15, UNEVEN_OUT)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return ((self.head(h).float() - labels) ** 2).mean(-1)


def build_model(kind: str, bf16: bool, **model_kwargs) -> torch.nn.Module:
    """'gpt' (tiny GPTModel) or 'uneven' (UnevenNet), same weights on every call."""
    if kind == "gpt":
        config = tiny_gpt_config(bf16=True, params_dtype=torch.bfloat16) if bf16 else None
        return build_tiny_gpt(config, **model_kwargs)
    torch.manual_seed(1234)
    model = UnevenNet()
    return model.to(current_device(), torch.bfloat16 if bf16 else torch.float32)


def make_batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if kind == "gpt":
        return make_token_batches(STEPS, GLOBAL_BATCH)
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(GLOBAL_BATCH, UNEVEN_IN, generator=generator),
            torch.randn(GLOBAL_BATCH, UNEVEN_OUT, generator=generator),
        )
        for _ in range(STEPS)
    ]


def unit_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules made units below the root: GPT layers, or UnevenNet blocks."""
    if hasattr(model, "decoder"):
        return list(model.decoder.layers)
    return list(model.blocks)


def loss_of(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, bf16: bool
) -> torch.Tensor:
    if inputs.dtype.is_floating_point and bf16:
        inputs = inputs.to(torch.bfloat16)
    return model(inputs, labels=labels).mean()


# bf16: the reference runs the engine's arithmetic (the same bf16 backward per rank and
# microbatch, fp32 averaging and accumulation), yet kernels still round some bf16 gradients
# differently: on CPU, layer-norm weight gradients are one bf16 ulp apart when the weight is a
# view into a flat buffer; on H200 the gap is larger (its source not isolated). So the tests
# bound the whole update instead of each element: ||w - w_ref|| <= bound * ||w_ref - w_0||.
# - SGD is linear in the gradient, so the error stays at bf16 rounding: measured 0.04% (CPU) and
#   0.48% (H200). A dropped or doubled microbatch would move the update by a third or more.
# - AdamW turns one-ulp differences of near-zero gradients into lr-sized steps: measured 0.25%
#   to 0.8% (CPU) and 5.4% (H200). Its bound catches only gross errors; SGD's carries precision.
BF16_MAX_UPDATE_ERROR = {"sgd": 0.015, "adamw": 0.15}


def assert_update_close(results, expected, initial, bound):
    """Each rank's final `results` within `bound` of the update `initial` -> `expected`
    (norm over all parameters)."""
    update = sum(((expected[n] - initial[n]) ** 2).sum() for n in expected) ** 0.5
    assert update > 0, "training did nothing"
    for rank_state in results:
        assert rank_state.keys() == expected.keys()
        error = sum(((rank_state[n] - expected[n]) ** 2).sum() for n in expected) ** 0.5
        assert error <= bound * update, f"update error {(error / update).item():.2%}"


@contextlib.contextmanager
def hybrid_groups(num_replicas: int) -> Iterator[FSDPDistributedIndex]:
    """parallel_state with `num_replicas` distributed-optimizer instances, as an index."""
    if num_replicas == 1:
        yield FSDPDistributedIndex.from_pg_collection(None)
        return
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=num_replicas)
    try:
        yield FSDPDistributedIndex.from_pg_collection(
            ProcessGroupCollection.use_mpu_process_groups()
        )
    finally:
        parallel_state.destroy_model_parallel()


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole fp32 tensors of every parameter (DTensor main weights are gathered)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
        for name, p in model.named_parameters()
    }


def local_adamw(module: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the local tensors of `module`'s main weights, through `fully_shard_optimizer`:
    the steps of AdamW over the DTensors (`test_fsdp_parity`), without the sharding propagation
    of each optimizer op, which took 30-40% of the engine tests' time on CPU."""
    return fully_shard_optimizer(
        torch.optim.AdamW(local_main_weights(module).values(), lr=lr), module
    )


def train_fsdp(
    kind: str,
    strategy: str,
    num_microbatches: int,
    bf16: bool,
    *,
    outer: str = "no_shard",
    num_replicas: int = 1,
    model_kwargs: dict | None = None,
    optimizer: str = "adamw",
    frozen: tuple[str, ...] = (),
    local_shards: bool = True,
    connect_optimizer: bool = True,
) -> dict[str, torch.Tensor]:
    """Runs on every rank: STEPS optimizer steps of `kind` under `fully_shard`; the optimizer
    steps the main weights' local tensors, or without `local_shards` the DTensors themselves
    (the same arithmetic on the same storage: `test_fsdp_parity`); it goes through
    `fully_shard_optimizer` unless `connect_optimizer` is False.

    Local tensors by default: a stock optimizer over DTensors propagates the sharding of each
    of its ops for each new shape, which took 40% of these tests' time on CPU."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with hybrid_groups(num_replicas) as index:
        model = build_model(kind, bf16, **(model_kwargs or {}))
        freeze(model, frozen)
        policy = MixedPrecisionPolicy(main_grads_dtype=torch.float32)
        for unit in unit_modules(model):
            fully_shard(
                unit,
                index,
                sharding_strategy=strategy,
                mp_policy=policy,
                outer_dp_sharding_strategy=outer,
            )
        fully_shard(
            model,
            index,
            sharding_strategy=strategy,
            mp_policy=policy,
            outer_dp_sharding_strategy=outer,
        )
        params = local_main_weights(model).values() if local_shards else model.parameters()
        optimizer = OPTIMIZERS[optimizer](params)
        if connect_optimizer:
            optimizer = fully_shard_optimizer(optimizer, model)
        for inputs, labels in make_batches(kind):
            local_inputs = shard_batch(inputs, rank, world_size).chunk(num_microbatches)
            local_labels = shard_batch(labels, rank, world_size).chunk(num_microbatches)
            for i in range(num_microbatches):
                with microbatch(model, is_first=i == 0, is_last=i == num_microbatches - 1):
                    loss = loss_of(model, local_inputs[i], local_labels[i], bf16) / num_microbatches
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return full_state(model)


MEGATRON_LOOP_MICROBATCHES = 3


def megatron_loop(wrapper, optimizer, step_fn) -> list[float]:
    """Megatron's order of calls on a data-parallel wrapper (DDP engine or Megatron-FSDP):
    STEPS steps of MEGATRON_LOOP_MICROBATCHES microbatches of this rank's share of each global
    batch, `step_fn(optimizer)` after each; every microbatch's loss."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    n = MEGATRON_LOOP_MICROBATCHES
    losses = []
    for tokens, labels in make_token_batches(STEPS, GLOBAL_BATCH):
        tokens = shard_batch(tokens, rank, world_size).chunk(n)
        labels = shard_batch(labels, rank, world_size).chunk(n)
        wrapper.zero_grad_buffer()
        for i in range(n):
            with contextlib.nullcontext() if i == n - 1 else wrapper.no_sync():
                loss = wrapper(tokens[i], labels=labels[i]).mean() / n
                loss.backward()
            losses.append(loss.item())
        wrapper.finish_grad_sync()
        step_fn(optimizer)
        wrapper.start_param_sync()
    return losses


def freeze(model: torch.nn.Module, names: tuple[str, ...]) -> None:
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)


def train_reference(
    kind: str,
    bf16: bool,
    model_kwargs: dict | None = None,
    optimizer: str = "adamw",
    frozen: tuple[str, ...] = (),
    *,
    world_size: int = 1,
    num_microbatches: int = 1,
) -> dict[str, torch.Tensor]:
    """One process. fp32: the whole batch at once (what data parallelism must equal). bf16:
    bf16 compute with fp32 master weights, emulating Megatron-FSDP's arithmetic: one bf16
    backward per (rank, microbatch) slice, gradients averaged over ranks and summed over
    microbatches in fp32, so the two differ only by fp32 summation order."""
    model = build_model(kind, bf16, **(model_kwargs or {}))
    freeze(model, frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    optimizer = OPTIMIZERS[optimizer](masters)
    slices = world_size * num_microbatches
    for inputs, labels in make_batches(kind):
        inputs, labels = inputs.to(current_device()), labels.to(current_device())
        grads = [torch.zeros_like(m) for m in masters]
        for micro in range(num_microbatches):
            per_rank = []
            for rank in range(world_size):
                chunk = (
                    slice(None)
                    if slices == 1
                    else _slice(inputs, rank, micro, world_size, num_microbatches)
                )
                model.zero_grad()
                loss = loss_of(model, inputs[chunk], labels[chunk], bf16) / num_microbatches
                loss.backward()
                per_rank.append([p.grad.float() for p in params])
            for i, grad in enumerate(grads):
                grad += sum(g[i] for g in per_rank) / world_size
        for master, grad in zip(masters, grads):
            master.grad = grad
        optimizer.step()
        with torch.no_grad():
            for master, param in zip(masters, params):
                param.copy_(master)
    result = full_state(model)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    result.update({name: master.detach().clone() for name, master in zip(names, masters)})
    return result


def _slice(batch: torch.Tensor, rank: int, micro: int, world_size: int, num_microbatches: int):
    """The rows rank `rank` trains on in microbatch `micro` (shard_batch, then chunk)."""
    per_rank = batch.shape[0] // world_size
    per_micro = per_rank // num_microbatches
    start = rank * per_rank + micro * per_micro
    return slice(start, start + per_micro)
