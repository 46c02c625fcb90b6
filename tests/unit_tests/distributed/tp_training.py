"""Training runs of a tensor-parallel model under each engine, and the single-process reference
they must match (shared by the TP engine and checkpoint tests).

Groups are built by hand in Megatron's rank order (tp contiguous, dp strided by the TP size;
under hybrid sharding dp splits into `replicas` contiguous shard groups). `build_toy_tp` is
the default model builder: `builder(tp_group)` returns a model taking `(inputs, labels)` and
returning per-sample losses; a real tensor-parallel GPT builder can be passed instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layout import full_tensor
from tests.unit_tests.distributed.moe_training import (
    MICRO_BATCH,
    MICROBATCHES,
    Engine,
    RunResult,
    global_state,
    train_steps,
    wrap,
)
from tests.unit_tests.distributed.tp_toy import ToyTPBlock, build_toy_tp, make_batches

_groups: dict[tuple[int, int], ProcessGroupCollection] = {}


def tp_process_groups(tp_size: int, replicas: int = 1) -> ProcessGroupCollection:
    """The groups of TP `tp_size` over the world (`replicas` hybrid-sharding replicas), made
    once per process: every rank creates every group, in the same order."""
    key = (tp_size, replicas)
    if key not in _groups:
        world = dist.get_world_size()
        rank = dist.get_rank()
        ranks = torch.arange(world).view(-1, tp_size)  # [dp rank, tp rank]
        mine = {}
        shard = ranks.T.reshape(-1, world // tp_size // replicas)
        for name, grid in (
            ("tp", ranks),
            ("dp_cp", ranks.T),
            ("dp_cp_ag", shard),
            ("intra_dp_cp", shard),
            ("inter_dist_opt", ranks.T.reshape(tp_size, replicas, -1).transpose(1, 2)),
        ):
            for members in grid.reshape(-1, grid.shape[-1]).tolist():
                group = dist.new_group(members)
                if rank in members:
                    mine[name] = group
        if replicas == 1:
            mine.pop("intra_dp_cp")
            mine.pop("inter_dist_opt")
        if tp_size == 1:
            mine.pop("tp")
        _groups[key] = ProcessGroupCollection(dp=mine["dp_cp"], **mine)
    return _groups[key]


def optimizer_config(kind: str) -> OptimizerConfig:
    """SGD with momentum (linear in the gradient: scaling errors show) or AdamW."""
    if kind == "sgd":
        return OptimizerConfig(
            optimizer="sgd", lr=0.02, weight_decay=0.0, sgd_momentum=0.9, clip_grad=0.0
        )
    return OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.0, clip_grad=0.0)


class PlainOptimizer:
    """The reference: the torch optimizer `optimizer_config(kind)` describes and the norm of
    `torch.nn.utils.get_total_norm`, stepped as `train_steps` steps a `MegatronOptimizer`."""

    def __init__(self, model: torch.nn.Module, kind: str):
        config = optimizer_config(kind)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if kind == "sgd":
            self.torch = torch.optim.SGD(self.params, lr=config.lr, momentum=config.sgd_momentum)
        else:
            self.torch = torch.optim.AdamW(
                self.params,
                lr=config.lr,
                betas=(config.adam_beta1, config.adam_beta2),
                eps=config.adam_eps,
                weight_decay=config.weight_decay,
            )

    def zero_grad(self) -> None:
        self.torch.zero_grad()

    def step(self) -> tuple[bool, float, None]:
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        self.torch.step()
        return True, float(norm), None


def global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 4 data-parallel ranks' worth of samples (any dp size of 1, 2, 4 splits them)."""
    return make_batches(steps, 4 * MICROBATCHES * MICRO_BATCH)


def reference_run(batches, kind: str, builder=build_toy_tp) -> RunResult:
    """The whole model on one process, trained by plain PyTorch."""
    model = builder(None)
    result = RunResult()
    train_steps(model, PlainOptimizer(model, kind), batches, result)
    result.weights = global_state(model.state_dict())
    return result


def build(tp_size: int, engine: Engine, kind: str, builder=build_toy_tp):
    """The model at TP `tp_size` under `engine` (FSDP units: the blocks) and its optimizer."""
    groups = tp_process_groups(tp_size, engine.replicas)
    model = wrap(builder(groups.tp), engine, ToyTPBlock, pg_collection=groups)
    return model, get_megatron_optimizer(optimizer_config(kind), model), groups


def engine_run(tp_size: int, engine: Engine, kind: str, batches, builder=build_toy_tp):
    """Trains on `batches` at TP `tp_size` under `engine`; returns the run's result and the
    global values of the optimizer's main weights, and its params norm."""
    model, optimizer, groups = build(tp_size, engine, kind, builder)
    result = RunResult()
    dp = groups.dp_cp
    train_steps(model, optimizer, batches, result, dp.rank(), dp.size(), dp)
    result.weights = global_state(model.state_dict())
    mains = [
        full_tensor(main.detach()) if isinstance(main, DTensor) else main.detach().clone()
        for main in optimizer.get_main_params()
    ]
    return result, mains, optimizer.get_params_norm()
