"""Tied input and output embeddings across pipeline stages (Megatron-LM's embedding group).

With `share_embeddings_and_output_weights` and several stages, the first stage holds the word
embeddings and the last stage a copy of them as its output layer. The two are kept equal as
upstream does: the copy starts as the first stage's weights (`broadcast_tied_embeddings`, before
the engines wrap the chunks), and after each step's data-parallel reduction the two gradients
are summed over the embedding group (`allreduce_tied_embedding_grads`), so both copies take the
same step: the gradient of the one shared matrix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel


def tied_embedding_weight(chunk: torch.nn.Module) -> torch.nn.Parameter | None:
    """The chunk's copy of the tied word embeddings when stages share them: the embedding on the
    first stage, the output layer on the last; None otherwise (no tying, one stage, a middle
    chunk)."""
    model = getattr(chunk, "module", chunk)
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return None
    if model.pre_process == model.post_process:  # both: one copy, used twice; neither: none
        return None
    return model.shared_embedding_or_output_weight()


def _has_two_copies(embd_group: dist.ProcessGroup | None) -> bool:
    """Whether this rank is in an embedding group of two stages (a middle stage is in none:
    parallel_state hands it a group it is not a member of)."""
    return isinstance(embd_group, dist.ProcessGroup) and embd_group.size() > 1


@torch.no_grad()
def broadcast_tied_embeddings(
    chunks: list[torch.nn.Module], embd_group: dist.ProcessGroup | None
) -> None:
    """Gives the last stage's copy the first stage's weights (call before wrapping).

    Raises:
        ValueError: the weights are on the meta device (nothing to copy yet).
    """
    if not _has_two_copies(embd_group):
        return
    for chunk in chunks:
        weight = tied_embedding_weight(chunk)
        if weight is None:
            continue
        if weight.is_meta:
            raise ValueError(
                "Tied embeddings across pipeline stages need real weights to copy to the last "
                "stage: drop --init-model-with-meta-device, or pass "
                "--untie-embeddings-and-output-weights."
            )
        source = dist.get_global_rank(embd_group, 0)
        dist.broadcast(weight.data, src=source, group=embd_group)


@torch.no_grad()
def allreduce_tied_embedding_grads(
    chunks: list[torch.nn.Module], embd_group: dist.ProcessGroup | None
) -> None:
    """Sums the reduced gradients of the two copies over the embedding group (after
    `finish_grad_sync()`): the DDP engine's `main_grad`, Megatron-FSDP's DTensor `.grad`.

    Raises:
        ValueError: the DDP engine with the distributed optimizer (each rank holds only its
            shard of the reduced gradient; not built).
    """
    if not _has_two_copies(embd_group):
        return
    for chunk in chunks:
        weight = tied_embedding_weight(chunk)
        if weight is None:
            continue
        if isinstance(chunk, DistributedDataParallel):
            if chunk.ddp_config.use_distributed_optimizer:
                raise ValueError(
                    "Tied embeddings across pipeline stages with the DDP engine's distributed "
                    "optimizer are not built: pass --untie-embeddings-and-output-weights, or use "
                    "Megatron-FSDP (--use-megatron-fsdp)."
                )
            dist.all_reduce(weight.main_grad, group=embd_group)
            continue
        grad = weight.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            whole = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
            summed = whole.to_local().clone()
            dist.all_reduce(summed, group=embd_group)
            local = DTensor.from_local(summed, grad.device_mesh, whole.placements)
            grad.to_local().copy_(local.redistribute(grad.device_mesh, grad.placements).to_local())
        else:
            dist.all_reduce(grad, group=embd_group)
