"""`MegatronOptimizer` and `get_megatron_optimizer()`: a stock torch optimizer behind Megatron's
optimizer interface, for the DDP engine and for Megatron-FSDP.

A Megatron training step with it::

    model.zero_grad_buffer()
    optimizer.zero_grad()
    ...  # forward/backward of each microbatch (all but the last under model.no_sync())
    model.finish_grad_sync()
    update_successful, grad_norm, num_zeros = optimizer.step()
    scheduler.step(1)

`step()` computes the global gradient norm, skips the update when the norm is not finite (the
caller logs it), else clips the gradients to `clip_grad` and steps. Under Megatron-FSDP the torch
optimizer steps the local shards of the DTensor main weights (`local_main_weights`: plain
tensors on the same storage, so the step pays no DTensor dispatch), connected with
`fully_shard_optimizer`, which hands them their gradient shards for the step; the norm and the
clipping read the DTensor gradients, whose placements say how they are sharded (Megatron-FSDP
keeps fp32 main weights itself). Under the DDP engine (or a plain module) it keeps an fp32 master
copy of every parameter that is not fp32, as Megatron-LM's `Float16OptimizerWithFloat16Params`:
the torch optimizer steps the masters, with `param.main_grad` (which the DDP engine keeps apart
from `param.grad`) upcast to fp32 as their gradient, and the masters are then copied back into
the model's parameters. fp32 parameters are their own masters.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.fsdp import (
    fsdp_contexts,
    fsdp_roots,
    fully_shard_optimizer,
    local_main_weights,
)
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig


class MegatronOptimizer:
    """A torch optimizer with Megatron's step: global grad norm, skip on overflow, clip, step.

    Args:
        optimizer: a torch optimizer over `model`'s trainable parameters (under Megatron-FSDP
            its DTensor main weights or their local shards, already connected with
            `fully_shard_optimizer`).
        config: read for `clip_grad` and `log_num_zeros_in_grad`.
        model: what the parameters belong to: a `DistributedDataParallel` or
            `FullyShardedDataParallel` wrapper, a module with `fully_shard()` units, or a plain
            module (one process: its `.grad`s are taken as they are).

    Without Megatron-FSDP, the parameters of `optimizer` that are not fp32 are replaced in its
    parameter groups by fp32 master copies, which it steps from then on.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, model: torch.nn.Module
    ):
        self.optimizer = optimizer
        self.config = config
        self.model = model
        self._is_fsdp = bool(fsdp_roots(model))
        # Model parameter -> what the torch optimizer steps: an fp32 master copy, or itself.
        self._main_params: dict[torch.nn.Parameter, torch.Tensor] = {}
        if not self._is_fsdp:
            for group in optimizer.param_groups:
                for index, param in enumerate(group["params"]):
                    main = param
                    if param.is_floating_point() and param.dtype != torch.float32:
                        main = param.detach().clone().float()
                        group["params"][index] = main
                    self._main_params[param] = main

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's parameter groups (a scheduler sets `lr`, `weight_decay`)."""
        return self.optimizer.param_groups

    def _masters(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model parameter, its fp32 master copy) for each parameter that has one."""
        return [(param, main) for param, main in self._main_params.items() if main is not param]

    def get_main_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer steps with, one per parameter that has one.

        Megatron-FSDP: the DTensor gradients of the model's main weights, read from the model
        (whose placements tell how they are sharded) rather than from whatever tensors the
        torch optimizer holds. Otherwise the `.grad` of each main parameter (master copy or
        fp32 parameter), which `step()` sets from the model's gradients before it reads them.
        """
        if self._is_fsdp:
            return [p.grad for p in self.model.parameters() if p.grad is not None]
        return [main.grad for main in self._main_params.values() if main.grad is not None]

    def _set_main_grads(self) -> list[torch.Tensor]:
        """Gives each main parameter its model parameter's gradient in fp32: the DDP engine's
        `main_grad` where it set one (Megatron's rule; a view where it is fp32 already), else
        `.grad`. Returns the main parameters given one, whose `.grad` the step must drop."""
        assigned = []
        for param, main in self._main_params.items():
            grad = getattr(param, "main_grad", None)
            if grad is None and main is not param:
                grad = param.grad
            if grad is not None:
                main.grad = grad.to(main.dtype)
                assigned.append(main)
        return assigned

    def finish_grad_sync(self) -> None:
        """Completes the model's gradient reduction. Idempotent, so a no-op when the training
        loop already called `model.finish_grad_sync()`; Megatron-FSDP would otherwise run its
        deferred reductions only inside `optimizer.step()`, after the norm was taken."""
        if isinstance(self.model, _BaseDataParallel):
            self.model.finish_grad_sync()
        elif self._is_fsdp:
            for context in fsdp_contexts(self.model):
                context.finalize_grads()

    @torch.no_grad()
    def step(self) -> tuple[bool, float, int | None]:
        """Clips the gradients to `config.clip_grad` and updates the parameters, unless the
        gradient norm is inf or nan (the same decision on every rank). A skipped step leaves
        the gradients as they are: the loop's `zero_grad_buffer()` / `zero_grad()` drop them.

        Returns:
            (update_successful, grad_norm, num_zeros_in_grad): whether the parameters were
            updated, the global gradient norm before clipping, and the number of zero gradient
            elements (None unless `config.log_num_zeros_in_grad`).
        """
        self.finish_grad_sync()
        assigned = [] if self._is_fsdp else self._set_main_grads()
        try:
            grads = self.get_main_grads()
            grad_norm = get_grad_norm_fp32(grads)
            num_zeros = count_zeros_fp32(grads) if self.config.log_num_zeros_in_grad else None
            if not math.isfinite(grad_norm):
                return False, grad_norm, num_zeros
            if self.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(grads, self.config.clip_grad, grad_norm)
            self.optimizer.step()
            masters = self._masters()
            if masters:
                torch._foreach_copy_([p for p, _ in masters], [m for _, m in masters])
        finally:
            # The DDP engine keeps `.grad` None between backwards: a `.grad` left aliasing
            # `main_grad` would make the next backward add its gradient twice.
            for main in assigned:
                main.grad = None
        return True, grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' `.grad`; the DDP engine's `main_grad` buffers are zeroed by
        `model.zero_grad_buffer()`, which the training loop calls too (as Megatron's does)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        # The torch optimizer steps other tensors (fp32 masters, Megatron-FSDP's local shards)
        # and does not see the model's `.grad`s: clear those too, as `zero_grad()` promises.
        if self._is_fsdp or self._masters():
            for param in self.model.parameters():
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's state dict (under Megatron-FSDP the state of this rank's
        shards, as plain tensors when it steps local shards), plus, where the optimizer keeps
        fp32 masters of non-fp32 parameters, `"fp32_from_fp16_params"`: the masters (Megatron's
        key), in the order of the optimizer's parameters. They are the weights training goes on
        from: the model's bf16 parameters are only their rounded copies."""
        state_dict = self.optimizer.state_dict()
        masters = self._masters()
        if masters:
            state_dict["fp32_from_fp16_params"] = [main for _, main in masters]
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict saved by `state_dict()`: the torch optimizer's state and the fp32
        masters (not the model's parameters, which the model's own state dict restores).

        Raises:
            ValueError: the state dict's masters do not match this optimizer's.
        """
        state_dict = dict(state_dict)
        saved = state_dict.pop("fp32_from_fp16_params", [])
        masters = [main for _, main in self._masters()]
        if len(saved) != len(masters):
            raise ValueError(
                f"The state dict holds {len(saved)} fp32 master weights, this optimizer "
                f"{len(masters)}: it was saved for parameters of other dtypes (e.g. --bf16 "
                "against fp32); load it into an optimizer over the same model."
            )
        self.optimizer.load_state_dict(state_dict)
        with torch.no_grad():
            for main, value in zip(masters, saved):
                main.copy_(value)


def get_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters split into a decayed and a non-decayed group (Megatron's default
    rule: biases and 1-D parameters, i.e. norm weights, get no weight decay).

    Each group has `wd_mult` (1.0 or 0.0), by which `OptimizerParamScheduler` multiplies its
    weight decay. Empty groups are left out.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            no_wd = name.endswith(".bias") or param.ndim == 1
            (no_decay if no_wd else decay).append(param)
    groups = [
        {"params": decay, "wd_mult": 1.0, "weight_decay": weight_decay},
        {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def get_megatron_optimizer(config: OptimizerConfig, model: torch.nn.Module) -> MegatronOptimizer:
    """Builds the optimizer `config` names over `model`'s trainable parameters.

    Call it after wrapping the model: under Megatron-FSDP the optimizer steps the local shards
    of the DTensor main weights (`local_main_weights`), grouped by the DTensors' names, and is
    connected with `fully_shard_optimizer`. Adam uses torch's fused kernel where every
    parameter allows it; SGD uses torch's default (foreach on GPU).

    Args:
        config: the optimizer and its hyperparameters.
        model: see `MegatronOptimizer`.

    Raises:
        ValueError: `config.lr` is not set, or `model` has no trainable parameter.
    """
    if config.lr is None:
        raise ValueError(
            "OptimizerConfig.lr is None: set the (initial/maximum) learning rate, e.g. "
            "OptimizerConfig(lr=3e-4)."
        )
    param_groups = get_param_groups(model, config.weight_decay)
    is_fsdp = bool(fsdp_roots(model))
    if is_fsdp:
        local = local_main_weights(model)
        for group in param_groups:
            group["params"] = [local[param] for param in group["params"]]
    params = [p for group in param_groups for p in group["params"]]
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no parameter with requires_grad=True to optimize."
        )
    if config.optimizer == "adam":
        adam = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        optimizer = adam(
            param_groups,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            fused=all(_fusable(p) for p in params),
        )
    else:
        optimizer = torch.optim.SGD(param_groups, lr=config.lr, momentum=config.sgd_momentum)
    if is_fsdp:
        fully_shard_optimizer(optimizer, model)
    return MegatronOptimizer(optimizer, config, model)


def _fusable(param: torch.Tensor) -> bool:
    # torch's fused Adam kernels exist for floating-point tensors on CPU and CUDA (DTensors too).
    return param.is_floating_point() and param.device.type in ("cpu", "cuda")
