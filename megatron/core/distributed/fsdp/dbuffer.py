"""Flat buffers of a parameter group: `ShardLayout` (where each tensor lives) and `DBuffer`.

Layout. The tensors of a group are split along dim 0 into N chunks of ceil(rows / N) rows, the
chunking of `torch.chunk` and of DTensor's `Shard(0)`. Shard r of the flat buffer holds chunk r
of every tensor, one after the other; a chunk that is short (or empty: a tensor with fewer rows
than N) is padded to the full chunk size, so every shard has the same size S and the buffer is
N x S elements, shard-major. Any shape works: (7, 15) over 4 ranks is four chunks of 2 rows, the
last holding 1 row and 15 elements of padding.

This is the layout NCCL's all-gather and reduce-scatter produce and consume, so a gathered
buffer is shard-major. The tensors of the module want the opposite, each tensor contiguous:
`ShardLayout.unsharded()` is that layout (one shard, each tensor padded to N chunks).
`copy_chunks_out` rearranges a gathered buffer into it (HFSDP's inner shard) and
`copy_chunks_in` packs whole tensors into a shard-major buffer, casting on the way, for the
reductions of locally accumulated gradients (ZeRO-1, HFSDP's outer reduction, the distributed
optimizer's buckets). The per-unit collectives skip the shard-major buffer: chunk r of a padded
tensor is its row block r, so each tensor's chunks are all-gathered straight into it and
reduce-scattered straight out of it (`Collectives.all_gather_tensors` and
`reduce_scatter_tensors`).

`DBuffer` is one 1-D storage in a layout: either this rank's shard only (`sharded=True`) or all
N shards (replicated, or gathered). Its storage can be released and reallocated in place, which
keeps views saved by autograd valid across the free; a buffer in memory other buffers share (a
symmetric window) is only marked free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from megatron.core.multi_tensor import add_tensors_, copy_tensors_


class ShardLayout:
    """Where each tensor of a group lives in a buffer of `num_shards` equal shards.

    Args:
        shapes: the (global) shape of each tensor; at least one dimension each.
        num_shards: N, the number of shards (1: no sharding, tensors back to back).

    Raises:
        ValueError: a 0-dim tensor (it has no dim 0 to shard).
    """

    def __init__(self, shapes: Sequence[torch.Size], num_shards: int):
        for shape in shapes:
            if len(shape) == 0:
                raise ValueError(
                    "Megatron-FSDP shards tensors along dim 0; a 0-dim parameter cannot be "
                    "sharded. Give it shape (1,) instead."
                )
        self.shapes = [torch.Size(shape) for shape in shapes]
        self.num_shards = num_shards
        self.row_numels = [math.prod(shape[1:]) for shape in self.shapes]
        self.chunk_rows = [math.ceil(shape[0] / num_shards) for shape in self.shapes]
        self.chunk_numels = [r * n for r, n in zip(self.chunk_rows, self.row_numels)]
        self.offsets: list[int] = []
        offset = 0
        for numel in self.chunk_numels:
            self.offsets.append(offset)
            offset += numel
        self.shard_numel = offset
        self.numel = offset * num_shards
        # No chunk is short (so none is padded): every tensor splits into N full chunks.
        self.splits_evenly = all(shape[0] % num_shards == 0 for shape in self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def valid_rows(self, index: int, shard: int) -> int:
        """How many real (not padding) rows of tensor `index` shard `shard` holds."""
        rows = self.chunk_rows[index]
        return max(0, min(rows, self.shapes[index][0] - shard * rows))

    def local_shape(self, index: int, shard: int) -> torch.Size:
        """The shape of tensor `index`'s chunk in shard `shard` (what DTensor calls local)."""
        return torch.Size((self.valid_rows(index, shard), *self.shapes[index][1:]))

    def shard_range(self, shard: int) -> tuple[int, int]:
        """[start, end) of shard `shard` in the N x S buffer."""
        return shard * self.shard_numel, (shard + 1) * self.shard_numel

    def unsharded(self) -> ShardLayout:
        """The one-shard layout with each tensor padded to N full chunks: tensors are contiguous
        there, and chunk r of each starts where `copy_chunks_out` writes it."""
        padded = [
            torch.Size((rows * self.num_shards, *shape[1:]))
            for rows, shape in zip(self.chunk_rows, self.shapes)
        ]
        return ShardLayout(padded, 1)

    def local_views(self, shard_data: torch.Tensor, shard: int) -> list[torch.Tensor]:
        """Views of the real rows of each tensor in `shard_data`, one shard of this layout."""
        return [
            shard_data[offset : offset + self.valid_rows(i, shard) * self.row_numels[i]].view(
                self.local_shape(i, shard)
            )
            for i, offset in enumerate(self.offsets)
        ]


class DBuffer:
    """A flat 1-D storage holding one shard (`sharded=True`) or all shards of a `ShardLayout`.

    Args:
        layout: where the tensors live.
        dtype: element type.
        device: where the storage lives.
        sharded: hold only shard `rank` (S elements) instead of all N shards (N x S).
        rank: this rank's shard index.
        zeroed: start from zeros (padding reads as zero); False for staging buffers that a
            collective overwrites entirely.
        data: existing memory to use instead of allocating (`layout`-sized).
        shared: `data` is part of memory that other buffers use at other times (a symmetric
            window, `symmetric_memory.py`): releasing only marks the buffer free, and
            reallocating marks it in use again, holding whatever the memory holds.
    """

    def __init__(
        self,
        layout: ShardLayout,
        dtype: torch.dtype,
        device: torch.device,
        *,
        sharded: bool,
        rank: int,
        zeroed: bool = True,
        data: torch.Tensor | None = None,
        shared: bool = False,
    ):
        self.layout = layout
        self.sharded = sharded
        self.rank = rank
        numel = layout.shard_numel if sharded else layout.numel
        if data is None:
            factory = torch.zeros if zeroed else torch.empty
            data = factory(numel, dtype=dtype, device=device)
        elif data.numel() != numel or data.dtype != dtype:
            raise ValueError(f"DBuffer data must be {numel} elements of {dtype}.")
        self.data = data
        self._shared = shared
        self._nbytes = self.data.untyped_storage().nbytes()
        # Tracked here rather than read from the storage (a new Python object per read): only
        # `free_storage` / `reallocate_storage` resize it.
        self._allocated = self._nbytes > 0

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard (S elements)."""
        if self.sharded:
            return self.data
        start, end = self.layout.shard_range(self.rank)
        return self.data[start:end]

    @property
    def full(self) -> torch.Tensor:
        """All N shards (a replicated or gathered buffer).

        Raises:
            RuntimeError: the buffer holds one shard only.
        """
        if self.sharded:
            raise RuntimeError("A sharded DBuffer has no full view; all-gather it first.")
        return self.data

    def local_views(self) -> list[torch.Tensor]:
        """Views of the real rows of each tensor in this rank's shard (DTensor local tensors)."""
        return self.layout.local_views(self.shard, self.rank)

    def tensor_views(self) -> list[torch.Tensor]:
        """Each whole tensor, for a one-shard buffer of unpadded or padded shapes (the views a
        module computes with)."""
        if self.layout.num_shards != 1:
            raise RuntimeError("tensor_views() needs a one-shard (unsharded) layout.")
        return self.layout.local_views(self.data, 0)

    # Storage lifetime. Autograd saves views of `data`; resizing the storage in place (rather
    # than replacing the tensor) keeps them pointing at memory that is valid again once
    # reallocated and refilled, as FSDP2 does.

    @property
    def is_allocated(self) -> bool:
        return self._allocated

    def free_storage(self) -> None:
        """Frees the memory; views stay valid objects but must not be read until reallocated."""
        if self._allocated:
            if not self._shared:
                self.data.untyped_storage().resize_(0)
            self._allocated = False

    def reallocate_storage(self) -> None:
        """Allocates the memory again (uninitialised) under the same tensor and views."""
        if not self._allocated:
            if not self._shared:
                self.data.untyped_storage().resize_(self._nbytes)
            self._allocated = True

    def untracked(self) -> torch.Tensor:
        """`data` again, as a tensor of its own over the same storage: a new version counter,
        so that writes through it (and its views) bump none of `data`'s or its views'.

        Where the engine refills memory whose earlier values autograd saved (the whole
        weights, gathered again for backward), the refill restores those values, and must not
        read as an in-place modification. An autograd view would share `data`'s counter;
        `_unsafe_preserve_version_counter` around each write would cost host time per gather.
        """
        alias = torch.empty(0, dtype=self.data.dtype, device=self.data.device)
        with torch.no_grad():
            alias.set_(self.data.untyped_storage(), self.data.storage_offset(), self.data.shape)
        return alias


def chunk_targets(unsharded: DBuffer, layout: ShardLayout) -> list[torch.Tensor]:
    """Each tensor of `unsharded` viewed as (N, chunk numel) of `layout`: where gathered
    chunks are written. The views stay valid across `free_storage` / `reallocate_storage`,
    so they can be made once.

    Writes through them bump no version counter of `unsharded.data` or its views (they view
    `unsharded.untracked()`): refilling weights that autograd saved in forward (and that were
    freed in between) restores the values it saved, which must not read as an in-place
    modification in backward.
    """
    views = unsharded.layout.local_views(unsharded.untracked(), 0)
    return [view.view(layout.num_shards, n) for view, n in zip(views, layout.chunk_numels)]


def copy_chunks_out(gathered: DBuffer, unsharded: DBuffer) -> None:
    """Rearranges a gathered (shard-major) buffer (all N shards) into `unsharded`
    (tensor-major, padded), bumping none of its version counters (`chunk_targets`)."""
    layout = gathered.layout
    torch.split_with_sizes_copy(
        gathered.full.view(layout.num_shards, layout.shard_numel),
        layout.chunk_numels,
        dim=1,
        out=chunk_targets(unsharded, layout),
    )


def concatenates(tensors: Sequence[torch.Tensor], layout: ShardLayout) -> bool:
    """Whether `tensors` are, each, their own N full chunks back to back in one dtype
    (contiguous, no chunk short): each can then be reduce-scattered as it is."""
    dtype = tensors[0].dtype
    return layout.splits_evenly and all(t.dtype == dtype and t.is_contiguous() for t in tensors)


def copy_chunks_in(tensors: Sequence[torch.Tensor], out: torch.Tensor, layout: ShardLayout):
    """Writes whole tensors into `out`, an N x S buffer of `layout`, zero-padding short chunks
    and casting to `out`'s dtype, in one kernel.

    `torch.cat` of each tensor's (N, chunk) rows where no chunk is short and no cast is needed:
    its host cost does not grow with the bytes moved, unlike `torch._chunk_cat`'s (which builds
    per-block metadata on the host and copies it to the device), the general case here.
    """
    rows = out.view(layout.num_shards, layout.shard_numel)
    if concatenates(tensors, layout) and tensors[0].dtype == out.dtype:
        torch.cat(
            [t.view(layout.num_shards, n) for t, n in zip(tensors, layout.chunk_numels)],
            dim=1,
            out=rows,
        )
    else:
        # A tensor with no elements takes no room in the layout, and `_chunk_cat` refuses it.
        nonempty = [t for t in tensors if t.numel() > 0]
        if nonempty:
            torch._chunk_cat(nonempty, dim=0, num_chunks=layout.num_shards, out=rows)


def cast_into(
    targets: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    written: Iterable[bool],
) -> None:
    """Each gradient cast into its target, or added to it where a linear layer wrote one
    there (`written`, gradient-accumulation fusion); targets with neither are zeroed, in
    grouped launches (`megatron.core.multi_tensor`)."""
    copies, adds, zeros = ([], []), ([], []), []
    for target, grad, fused in zip(targets, grads, written):
        if grad is not None:
            into = adds if fused else copies
            into[0].append(target)
            into[1].append(grad)
        elif not fused:
            zeros.append(target)
    if copies[0]:
        copy_tensors_(*copies)
    if adds[0]:
        add_tensors_(*adds)
    if zeros:
        torch._foreach_zero_(zeros)
