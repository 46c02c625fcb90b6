"""What an optimizer needs of a model chunk's data-parallel engine (`DataParallelEngine`), and
`engine_of(chunk)`, which tells which engine a chunk has.

Both wrappers (`DistributedDataParallel`, Megatron-FSDP's `FullyShardedDataParallel`) are
engines themselves; a module sharded with `fully_shard()` alone is seen through
`fsdp.roots.FsdpRoots`, a plain module (one process) through `LocalModule`. The optimizer and
the training loop call the interface and never ask which engine they hold.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.fsdp.roots import FsdpRoots, fsdp_roots
from megatron.core.fusions.fused_adam import StepAmaxes


class DataParallelEngine(Protocol):
    """The engine of one model chunk, as an optimizer sees it.

    Attributes:
        module: the module whose parameters the engine synchronises (without the wrapper).
        keeps_main_weights: whether the module's parameters are the weights the optimizer
            steps, kept by the engine in its main-weight dtype (Megatron-FSDP's DTensor main
            weights), so that the optimizer keeps no masters; if not, the optimizer keeps fp32
            masters of the parameters that are not fp32.
    """

    module: torch.nn.Module
    keeps_main_weights: bool

    def finish_grad_sync(self) -> None:
        """Completes every gradient reduction (idempotent); the optimizer may then read them."""

    def global_view(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (shaped like `param`: its gradient, master or itself) as the global tensor
        the norm, the clipping and checkpoints read."""

    def local_main_weights(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each parameter the optimizer may step as a plain local shard -> that shard."""

    def prepare_step_amaxes(self) -> StepAmaxes | None:
        """What the optimizer step about to write the main weights should record of them for
        `step_and_copy` (the amaxes of FP8 weights cast from them), or None. Call it right
        before that step, once per step: it resets what the last step recorded."""


class LocalModule:
    """A module without a data-parallel engine (one process): its `.grad`s are final as they
    are, and its parameters are what they are."""

    keeps_main_weights = False

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def finish_grad_sync(self) -> None:
        """Nothing to reduce."""

    def global_view(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as it is."""
        return tensor

    def local_main_weights(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """None: nothing is sharded."""
        return {}

    def prepare_step_amaxes(self) -> StepAmaxes | None:
        """None: FP8 weights are cast at their use (`megatron.core.fp8.weights`)."""
        return None


def engine_of(chunk: torch.nn.Module) -> DataParallelEngine:
    """The engine of `chunk`: the wrapper itself, the `fully_shard()` units under it
    (`FsdpRoots`), or none (`LocalModule`)."""
    if isinstance(chunk, _BaseDataParallel):
        return chunk
    if fsdp_roots(chunk):
        return FsdpRoots(chunk)
    return LocalModule(chunk)


def local_main_weights_of(
    engines: list[DataParallelEngine],
) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Every parameter the `engines` let the optimizer step as a plain local shard -> that
    shard, over all of them (a model's chunks)."""
    return {
        param: shard for engine in engines for param, shard in engine.local_main_weights().items()
    }
