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
) -> dict[str, torch.Tensor]:
    """Runs on every rank: STEPS optimizer steps of `kind` under `fully_shard`."""
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
        optimizer = fully_shard_optimizer(OPTIMIZERS[optimizer](model.parameters()), model)
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
) -> dict[str, torch.Tensor]:
    """One process, whole batch. bf16: bf16 compute with fp32 master weights and gradients
    (what Megatron-FSDP does), fp32 otherwise."""
    model = build_model(kind, bf16, **(model_kwargs or {}))
    freeze(model, frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    optimizer = OPTIMIZERS[optimizer](masters)
    for inputs, labels in make_batches(kind):
        model.zero_grad()
        loss_of(model, inputs.to(current_device()), labels.to(current_device()), bf16).backward()
        for master, param in zip(masters, params):
            master.grad = param.grad.float()
        optimizer.step()
        with torch.no_grad():
            for master, param in zip(masters, params):
                param.copy_(master)
    result = full_state(model)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    result.update({name: master.detach().clone() for name, master in zip(names, masters)})
    return result
