"""The interface shared by the data-parallel wrappers, so a training loop need not know which one
it holds: `DistributedDataParallel` (plain DDP) or Megatron-FSDP's `FullyShardedDataParallel`."""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fusions.fused_adam import StepAmaxes
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig


def resolve_data_parallel_group(pg_collection: ProcessGroupCollection | None) -> dist.ProcessGroup:
    """The group gradients are averaged over: `pg_collection.dp_cp`, else parallel_state's
    data-parallel-with-context group, else the default (world) group."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "(or launch with torchrun) before wrapping the model."
        )
    if pg_collection is not None:
        if pg_collection.dp_cp is None:
            raise ValueError(
                "pg_collection.dp_cp is None: pass ProcessGroupCollection(dp_cp=<group>) or "
                "ProcessGroupCollection.use_mpu_process_groups()."
            )
        return pg_collection.dp_cp
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    return dist.group.WORLD


class _BaseDataParallel(torch.nn.Module, abc.ABC):
    """Holds the wrapped module and forwards to it; subclasses implement gradient sync."""

    keeps_main_weights = False
    """Whether the module's parameters are the weights an optimizer steps, kept by the engine in
    its main-weight dtype (Megatron-FSDP's main weights) so that an optimizer keeps no masters;
    if not, an optimizer keeps fp32 masters of the parameters that are not fp32 (the DDP
    engine)."""

    def __init__(self, config: TransformerConfig, module: torch.nn.Module):
        super().__init__()
        self.config = config
        self.module = module
        # Megatron-core's rule, fixed when the engine is built: under the config's
        # `calculate_per_token_loss` gradient reductions sum over the data-parallel ranks instead
        # of averaging, and the loop divides them by the global token count.
        self.sums_grads = config is not None and config.calculate_per_token_loss

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module."""
        return self.module(*inputs, **kwargs)

    @abc.abstractmethod
    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate gradients without synchronising them."""

    @abc.abstractmethod
    def zero_grad_buffer(self) -> None:
        """Zeroes the gradient buffers before the first microbatch of a step."""

    @abc.abstractmethod
    def start_grad_sync(self, *unused: Any) -> None:
        """Launches the gradient reduction of every bucket."""

    @abc.abstractmethod
    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Waits until every gradient is reduced (launching what has not been launched).

        Args:
            force_all_reduce: Megatron-core's; accepted, no effect (every gradient an optimizer
                reads is reduced either way).
        """

    @abc.abstractmethod
    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """Multiplies every gradient by `scaling_factor` (a number, or a one-element tensor on
        the gradients' device, which needs no host synchronisation)."""

    @abc.abstractmethod
    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """Brings parameters up to date before the next forward (after an optimizer step).

        Args:
            force_sync: refresh every parameter, even where no write to it was seen.
            force_dispatch: Megatron-core's; accepted, no effect (what is issued here is issued
                at once).
        """

    @abc.abstractmethod
    def broadcast_params(self) -> None:
        """Gives every data-parallel rank the first rank's weights (after an initialisation that
        differed across ranks)."""

    def global_view(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (shaped like `param`: its gradient, master or itself) as a global tensor: as
        it is, unless the engine splits `param` without saying so in its type."""
        return tensor

    def local_main_weights(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each parameter the optimizer may step as a plain local shard -> that shard (none
        unless the engine shards the main weights)."""
        return {}

    def prepare_step_amaxes(self) -> StepAmaxes | None:
        """What the optimizer step about to write the main weights should record of them for
        `step_and_copy` (the amaxes of FP8 weights cast from them), or None (here: the
        engine's FP8 weights take their amaxes themselves)."""
        return None

    def state_dict(
        self, prefix: str = "", keep_vars: bool = False, destination: dict | None = None
    ) -> dict[str, Any]:
        """The wrapped module's state dict (no wrapper prefix in the keys; upstream's
        signature, whose first positional argument is the prefix)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(
        self, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """Megatron-core's name for `state_dict()` in checkpoint code."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Loads a state dict saved by `state_dict()` into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict)
