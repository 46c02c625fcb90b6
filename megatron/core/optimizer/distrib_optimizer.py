"""`DistributedOptimizer`: Megatron's step over this rank's shard of the DDP engine's parameters.

Megatron-LM's `--use-distributed-optimizer` (ZeRO-1/2) with the DDP engine: every rank still
holds the whole model and computes whole gradients, but the engine reduce-scatters its gradient
buckets (`BucketShards`), so each rank receives the averaged gradient of its shard only, and this
optimizer keeps fp32 main weights and optimizer state for that shard only (1/N of each, plus
the padding of short chunks). After the step it writes the updated shard into the model's
parameters and the engine all-gathers them (`start_param_sync(force_sync=True)`), as
Megatron-LM's `DistributedOptimizer` with `overlap_param_gather` off.

A rank's shard of a parameter is its dim-0 chunk (`torch.chunk`'s and DTensor `Shard(0)`'s
chunking, Megatron-FSDP's `ShardLayout`) rather than a range of flat elements as in Megatron-LM,
so its main weight and states are the local tensors of `Shard(0)` DTensors over the
data-parallel group: the checkpoint holds them as such (`sharded_state_dict`), and
`torch.distributed.checkpoint` reshards them to another data-parallel size, the plain DDP engine
or Megatron-FSDP. The torch optimizer steps plain local tensors (no DTensor dispatch); the norm,
clipping and unscaling read DTensor views of their gradients, whose `Shard(0)` placement makes
the norm all-reduce the partial sums over the group.

fp32 parameters are their own main weights: the optimizer steps views of this rank's rows of
them. Others (bf16) get fp32 copies of their rows (`fp32_from_fp16_params` in checkpoints). The
model's parameters follow the main shards: after each step and after a load of this optimizer's
state, which writes the loaded main shards back and gathers again. That matters with
`fp8_param_gather`, under which the model's copy of an FP8 layer's weight holds dequantised FP8
values on the rows other ranks own (`megatron/core/distributed/fp8_param_gather.py`): the main
shards, not the model's parameters, are the weights a checkpoint resumes from.

Expert parameters split by expert parallelism are sharded over the expert data-parallel group
(their buckets' group); their shards are the local tensors of global DTensors `[num_experts,
...]` over (ep, expt_dp), placed `(Shard(0), Shard(0))`: the experts split over ep, then this
rank's experts chunked along dim 0 over expt_dp (`expert_parallel.py`). Under tensor
parallelism each shard is a dim-0 chunk of the TP-local parameter, the local tensor of a global
DTensor over (tp, dp) placed (the parameter's tp placement, `Shard(0)`)
(`tensor_parallel_params.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.pipeline_parallel.global_names import global_names
from megatron.core.pipeline_parallel.stage import Model, model_chunks


def main_param_shards(model: Model) -> dict[torch.nn.Parameter, torch.Tensor] | None:
    """The fp32 main weights a distributed optimizer over `model` (or each of its chunks) steps:
    each trainable parameter's rows on this rank (`param_shard` of its engine), themselves where
    fp32, else an fp32 copy. None unless every chunk is the DDP engine with
    `use_distributed_optimizer`."""
    chunks = model_chunks(model)
    if not all(
        isinstance(chunk, DistributedDataParallel) and chunk.ddp_config.use_distributed_optimizer
        for chunk in chunks
    ):
        return None
    shards = {}
    for chunk in chunks:
        for param in chunk.parameters():
            if param.requires_grad:
                rows = chunk.param_shard(param)
                shards[param] = rows if param.dtype == torch.float32 else rows.float()
    return shards


class DistributedOptimizer(MegatronOptimizer):
    """Megatron's optimizer step (norm, skip, clip, step) over the DDP engine's parameter
    shards, then the all-gather of the parameters.

    Args:
        optimizer: a torch optimizer over the values of `main_shards`.
        config: see `MegatronOptimizer`.
        model: the DDP engine, built with `use_distributed_optimizer=True`, or the list of a
            rank's model chunks, each one.
        main_shards: `main_param_shards(model)`.
        grad_scaler: see `MegatronOptimizer`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        model: DistributedDataParallel | list[DistributedDataParallel],
        main_shards: dict[torch.nn.Parameter, torch.Tensor],
        grad_scaler: MegatronGradScaler | None = None,
    ):
        # The base sees only fp32 tensors, so it keeps no masters of its own.
        super().__init__(optimizer, config, model, grad_scaler)
        self._shards = dict(main_shards)
        self._dtensors = {
            p: self._engines[p].sharded_view(p, main) for p, main in self._shards.items()
        }
        # (model parameter, DTensor of its fp32 master shard) where the parameter is not fp32.
        self._masters = [(p, self._dtensors[p]) for p in self._shards if p.dtype != torch.float32]

    def _set_main_grads(self) -> list[torch.Tensor]:
        """Gives each main shard the engine's reduced gradient of its rows, in fp32 (a view
        where it is fp32 already). Returns the main shards, whose `.grad` the step drops."""
        for param, main in self._shards.items():
            main.grad = self._engines[param].grad_shard(param).to(main.dtype)
        return list(self._shards.values())

    def get_main_grads(self) -> list[torch.Tensor]:
        """The main shards' gradients as `Shard(0)` DTensors (views of them), so the norm
        counts every element once over the data-parallel group."""
        return [
            self._engines[param].sharded_view(param, main.grad)
            for param, main in self._shards.items()
            if main.grad is not None
        ]

    def get_main_params(self) -> list[torch.Tensor]:
        """The fp32 main shards as `Shard(0)` DTensors (every element counted once)."""
        return list(self._dtensors.values())

    def _model_weight_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The rows of the parameters that have fp32 master shards, and those shards (fp32
        parameters are stepped in place)."""
        return [(self._engines[p].param_shard(p), self._shards[p]) for p, _ in self._masters]

    def _model_weights_written(self) -> None:
        """All-gathers every parameter from the rows each rank wrote."""
        for chunk in self._chunks:
            chunk.start_param_sync(force_sync=True)

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`MegatronOptimizer.load_sharded_state_dict`, then the model's parameters made the
        loaded main shards (`_write_model_weights`)."""
        super().load_sharded_state_dict(state_dict)
        self._write_model_weights()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`MegatronOptimizer.load_state_dict`, then the model's parameters made the loaded
        main shards (`_write_model_weights`)."""
        super().load_state_dict(state_dict)
        self._write_model_weights()

    @torch.no_grad()
    def _write_model_weights(self) -> None:
        """Writes the main shards into this rank's rows of the model's parameters and
        all-gathers them, as a step does: the FP8 weights of `fp8_param_gather` are then cast
        from the loaded main shards, with the scales the run that saved them used."""
        copies = self._model_weight_copies()
        if copies:
            torch._foreach_copy_([rows for rows, _ in copies], [main for _, main in copies])
        self._model_weights_written()

    def reload_model_params(self) -> None:
        """Copies this rank's rows of the model's parameters into the fp32 master shards."""
        with torch.no_grad():
            for param, _ in self._masters:
                self._shards[param].copy_(self._engines[param].param_shard(param))

    def _global_view(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        """Its main shards and masters are DTensors placed as they are sharded already."""
        return tensor

    def _parameter_names(self) -> dict[int, tuple[str, torch.nn.Parameter]]:
        """id of each main shard and of its DTensor -> (the parameter's name, the DTensor),
        so the base shards the states like the DTensor (`Shard(0)` over the group)."""
        names = {}
        for chunk in self._chunks:
            params = dict(chunk.module.named_parameters())
            for name, whole in global_names(chunk.module, params).items():
                param = params[name]
                if param in self._shards:
                    dtensor = self._dtensors[param]
                    names[id(self._shards[param])] = (whole, dtensor)
                    names[id(dtensor)] = (whole, dtensor)
        return names
