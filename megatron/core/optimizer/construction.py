"""`get_megatron_optimizer()`: the optimizer an `OptimizerConfig` names, over a model wrapped by
either engine, and `get_param_groups()`, Megatron's weight-decay and decoupled-rate groups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron.core.distributed.engine import engine_of, local_main_weights_of
from megatron.core.distributed.fsdp import fully_shard_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, main_param_shards
from megatron.core.optimizer.grad_scaler import get_grad_scaler
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.pipeline_parallel.stage import model_chunks, modules_of

EMBEDDING_OR_OUTPUT_WEIGHTS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Name endings of the parameters Megatron-LM marks `is_embedding_or_output_parameter`: the
word embeddings and the (untied) output layer, which `--decoupled-lr` gives their own rate."""


def get_param_groups(
    model: torch.nn.Module,
    weight_decay: float,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
    apply_wd_to_qk_layernorm: bool = False,
) -> list[dict[str, Any]]:
    """The trainable parameters split into a decayed and a non-decayed group (Megatron's default
    rule: biases and 1-D parameters, i.e. norm weights, get no weight decay; with
    `apply_wd_to_qk_layernorm` the query and key norms' weights do), and with `decoupled_lr` the
    word embeddings and output layer into groups of their own.

    Each group has `wd_mult` (1.0 or 0.0), by which `OptimizerParamScheduler` multiplies its
    weight decay; a decoupled group has `max_lr` = `decoupled_lr` (and `min_lr` =
    `decoupled_min_lr` when given), which the scheduler uses instead of its own. Empty groups
    are left out.
    """
    decay, no_decay, decoupled_decay, decoupled_no_decay = [], [], [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            no_wd = (name.endswith(".bias") or param.ndim == 1) and not (
                apply_wd_to_qk_layernorm and (".q_layernorm." in name or ".k_layernorm." in name)
            )
            if decoupled_lr is not None and name.endswith(EMBEDDING_OR_OUTPUT_WEIGHTS):
                (decoupled_no_decay if no_wd else decoupled_decay).append(param)
            else:
                (no_decay if no_wd else decay).append(param)
    decoupled = {"max_lr": decoupled_lr}
    if decoupled_min_lr is not None:
        decoupled["min_lr"] = decoupled_min_lr
    groups = [
        {"params": decay, "wd_mult": 1.0, "weight_decay": weight_decay},
        {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0},
        {"params": decoupled_decay, "wd_mult": 1.0, "weight_decay": weight_decay, **decoupled},
        {"params": decoupled_no_decay, "wd_mult": 0.0, "weight_decay": 0.0, **decoupled},
    ]
    return [group for group in groups if group["params"]]


def get_megatron_optimizer(
    config: OptimizerConfig,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    capturable: bool = False,
) -> MegatronOptimizer:
    """Builds the optimizer `config` names over `model`'s trainable parameters.

    Call it after wrapping the model: under Megatron-FSDP the optimizer steps the local shards
    of the DTensor main weights (`local_main_weights`), grouped by the DTensors' names, and is
    connected with `fully_shard_optimizer`; under the DDP engine with
    `use_distributed_optimizer` it is a `DistributedOptimizer` over this rank's rows. Adam uses
    torch's fused kernel where every parameter allows it; SGD uses torch's default (foreach on
    GPU).

    Args:
        config: the optimizer and its hyperparameters.
        model: see `MegatronOptimizer`; or Megatron-core's list of a rank's model chunks (its
            virtual pipeline stages), each wrapped by the same engine: one optimizer steps them
            all.
        capturable: the step may be captured in a CUDA graph (`MegatronOptimizer.
            step_on_device`): torch's fused kernels, which skip a step on the device and read
            the learning rate from a device tensor, for SGD too; Adam with `capturable=True`.

    Raises:
        ValueError: `config.lr` is not set, `model` has no trainable parameter, a chunk comes
            twice, or `capturable` with a parameter torch's fused kernels do not take.
    """
    if config.lr is None:
        raise ValueError(
            "OptimizerConfig.lr is None: set the (initial/maximum) learning rate, e.g. "
            "OptimizerConfig(lr=3e-4)."
        )
    chunks = model_chunks(model)
    if len({id(chunk) for chunk in chunks}) != len(chunks):
        raise ValueError(
            f"get_megatron_optimizer got {len(chunks)} model chunks, some of them more than "
            "once; pass each of a rank's chunks (its virtual pipeline stages) once."
        )
    if len(chunks) == 1:
        model = chunks[0]
    modules = modules_of(chunks)
    param_groups = get_param_groups(
        modules,
        config.weight_decay,
        config.decoupled_lr,
        config.decoupled_min_lr,
        config.apply_wd_to_qk_layernorm,
    )
    engines = [engine_of(chunk) for chunk in chunks]
    # Megatron-FSDP: the torch optimizer steps the local shards of its main weights.
    is_fsdp = any(engine.keeps_main_weights for engine in engines)
    main_shards = main_param_shards(model)
    if is_fsdp or main_shards is not None:
        mains = local_main_weights_of(engines) if is_fsdp else main_shards
        for group in param_groups:
            group["params"] = [mains[param] for param in group["params"]]
    params = [p for group in param_groups for p in group["params"]]
    if not params:
        raise ValueError(
            f"{type(modules).__name__} has no parameter with requires_grad=True to optimize."
        )
    fused = all(_fusable(p) for p in params)
    if capturable and not fused:
        raise ValueError(
            "A step captured in a CUDA graph needs torch's fused optimizer kernels, which take "
            "floating-point parameters on CPU or CUDA only; this model has others."
        )
    if config.optimizer == "adam":
        adam = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        optimizer = adam(
            param_groups,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            fused=fused,
            capturable=capturable,
        )
    else:
        # SGD's default (foreach) kernels can skip no step on the device: fused only then
        # (None: torch's default kernels).
        optimizer = torch.optim.SGD(
            param_groups,
            lr=config.lr,
            momentum=config.sgd_momentum,
            fused=True if capturable else None,
        )
    if is_fsdp:
        fully_shard_optimizer(optimizer, modules)
    if main_shards is not None:
        return DistributedOptimizer(optimizer, config, model, main_shards, get_grad_scaler(config))
    return MegatronOptimizer(optimizer, config, model, get_grad_scaler(config))


def _fusable(param: torch.Tensor) -> bool:
    # torch's fused Adam kernels exist for floating-point tensors on CPU and CUDA (DTensors too).
    return param.is_floating_point() and param.device.type in ("cpu", "cuda")
