"""Embeddings held by both the first and the last pipeline stage (Megatron-LM's embedding
group).

With several stages, the first stage holds the embedding and the last stage a copy of some of
it: of the word embeddings as its output layer with `share_embeddings_and_output_weights`, and
of the whole embedding (word and learned position embeddings) when it runs the multi-token
prediction depths, which embed the shifted tokens. The copies are kept equal to the first
stage's as upstream keeps the tied word embeddings: they start as the first stage's weights
(`broadcast_tied_embeddings`, before the engines wrap the chunks), and after each step's
data-parallel reduction each pair of gradients is summed over the embedding group
(`allreduce_tied_embedding_grads`), so both copies take the same step: the gradient of the one
shared matrix. (Megatron-LM leaves the last stage's learned position embeddings apart from the
first stage's; here they stay one parameter, as in a model of one stage.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel


def embedding_copies(chunk: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The chunk's parameters that the first and the last stage each hold a copy of, in the
    same order on both: the word embeddings (the first stage's; the last stage's output layer
    or, with multi-token prediction, its embedding's), then with multi-token prediction the
    learned position embeddings. Empty with one stage (`pre_process` and `post_process`: one
    copy, used twice), on a middle chunk and for a model that is not a `GPTModel`."""
    model = getattr(chunk, "module", chunk)
    pre_process = getattr(model, "pre_process", True)
    if pre_process == getattr(model, "post_process", True):
        return []
    if pre_process:
        # The last stage's depths copy the whole embedding (the config says whether it has them).
        with_mtp = model.config.mtp_num_layers is not None
    else:
        with_mtp = getattr(model, "mtp_process", False)
    copies = []
    if with_mtp or getattr(model, "share_embeddings_and_output_weights", False):
        copies.append(model.shared_embedding_or_output_weight())
    position_embeddings = getattr(getattr(model, "embedding", None), "position_embeddings", None)
    if with_mtp and position_embeddings is not None:
        copies.append(position_embeddings.weight)
    return copies


def tied_embedding_weight(chunk: torch.nn.Module) -> torch.nn.Parameter | None:
    """The chunk's copy of the word embeddings when both end stages hold one (the first of
    `embedding_copies`); None otherwise (one stage, a middle chunk, untied embeddings without
    multi-token prediction)."""
    copies = embedding_copies(chunk)
    return copies[0] if copies else None


def _has_two_copies(embd_group: dist.ProcessGroup | None) -> bool:
    """Whether this rank is in an embedding group of two stages (a middle stage is in none:
    parallel_state hands it a group it is not a member of)."""
    return isinstance(embd_group, dist.ProcessGroup) and embd_group.size() > 1


@torch.no_grad()
def broadcast_tied_embeddings(
    chunks: list[torch.nn.Module], embd_group: dist.ProcessGroup | None
) -> None:
    """Gives the last stage's copies the first stage's weights (call before wrapping).

    Raises:
        ValueError: the weights are on the meta device (nothing to copy yet).
    """
    if not _has_two_copies(embd_group):
        return
    for chunk in chunks:
        for weight in embedding_copies(chunk):
            if weight.is_meta:
                raise ValueError(
                    "Embeddings held by the first and the last pipeline stage (tied, or for "
                    "multi-token prediction) need real weights to copy to the last stage: drop "
                    "--init-model-with-meta-device, or pass --untie-embeddings-and-output-weights "
                    "without --mtp-num-layers."
                )
            source = dist.get_global_rank(embd_group, 0)
            dist.broadcast(weight.data, src=source, group=embd_group)


@torch.no_grad()
def allreduce_tied_embedding_grads(
    chunks: list[torch.nn.Module], embd_group: dist.ProcessGroup | None
) -> None:
    """Sums the reduced gradients of each parameter's two copies over the embedding group
    (after `finish_grad_sync()`): the DDP engine's `main_grad`, Megatron-FSDP's DTensor
    `.grad`.

    Raises:
        ValueError: the DDP engine with the distributed optimizer (each rank holds only its
            shard of the reduced gradient; not built).
    """
    if not _has_two_copies(embd_group):
        return
    for chunk in chunks:
        for weight in embedding_copies(chunk):
            _allreduce_grad(chunk, weight, embd_group)


def _allreduce_grad(
    chunk: torch.nn.Module, weight: torch.nn.Parameter, embd_group: dist.ProcessGroup
) -> None:
    if isinstance(chunk, DistributedDataParallel):
        if chunk.ddp_config.use_distributed_optimizer:
            raise ValueError(
                "Embeddings held by the first and the last pipeline stage (tied, or for "
                "multi-token prediction) with the DDP engine's distributed optimizer are not "
                "built: pass --untie-embeddings-and-output-weights without --mtp-num-layers, or "
                "use Megatron-FSDP (--use-megatron-fsdp)."
            )
        dist.all_reduce(weight.main_grad, group=embd_group)
        return
    grad = weight.grad
    if grad is None:
        return
    if isinstance(grad, DTensor):
        whole = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
        summed = whole.to_local().clone()
        dist.all_reduce(summed, group=embd_group)
        local = DTensor.from_local(summed, grad.device_mesh, whole.placements)
        grad.to_local().copy_(local.redistribute(grad.device_mesh, grad.placements).to_local())
    else:
        dist.all_reduce(grad, group=embd_group)
