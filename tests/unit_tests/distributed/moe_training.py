"""Training runs of an MoE model under each engine with expert parallelism, and the
single-process reference they must match (shared by the engine and checkpoint tests).

`Builder` is the model-builder signature (`moe_toy.build_toy_moe`): `builder(ep_group, device=)`
returns a model taking `(inputs, labels, route)` and returning per-sample losses, whose MoE
layers are of `layer_class`; a real GPT-MoE builder can be passed instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layout import full_tensor
from megatron.core.transformer.moe.moe_utils import update_expert_bias
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed.moe_toy import ToyMoELayer, build_toy_moe, make_moe_batches

Builder = Callable[..., torch.nn.Module]
NUM_EXPERTS = 4
MICROBATCHES = 2
MICRO_BATCH = 2  # samples per rank and microbatch
STEPS = 2


@dataclass(frozen=True)
class Engine:
    """An engine and its settings: "ddp" (optionally with the distributed optimizer and
    gradient-accumulation fusion) or "fsdp" with a sharding strategy (and R outer replicas:
    hybrid sharding, and the gradient-accumulation options)."""

    kind: str
    strategy: str = "no_shard"
    distributed_optimizer: bool = False
    outer_strategy: str = "no_shard"
    replicas: int = 1
    keep_unsharded_params: bool = False
    accumulate_unsharded_grads: bool = False
    gradient_accumulation_fusion: bool = False


@dataclass
class RunResult:
    """What a run records: the global mean loss and grad norm of each step, and the final
    global weights by name."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    def assert_matches(self, expected: RunResult, where: str) -> None:
        """This run's losses, norms and every weight are `expected`'s (`where` names the run in
        a failure)."""
        torch.testing.assert_close(self.losses, expected.losses, msg=f"{where} losses")
        torch.testing.assert_close(self.grad_norms, expected.grad_norms, msg=f"{where} norms")
        assert self.weights.keys() == expected.weights.keys()
        for name, weight in expected.weights.items():
            torch.testing.assert_close(self.weights[name], weight, msg=f"{where} {name}")


def optimizer_config(momentum: float = 0.0) -> OptimizerConfig:
    # SGD is linear in the gradient: scaling errors show in the weights (Adam would normalise
    # them away). Momentum gives the optimizer a state for checkpoints to carry.
    return OptimizerConfig(
        optimizer="sgd", lr=0.1, weight_decay=0.0, sgd_momentum=momentum, clip_grad=0.0
    )


def global_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole (global) value of a state-dict tensor."""
    return full_tensor(tensor) if isinstance(tensor, DTensor) else tensor.detach().clone()


def global_state(state: dict[str, object]) -> dict[str, torch.Tensor]:
    """The global value of each tensor of `state` (extra states, such as the FP8
    delayed-scaling state's bytes, left out)."""
    return {
        name: global_tensor(value)
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def init_groups(ep: int, replicas: int = 1) -> None:
    """parallel_state with expert parallelism `ep` and all-gather communicators."""
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=ep,
        num_distributed_optimizer_instances=replicas,
        create_all_gather_group=True,
    )


def wrap(
    module: torch.nn.Module,
    engine: Engine,
    layer_class: type = ToyMoELayer,
    pg_collection: ProcessGroupCollection | None = None,
) -> torch.nn.Module:
    """`module` under `engine`, over `pg_collection` (default: parallel_state's groups)."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=1,
        gradient_accumulation_fusion=engine.gradient_accumulation_fusion,
    )
    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    if engine.kind == "ddp":
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=engine.distributed_optimizer
        )
        return DistributedDataParallel(config, ddp_config, module, pg_collection=pg_collection)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=engine.strategy,
        outer_dp_sharding_strategy=engine.outer_strategy,
        num_distributed_optimizer_instances=engine.replicas,
        megatron_fsdp_keep_unsharded_params=engine.keep_unsharded_params,
        megatron_fsdp_accumulate_unsharded_grads=engine.accumulate_unsharded_grads,
    )
    return FullyShardedDataParallel(
        config, ddp_config, module, fsdp_unit_modules=[layer_class], pg_collection=pg_collection
    )


def train_steps(
    model: torch.nn.Module,
    optimizer: MegatronOptimizer | PlainSGD,
    batches: list[tuple[torch.Tensor, ...]],
    result: RunResult,
    rank: int = 0,
    world: int = 1,
    group: dist.ProcessGroup | None = None,
) -> None:
    """One optimizer step per global batch, in `MICROBATCHES` microbatches (all but the last
    under `no_sync()`), on data-parallel rank `rank`'s share (of `world`) of each; appends to
    `result`. The model takes the batch's parts; the loss is averaged over `group` (default:
    every rank), the data-parallel ranks. Routers with an expert bias move it before each step,
    from their tokens counted over `group`, as the training loop does."""
    distributed = hasattr(model, "no_sync")
    for batch in batches:
        if distributed:
            model.zero_grad_buffer()
        optimizer.zero_grad()
        total = torch.zeros(())
        micro = [part.chunk(MICROBATCHES) for part in batch]
        for m in range(MICROBATCHES):
            parts = [part[m].chunk(world)[rank] for part in micro]
            last = m == MICROBATCHES - 1
            scope = model.no_sync() if distributed and not last else contextlib.nullcontext()
            with scope:
                loss = model(*parts).mean() / MICROBATCHES
                loss.backward()
            total += loss.detach()
        if distributed:
            model.finish_grad_sync()
            dist.all_reduce(total, group=group)
            total /= world
        update_expert_bias([model], group)
        _, grad_norm, _ = optimizer.step()
        result.losses.append(float(total))
        result.grad_norms.append(grad_norm)


def global_batches(
    world: int, steps: int = STEPS, num_experts: int = NUM_EXPERTS
) -> list[tuple[torch.Tensor, ...]]:
    return make_moe_batches(steps, world * MICROBATCHES * MICRO_BATCH, num_experts)


class PlainSGD:
    """The reference optimizer: `torch.optim.SGD` with `optimizer_config`'s settings and the
    global gradient norm of `torch.nn.utils.get_total_norm`, stepped as `train_steps` steps a
    `MegatronOptimizer`."""

    def __init__(self, model: torch.nn.Module, momentum: float):
        config = optimizer_config(momentum)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sgd = torch.optim.SGD(
            self.params, lr=config.lr, momentum=momentum, weight_decay=config.weight_decay
        )

    def zero_grad(self) -> None:
        self.sgd.zero_grad()

    def step(self) -> tuple[bool, float, None]:
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        self.sgd.step()
        return True, float(norm), None


def reference_run(
    builder: Builder, batches: list[tuple[torch.Tensor, ...]], momentum: float = 0.0
) -> RunResult:
    """The model on one process (every expert local) over the whole global batches, trained by
    plain PyTorch (`PlainSGD`)."""
    model = builder(None)
    result = RunResult()
    train_steps(model, PlainSGD(model, momentum), batches, result)
    result.weights = global_state(model.state_dict())
    return result


def engine_run(
    builder: Builder,
    engine: Engine,
    ep: int,
    batches: list[tuple[torch.Tensor, ...]],
    layer_class: type = ToyMoELayer,
) -> RunResult:
    """The model under `engine` with expert parallelism `ep` on every rank of the world (FSDP
    units: the `layer_class` modules)."""
    init_groups(ep, engine.replicas)
    model = wrap(builder(parallel_state.get_expert_model_parallel_group()), engine, layer_class)
    result = RunResult()
    optimizer = get_megatron_optimizer(optimizer_config(), model)
    train_steps(model, optimizer, batches, result, dist.get_rank(), dist.get_world_size())
    result.weights = global_state(model.state_dict())
    return result


def default_builder(
    ep_group: dist.ProcessGroup | None, num_experts: int = NUM_EXPERTS, **kwargs
) -> torch.nn.Module:
    return build_toy_moe(ep_group, num_experts=num_experts, **kwargs)
