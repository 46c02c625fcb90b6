"""`MegatronOptimizer`: a stock torch optimizer behind Megatron's optimizer interface, for the DDP
engine and for Megatron-FSDP (`get_megatron_optimizer()` in `construction.py` builds one).

A Megatron training step with it::

    model.zero_grad_buffer()
    optimizer.zero_grad()
    ...  # forward/backward of each microbatch (all but the last under model.no_sync())
    model.finish_grad_sync()
    update_successful, grad_norm, num_zeros = optimizer.step()
    scheduler.step(1)

`step()` computes the global gradient norm, skips the update when the norm is not finite (the caller
logs it), else steps with the gradients clipped to `clip_grad` (the fused Adam kernel multiplies
them by the clipping coefficient as it reads them, leaving them unclipped; elsewhere they are
clipped in place first: `fused_adam.GradScale`). `step_on_device()` does the same with
no host synchronisation, for a CUDA graph to capture (`device_step.py`). Under Megatron-FSDP the
torch optimizer steps the local shards of the DTensor main weights (`local_main_weights`: plain
tensors on the same storage, so the step pays no DTensor dispatch), connected with
`fully_shard_optimizer`, which hands them their gradient shards for the step; the norm and the
clipping read the DTensor gradients, whose placements say how they are sharded (Megatron-FSDP keeps
fp32 main weights itself). Under the DDP engine (or a plain module) it keeps an fp32 master copy of
every parameter that is not fp32, as Megatron-LM's `Float16OptimizerWithFloat16Params`: the torch
optimizer steps the masters, with `param.main_grad` (which the DDP engine keeps apart from
`param.grad`) upcast to fp32 as their gradient, and the masters are then copied back into the
model's parameters. fp32 parameters are their own masters. Under the DDP engine with expert
parallelism, the gradients, weights and states of expert parameters are read as global DTensors
split over the ep group (`expert_parallel.py`), so the norm counts every expert once and checkpoints
hold every expert.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from megatron.core.distributed.engine import (
    DataParallelEngine,
    engine_of,
    local_main_weights_of,
)
from megatron.core.fusions.fused_adam import StepAmaxes, step_and_copy
from megatron.core.optimizer.clip_grads import (
    clip_scale,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron.core.optimizer.device_step import (
    DeviceLearningRates,
    DeviceStepResult,
    check_skips_on_device,
    device_skip_problem,
    device_step,
    makes_state,
)
from megatron.core.optimizer.grad_scaler import (
    MegatronGradScaler,
    unscale_and_check_for_inf,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.saved_param_groups import loadable_param_groups, stage_param_groups
from megatron.core.pipeline_parallel.global_names import global_names
from megatron.core.pipeline_parallel.stage import Model, model_chunks, modules_of, pipeline_group
from megatron.core.pipeline_parallel.tied_embeddings import embedding_copies

SavedTensor = tuple[torch.Size, torch.dtype]
"""A tensor's global shape and dtype as a checkpoint recorded them."""


class MegatronOptimizer:
    """A torch optimizer with Megatron's step: global grad norm, skip on overflow, clip, step.

    Args:
        optimizer: a torch optimizer over `model`'s trainable parameters (under Megatron-FSDP
            its DTensor main weights or their local shards, already connected with
            `fully_shard_optimizer`).
        config: read for `clip_grad` and `log_num_zeros_in_grad`.
        model: what the parameters belong to: a `DistributedDataParallel` or
            `FullyShardedDataParallel` wrapper, a module with `fully_shard()` units, or a plain
            module (one process: its `.grad`s are taken as they are); or the list of a rank's
            model chunks (its virtual pipeline stages), each one of those.
        grad_scaler: the loss scaling of fp16 training (see `grad_scaler.py`), or None.

    Under pipeline parallelism (the model's `config.pipeline_model_parallel_size` > 1) the
    gradient norm, the zero count and the parameters' norm are taken over every stage (the
    pipeline group of `parallel_state`), the last stage's copies of the first stage's
    embeddings left out (tied, or for multi-token prediction: the first stage's count for
    both); clipping scales both copies alike.

    Without Megatron-FSDP, the parameters of `optimizer` that are not fp32 are replaced in its
    parameter groups by fp32 master copies, which it steps from then on.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        model: Model,
        grad_scaler: MegatronGradScaler | None = None,
    ):
        self.optimizer = optimizer
        self.config = config
        self.model = model
        self.grad_scaler = grad_scaler
        self._chunks = model_chunks(model)
        # The model's parameters, fixed from here as the torch optimizer's are (walking the
        # modules again at every step costs the host milliseconds on a large model).
        self._parameters = tuple(modules_of(self._chunks).parameters())
        # Each chunk's engine (`engine.py`): everything the optimizer asks of the model.
        self._chunk_engines = [engine_of(chunk) for chunk in self._chunks]
        # Megatron-FSDP keeps the main weights itself: they are the model's parameters.
        self._engine_keeps_main_weights = any(
            engine.keeps_main_weights for engine in self._chunk_engines
        )
        # Model parameter -> what the torch optimizer steps: an fp32 master copy, or itself.
        self._main_params: dict[torch.nn.Parameter, torch.Tensor] = {}
        if not self._engine_keeps_main_weights:
            for group in optimizer.param_groups:
                for index, param in enumerate(group["params"]):
                    main = param
                    if param.is_floating_point() and param.dtype != torch.float32:
                        main = param.detach().clone().float()
                        group["params"][index] = main
                    self._main_params[param] = main
        # (model parameter, its fp32 master) for each parameter that has one; fixed from here.
        self._masters = [(p, main) for p, main in self._main_params.items() if main is not p]
        # Each parameter's engine (its chunk's), which places it as a global tensor.
        self._engines: dict[torch.nn.Parameter, DataParallelEngine] = {
            param: engine for engine in self._chunk_engines for param in engine.module.parameters()
        }
        config_of_model = getattr(self._chunks[0], "config", None)
        stages = 1 if config_of_model is None else config_of_model.pipeline_model_parallel_size
        self._pp_group = pipeline_group(None) if stages > 1 else None
        # The last stage's copies of the first stage's embeddings: counted by the first stage.
        self._second_copies: set[torch.nn.Parameter] = set()
        for chunk in self._chunks if stages > 1 else []:
            if not getattr(getattr(chunk, "module", chunk), "pre_process", True):
                self._second_copies.update(embedding_copies(chunk))
        # The rates `step_on_device` reads, made by the first `write_learning_rates_to_device`.
        self._device_learning_rates: DeviceLearningRates | None = None

    def _global_view(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (shaped like `param`: its gradient, master or itself) as the global DTensor
        where `param` is split by the DDP engine's expert or tensor parallelism; else as is
        (`DataParallelEngine.global_view`)."""
        engine = self._engines.get(param)
        if engine is None:
            return tensor
        return engine.global_view(param, tensor)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's parameter groups (a scheduler sets `lr`, `weight_decay`)."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward (1.0 without loss scaling)."""
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the loss scale, to call backward on (Megatron-LM's name)."""
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale

    def get_main_grads(self, counted_once: bool = False) -> list[torch.Tensor]:
        """The gradients the optimizer steps with, one per parameter that has one (with
        `counted_once`, but the last pipeline stage's copies of the first stage's embeddings).

        Megatron-FSDP: the DTensor gradients of the model's main weights, read from the model
        (whose placements tell how they are sharded) rather than from whatever tensors the
        torch optimizer holds. Otherwise the `.grad` of each main parameter (master copy or
        fp32 parameter), which `step()` sets from the model's gradients before it reads them.
        """
        skip = self._second_copies if counted_once else set()
        if self._engine_keeps_main_weights:
            # A tensor's hash is a Python call: none where nothing is skipped (the common case).
            params = [p for p in self._parameters if p not in skip] if skip else self._parameters
            return [p.grad for p in params if p.grad is not None]
        return [
            self._global_view(param, main.grad)
            for param, main in self._main_params.items()
            if main.grad is not None and param not in skip
        ]

    def get_main_params(self) -> list[torch.Tensor]:
        """The weights the optimizer steps, each once, placed as `get_main_grads()`' gradients:
        Megatron-FSDP's DTensor main weights; otherwise the fp32 masters and fp32 parameters."""
        skip = self._second_copies
        if self._engine_keeps_main_weights:
            return [p for p in self._parameters if p.requires_grad and p not in skip]
        return [
            self._global_view(param, main)
            for param, main in self._main_params.items()
            if param not in skip
        ]

    def get_params_norm(self) -> float:
        """The global L2 norm of the main weights in fp32, the same on every rank (what
        `--log-params-norm` logs; Megatron-LM's `calc_params_l2_norm`)."""
        # Placed like the gradients, so they sum the same way.
        return get_grad_norm_fp32(self.get_main_params(), self._pp_group)

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
        """Completes the model's gradient reduction (each chunk's engine's
        `finish_grad_sync()`). Idempotent, so a no-op when the training loop already called
        `model.finish_grad_sync()`; Megatron-FSDP would otherwise run its deferred reductions
        only inside `optimizer.step()`, after the norm was taken."""
        for engine in self._chunk_engines:
            engine.finish_grad_sync()

    @contextlib.contextmanager
    def _main_grads_for_step(self) -> Iterator[list[torch.Tensor]]:
        """The main gradients (`get_main_grads()`), once the reduction finished; on exit the
        step has consumed them: the `.grad` the DDP engine handed out (views of `main_grad`)
        and the masters' are dropped, as `zero_grad()` would."""
        self.finish_grad_sync()
        # Empty where the engine keeps the main weights (no `_main_params`): nothing to set.
        assigned = self._set_main_grads()
        try:
            yield self.get_main_grads()
        finally:
            for main in assigned:
                main.grad = None
            for param in self._main_params:
                param.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, float, int | None]:
        """Updates the parameters with the gradients clipped to `config.clip_grad` (module
        docstring: in the fused kernel the gradients themselves stay unclipped), unless the
        gradient norm is inf or nan (the same decision on every rank). A skipped step leaves
        the gradients as they are: the loop's `zero_grad_buffer()` / `zero_grad()` drop them.

        With a grad scaler the main gradients are first divided by the loss scale; if any is
        inf or nan on any rank, the step is skipped on every rank and the scaler lowers the
        scale (Megatron-LM's `MixedPrecisionOptimizer`), before any norm is taken.

        Returns:
            (update_successful, grad_norm, num_zeros_in_grad): whether the parameters were
            updated, the global gradient norm before clipping (None when the loss scaler
            skipped the step, as Megatron-LM's), and the number of zero gradient elements
            (None unless `config.log_num_zeros_in_grad`, or when the loss scaler skipped).
        """
        with self._main_grads_for_step() as grads:
            if self.grad_scaler is not None:
                found_inf = unscale_and_check_for_inf(
                    grads, self.grad_scaler.inv_scale, self._flag_device()
                )
                self.grad_scaler.update(found_inf)
                if found_inf:
                    return False, None, None
            counted = self._counted_grads(grads)
            grad_norm = get_grad_norm_fp32(counted, self._pp_group)
            num_zeros = None
            if self.config.log_num_zeros_in_grad:
                num_zeros = count_zeros_fp32(counted, self._pp_group)
            if not math.isfinite(grad_norm):
                return False, grad_norm, num_zeros
            clip = None
            if self.config.clip_grad > 0.0:
                clip = clip_scale(grads, self.config.clip_grad, grad_norm)
            step_and_copy(self.optimizer, self._model_weight_copies(), self._step_amaxes(), clip)
            self._model_weights_written()
        return True, grad_norm, num_zeros

    def _counted_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The main gradients the norm and the zero count sum: `grads` but the last pipeline
        stage's copies of the first stage's embeddings (counted by the first stage)."""
        return self.get_main_grads(counted_once=True) if self._second_copies else grads

    def write_learning_rates_to_device(self) -> None:
        """Copies each parameter group's `"lr"` (set on the host by the scheduler) into the
        device tensor `step_on_device()` reads. Call it before every `step_on_device()` (a
        replayed graph of one included), outside any CUDA graph capture."""
        if self._device_learning_rates is None:
            self._device_learning_rates = DeviceLearningRates(self.optimizer, self._flag_device())
        self._device_learning_rates.write()

    @torch.no_grad()
    def step_on_device(self) -> DeviceStepResult:
        """`step()` with no host synchronisation, for a CUDA graph to capture: the norm stays
        on the device, a non-finite norm makes the torch optimizer's fused kernels skip the
        step (weights and optimizer state unchanged, as `step()` leaves them), the clipping
        coefficient is computed on the device, and the learning rates are read from the
        tensors `write_learning_rates_to_device()` filled (`device_step.py`). The values equal
        `step()`'s, but for a learning rate fp32 cannot represent (read in fp32).

        The torch optimizer must skip on the device: Adam/AdamW with `fused=True,
        capturable=True`, or SGD with `fused=True` (`get_megatron_optimizer(...,
        capturable=True)`). Run one step eagerly before capturing one: the first creates the
        optimizer's state.

        Raises:
            ValueError: a grad scaler (its skip decision and scale live on the host), or a torch
                optimizer that cannot skip on the device.
            RuntimeError: `write_learning_rates_to_device()` was never called.
        """
        self._check_steps_on_device("step_on_device()", capture=True)
        if self._device_learning_rates is None:
            raise RuntimeError(
                "step_on_device() reads the learning rates from the device: call "
                "write_learning_rates_to_device() before it (and before every replay)."
            )
        return self._step_on_device(self._device_learning_rates, copy_to_host=False)

    @property
    def steps_without_host_sync(self) -> bool:
        """Whether `step_without_host_sync()` takes this optimizer's next step as `step()`
        would: no loss scaler, a torch optimizer whose kernels skip a step on the device (Adam
        and AdamW with torch's fused kernels, the default where every parameter allows them;
        SGD built with `fused=True`), and its state made by an earlier step where it keeps any.
        A first step skipped on the device makes the state (zero moments) that `step()` leaves
        unmade, and on CUDA the next step's kernel depends on whether it exists."""
        return (
            self.grad_scaler is None
            and (bool(self.optimizer.state) or not makes_state(self.optimizer))
            and device_skip_problem(self.optimizer, False) is None
        )

    @torch.no_grad()
    def step_without_host_sync(self) -> DeviceStepResult:
        """`step()` with its outcome left on the device, for an eager loop that reads it later
        (the training loop reads it at the next iteration, as it reads the losses): the host
        queues the step without waiting for the gradients' norm, and the result's copy to the
        host before the update (`DeviceStepResult.read` waits for that copy alone). The norm,
        the skip of a step whose norm is not finite and the clipping are `step_on_device()`'s;
        the learning rates are the numbers the groups hold now, so weights and optimizer state
        equal `step()`'s bitwise where `steps_without_host_sync` says so. A schedule that
        depends on whether the step was skipped must read the result before it sets the rates
        of the next step.

        Raises:
            ValueError: a loss scaler, or a torch optimizer that cannot skip on the device.
        """
        self._check_steps_on_device("step_without_host_sync()", capture=False)
        return self._step_on_device(None, copy_to_host=True)

    def _check_steps_on_device(self, name: str, capture: bool) -> None:
        """Raises a ValueError naming `name` unless the step can skip on the device."""
        if self.grad_scaler is not None:
            raise ValueError(
                f"{name} cannot scale the loss: the loss scaler decides on the host. "
                "Train with bf16 or fp32 (no --fp16, no --loss-scale)."
            )
        check_skips_on_device(self.optimizer, capture)

    def _step_on_device(
        self, learning_rates: DeviceLearningRates | None, copy_to_host: bool
    ) -> DeviceStepResult:
        with self._main_grads_for_step() as grads:
            result = device_step(
                self.optimizer,
                grads,
                self.config,
                self._flag_device(),
                learning_rates,
                self._model_weight_copies(),
                self._step_amaxes(),
                self._counted_grads(grads),
                self._pp_group,
                copy_to_host,
            )
            self._model_weights_written()
        return result

    def _model_weight_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model weight, fp32 master) pairs the step writes the stepped masters back into
        (Megatron-LM's `_copy_main_params_to_model_params`; `step_and_copy` fuses the copy into
        the step where it can)."""
        return self._masters

    def _step_amaxes(self) -> list[StepAmaxes | None]:
        """What the engines ask the step to record of the weights it writes (`step_and_copy`):
        Megatron-FSDP's FP8 weights are cast from the main weights' amaxes."""
        return [engine.prepare_step_amaxes() for engine in self._chunk_engines]

    def _model_weights_written(self) -> None:
        """Runs once the step wrote the model's weights (`DistributedOptimizer` all-gathers)."""

    def _flag_device(self) -> torch.device:
        """Where the overflow flag is reduced: the model's device (NCCL reduces CUDA tensors)."""
        return self._parameters[0].device

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' `.grad`; the DDP engine's `main_grad` buffers are zeroed by
        `model.zero_grad_buffer()`, which the training loop calls too (as Megatron's does)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        # The torch optimizer steps other tensors (fp32 masters, Megatron-FSDP's local shards)
        # and does not see the model's `.grad`s: clear those too, as `zero_grad()` promises.
        if self._engine_keeps_main_weights or self._masters:
            for param in self._parameters:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's state dict (under Megatron-FSDP the state of this rank's
        shards, as plain tensors when it steps local shards), plus, where the optimizer keeps
        fp32 masters of non-fp32 parameters, `"fp32_from_fp16_params"`: the masters (Megatron's
        key), in the order of the optimizer's parameters. They are the weights training goes on
        from: the model's bf16 parameters are only their rounded copies. With a grad scaler,
        `"grad_scaler"`: its state (Megatron-LM's key)."""
        state_dict = self.optimizer.state_dict()
        masters = self._masters
        if masters:
            state_dict["fp32_from_fp16_params"] = [main for _, main in masters]
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def reload_model_params(self) -> None:
        """Copies the model's parameters into the fp32 masters (Megatron-LM's name), after
        weights were loaded into the model without this optimizer's state. Megatron-FSDP's
        main weights are the model's parameters: nothing to copy."""
        with torch.no_grad():
            for param, main in self._masters:
                main.copy_(param)

    def _parameter_names(self) -> dict[int, tuple[str, torch.nn.Parameter]]:
        """id of each tensor the torch optimizer may hold (model parameter, fp32 master or
        local shard) -> (the parameter's name in the whole model's state dict, the model
        parameter). Under pipeline parallelism the whole model's names are not the stage's
        (`global_names`: its layers' global numbers)."""
        local = local_main_weights_of(self._chunk_engines)
        names = {}
        for engine in self._chunk_engines:
            module = engine.module
            params = dict(module.named_parameters())
            for name, whole in global_names(module, params).items():
                param = params[name]
                placed = self._global_view(param, param)
                for held in (param, local.get(param), self._main_params.get(param)):
                    if held is not None:
                        names[id(held)] = (whole, placed)
        return names

    def _held(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def sharded_state_dict(self) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, each tensor sharded as its parameter is,
        for `torch.distributed.checkpoint` (which can then load it at another data-parallel
        size or sharding strategy).

        Returns:
            `"state"`: parameter name -> the torch optimizer's state of it (under Megatron-FSDP
            the per-element states are DTensors placed like the main weight, scalars such as
            Adam's `step` plain tensors); `"fp32_from_fp16_params"`: name -> fp32 master, where
            the optimizer keeps masters; `"param_groups"`: the hyperparameters of each group,
            with the names of its parameters (no tensors: saved apart from them); with a
            dynamic loss scaler, `"grad_scaler"`: its state (the same on every rank).
        """
        names = self._parameter_names()
        held = self._held()
        state: dict[str, dict[str, torch.Tensor]] = {}
        for index, values in self.optimizer.state_dict()["state"].items():
            name, param = names[id(held[index])]
            state[name] = {}
            for key, value in values.items():
                if value is None:  # e.g. SGD's momentum_buffer without momentum
                    continue
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"The optimizer's state {key!r} of {name} is a {type(value).__name__}, "
                        "not a tensor; sharded checkpoints hold tensor states only."
                    )
                state[name][key] = _shard_like(value, held[index], param)
        param_groups = [
            {
                **{key: value for key, value in group.items() if key != "params"},
                "params": [names[id(p)][0] for p in group["params"]],
            }
            for group in self.optimizer.param_groups
        ]
        masters = {names[id(main)][0]: self._global_view(p, main) for p, main in self._masters}
        sharded = {"state": state, "fp32_from_fp16_params": masters, "param_groups": param_groups}
        if self.grad_scaler is not None and self.grad_scaler.state_dict():
            sharded["grad_scaler"] = self.grad_scaler.state_dict()
        return sharded

    def sharded_state_dict_for_loading(
        self, saved: Mapping[tuple[str, ...], SavedTensor]
    ) -> dict[str, Any]:
        """Tensors for `torch.distributed.checkpoint.load` to fill with a checkpoint's optimizer
        tensors: new ones for the states (this optimizer may not have any yet), sharded as the
        parameters are now; the fp32 masters themselves, which load in place.

        Args:
            saved: each saved tensor's path below the optimizer's entry (e.g. `("state",
                name, "exp_avg")`) -> its global shape and dtype.

        Raises:
            ValueError: the checkpoint holds state of tensors this optimizer does not step, or
                fp32 masters where this optimizer keeps none (or none where it does): another
                model, engine or precision.
        """
        names = self._parameter_names()
        params = dict(names.values())
        held = {names[id(tensor)][0]: tensor for tensor in self._held()}
        masters = {names[id(main)][0]: self._global_view(p, main) for p, main in self._masters}
        state: dict[str, dict[str, torch.Tensor]] = {}
        loaded_masters = {}
        scaler: dict[str, torch.Tensor] = {}
        unknown, foreign_masters = [], []
        for path, (size, dtype) in saved.items():
            kind, name = path[0], path[1]
            if kind == "grad_scaler":
                # Loaded where this optimizer scales dynamically; else left (Megatron-LM's
                # rule: a constant --loss-scale or bf16 run ignores a saved scaler).
                if self.grad_scaler is not None and self.grad_scaler.state_dict():
                    scaler[name] = torch.empty(size, dtype=dtype)
            elif kind == "state" and name in held:
                state.setdefault(name, {})[path[2]] = _empty_sharded(
                    size, dtype, held[name], params[name]
                )
            elif kind == "fp32_from_fp16_params" and name in masters:
                loaded_masters[name] = masters[name]
            elif kind == "fp32_from_fp16_params" and name in params:
                foreign_masters.append(name)
            else:
                unknown.append(".".join(map(str, path)))
        missing = sorted(masters.keys() - loaded_masters.keys())
        if unknown:
            raise ValueError(
                f"The checkpoint holds optimizer state of {len(unknown)} tensor(s) this "
                f"optimizer does not step (e.g. {unknown[:3]}). Load it into the model it was "
                "saved from, or pass --no-load-optim."
            )
        # Masters exist for non-fp32 parameters under the DDP engine only (Megatron-FSDP's
        # main weights are the model's): their presence tells engine and precision apart.
        if missing or foreign_masters:
            if missing:
                here = (
                    f"this optimizer keeps fp32 masters of {len(masters)} parameter(s), the "
                    f"checkpoint lacks {len(missing)} of them (e.g. {missing[:3]})"
                )
            elif masters:
                here = (
                    f"this optimizer keeps none of {len(foreign_masters)} of them (e.g. "
                    f"{sorted(foreign_masters)[:3]})"
                )
            else:
                here = "this optimizer keeps no fp32 masters (fp32 parameters, or Megatron-FSDP)"
            raise ValueError(
                f"The checkpoint's fp32 master weights do not fit this optimizer: it holds "
                f"{len(loaded_masters) + len(foreign_masters)} (saved by the DDP engine with "
                f"non-fp32 parameters, e.g. --bf16), {here}. Load it with the engine and "
                "precision it was saved with, or pass --no-load-optim to load the model's "
                "weights only."
            )
        loading = {"state": state, "fp32_from_fp16_params": loaded_masters}
        if scaler:
            loading["grad_scaler"] = scaler
        return loading

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads what `sharded_state_dict()` saved, resharded (the tensors of
        `sharded_state_dict_for_loading()`, filled, plus the saved `"param_groups"`).

        Raises:
            ValueError: the saved parameter groups differ from this optimizer's (see
                `check_param_groups()`).
        """
        names = self._parameter_names()
        held = self._held()
        index = {names[id(tensor)][0]: i for i, tensor in enumerate(held)}
        groups = self.check_param_groups(state_dict["param_groups"])
        state = {
            index[name]: {
                key: value.to_local()
                if isinstance(value, DTensor) and not isinstance(held[index[name]], DTensor)
                else value
                for key, value in values.items()
            }
            for name, values in state_dict["state"].items()
        }
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        # A checkpoint without one (saved from bf16 or fp32) leaves the scaler as built.
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def check_param_groups(self, saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Checks the parameter groups `sharded_state_dict()` saved against this optimizer's,
        before anything is loaded (`saved_param_groups.loadable_param_groups`).

        Returns:
            The saved groups as the torch optimizer's `load_state_dict()` takes them.

        Raises:
            ValueError: they do not fit this optimizer (named, with the fix).
        """
        names = self._parameter_names()
        return loadable_param_groups(
            self.optimizer, lambda tensor: names[id(tensor)][0], self._held(), saved_groups
        )

    def stage_param_groups(
        self, saved_groups: list[dict[str, Any]], elsewhere: set[str]
    ) -> list[dict[str, Any]]:
        """A checkpoint's parameter groups (the whole model's) as this optimizer holds them,
        for `check_param_groups` and `load_sharded_state_dict`: less the parameters only other
        pipeline stages hold (`elsewhere`), in the order of this optimizer's groups
        (`saved_param_groups.stage_param_groups`)."""
        names = self._parameter_names()
        return stage_param_groups(
            self.optimizer, lambda tensor: names[id(tensor)][0], saved_groups, elsewhere
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict saved by `state_dict()`: the torch optimizer's state and the fp32
        masters (not the model's parameters, which the model's own state dict restores).

        Raises:
            ValueError: the state dict's masters do not match this optimizer's.
        """
        state_dict = dict(state_dict)
        saved = state_dict.pop("fp32_from_fp16_params", [])
        scaler_state = state_dict.pop("grad_scaler", None)
        if self.grad_scaler is not None and scaler_state is not None:
            self.grad_scaler.load_state_dict(scaler_state)
        masters = [main for _, main in self._masters]
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


def _shard_like(value: torch.Tensor, held: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """`value`, a state of `held` (the tensor the torch optimizer steps for `param`), as a
    DTensor placed like `param` where `held` is a plain local shard of the DTensor `param` and
    `value` has its shape (a per-element state); as it is otherwise."""
    if not isinstance(param, DTensor) or isinstance(held, DTensor):
        return value
    if value.dim() == 0 or value.shape != held.shape:
        return value
    return DTensor.from_local(
        value,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _empty_sharded(
    size: torch.Size, dtype: torch.dtype, held: torch.Tensor, param: torch.nn.Parameter
) -> torch.Tensor:
    """An empty tensor to load a saved state of global shape `size` into: sharded like
    `param` (see `_shard_like`) where it has the parameter's shape, else whole."""
    if size == param.shape and isinstance(param, DTensor):
        local = torch.empty(param.to_local().shape, dtype=dtype, device=held.device)
        return _shard_like(local, local, param)
    device = held.device if len(size) else torch.device("cpu")
    return torch.empty(size, dtype=dtype, device=device)
