"""The distributed optimizer's sharding of one DDP gradient bucket (`use_distributed_optimizer`).

Megatron-LM's `DistributedOptimizer` gives each data-parallel rank 1/N of every bucket: the
bucket's gradients are reduce-scattered instead of all-reduced, each rank steps the fp32 main
weights of its part only, and the updated parameters are all-gathered after the step. This
module cuts a bucket with Megatron-FSDP's `ShardLayout` (every parameter split along dim 0 into N
chunks of ceil(rows / N) rows, `torch.chunk`'s and DTensor `Shard(0)`'s chunking), rather than at
arbitrary element offsets of the flat bucket as Megatron-LM does: then this rank's part of each
parameter is a row block of it, i.e. the local tensor of a `Shard(0)` DTensor, which a stock
optimizer steps and `torch.distributed.checkpoint` reshards like Megatron-FSDP's main weights.

One collective per bucket and direction, as Megatron-LM: the gradients are packed into one
shard-major staging buffer (`copy_chunks_in`, zero-padding short chunks) and reduce-scattered into
this rank's gradient shard; for the parameters, this rank's row blocks are copied into its block
of one staging buffer per parameter dtype, all-gathered, and each parameter's chunks copied back
into it (two row ranges per parameter at most, all in one `_foreach_copy_`). With
`fp8_param_gather` the weights of FP8 linear layers are gathered as FP8 bytes instead, one
collective per bucket and dtype as well (`fp8_param_gather.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.fp8_param_gather import Fp8ParamGather
from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import DBuffer, ShardLayout, copy_chunks_in
from megatron.core.distributed.fsdp.fp8_gather import Fp8ComputeWeights
from megatron.core.utils import all_gather_single, reduce_scatter_single


class BucketShards:
    """This rank's part of a gradient bucket's parameters and reduced gradients.

    Args:
        params: the bucket's parameters, in the order their gradients lie in the bucket.
        main_grads: each parameter's `main_grad` (the bucket's views), in the same order.
        group: the data-parallel group the bucket is sharded over.
        fp8_names: the parameters gathered in FP8 (`fp8_param_gather`), with their names.

    Raises:
        ValueError: a parameter has no dimension to shard (0-dim).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        main_grads: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        fp8_names: Mapping[torch.nn.Parameter, str] | None = None,
    ):
        for param in params:
            if param.dim() == 0:
                raise ValueError(
                    "--use-distributed-optimizer shards parameters along dim 0; a 0-dim "
                    "parameter cannot be sharded. Give it shape (1,), or drop "
                    "--use-distributed-optimizer."
                )
        self.params = tuple(params)
        self.main_grads = tuple(main_grads)
        self.group = group
        self.rank = group.rank()
        self.layout = ShardLayout([p.shape for p in params], group.size())
        self.grad_shard = DBuffer(
            self.layout, main_grads[0].dtype, main_grads[0].device, sharded=True, rank=self.rank
        )
        # Reduced gradient of this rank's rows of each parameter (empty where it holds none).
        self.grads = dict(zip(self.params, self.grad_shard.local_views()))
        # This rank's rows of each parameter (views): what the optimizer updates.
        self.param_shards = {p: p.detach()[self._rows(i)] for i, p in enumerate(self.params)}
        # The parameters are gathered per dtype: a bucket holds one gradient dtype, and with
        # grad_reduce_in_fp32 parameters of several dtypes may share it. FP8 weights apart.
        fp8_names = fp8_names or {}
        by_dtype: dict[tuple[torch.dtype, bool], list[int]] = {}
        for i, param in enumerate(self.params):
            by_dtype.setdefault((param.dtype, param in fp8_names), []).append(i)
        self._gathers = [
            (indices, ShardLayout([self.params[i].shape for i in indices], group.size()))
            for (_, fp8), indices in by_dtype.items()
            if not fp8
        ]
        self.fp8_gathers = [
            Fp8ParamGather(
                [self.params[i] for i in indices],
                [fp8_names[self.params[i]] for i in indices],
                group,
            )
            for (_, fp8), indices in by_dtype.items()
            if fp8
        ]
        self._staging: torch.Tensor | None = None

    def _rows(self, index: int) -> slice:
        start = self.rank * self.layout.chunk_rows[index]
        return slice(start, start + self.layout.valid_rows(index, self.rank))

    def start_reduce_scatter(self, op: dist.ReduceOp, async_op: bool) -> dist.Work | None:
        """Reduces the bucket's `main_grad`s over the group into `grads` (this rank's rows).
        Call `finish()` once the returned work (if any) is complete."""
        staging = torch.empty(
            self.layout.numel, dtype=self.grad_shard.dtype, device=self.grad_shard.data.device
        )
        copy_chunks_in(self.main_grads, staging, self.layout)
        # Kept until finish(): an asynchronous collective still reads it.
        self._staging = staging
        return reduce_scatter_single(
            self.grad_shard.data, staging, op=op, group=self.group, async_op=async_op
        )

    def finish(self) -> None:
        """Frees the reduce-scatter's staging buffer (its collective has completed)."""
        self._staging = None

    def start_fp8_refresh(self) -> list[Fp8ComputeWeights]:
        """This rank's amaxes of its rows of the FP8 weights (`fp8_param_gather`), for the one
        reduction of all buckets' (`fp8_gather.Fp8Refresh`) before `all_gather_params`."""
        return [gather.start_refresh() for gather in self.fp8_gathers]

    @torch.no_grad()
    def all_gather_params(self, comm: Collectives) -> None:
        """Gives every parameter of the bucket the rows the other ranks hold (`param_shards`,
        which each rank has just updated), so every rank holds whole parameters: the same
        values, but for FP8 weights, gathered as FP8 bytes once `start_fp8_refresh`'s amaxes
        are reduced, which hold the dequantised weight on the rows other ranks own."""
        for gather in self.fp8_gathers:
            gather.finish_refresh(comm)
        size = self.group.size()
        targets, sources = [], []
        for indices, layout in self._gathers:
            params = [self.params[i] for i in indices]
            staging = torch.empty(layout.numel, dtype=params[0].dtype, device=params[0].device)
            blocks = staging.view(size, layout.shard_numel)
            own = blocks[self.rank]
            torch._foreach_copy_(
                layout.local_views(own, self.rank), [self.param_shards[p] for p in params]
            )
            all_gather_single(staging, own, group=self.group)
            for j, param in enumerate(params):
                _chunk_copies(param, blocks, layout, j, targets, sources)
        if targets:  # none where the bucket holds FP8 weights only
            torch._foreach_copy_(targets, sources)

    def scale(self, factor: float | torch.Tensor) -> None:
        """Multiplies the reduced gradient shard by `factor`."""
        self.grad_shard.data.mul_(factor)


def _chunk_copies(
    param: torch.Tensor,
    blocks: torch.Tensor,
    layout: ShardLayout,
    index: int,
    targets: list[torch.Tensor],
    sources: list[torch.Tensor],
) -> None:
    """Appends the copies that move tensor `index`'s chunks from a gathered shard-major buffer
    (`blocks`, N x S) into `param`: the full chunks as one (chunks, chunk numel) block, then the
    short chunk's real rows; the chunks after it hold padding only."""
    flat = param.detach().view(-1)
    start, numel = layout.offsets[index], layout.chunk_numels[index]
    chunks = blocks[:, start : start + numel]
    full = param.shape[0] // layout.chunk_rows[index]
    if full:
        targets.append(flat[: full * numel].view(full, numel))
        sources.append(chunks[:full])
    rest = param.numel() - full * numel
    if rest:
        targets.append(flat[full * numel :])
        sources.append(chunks[full, :rest])
