"""Staging buffers from PyTorch's NCCL symmetric-memory pool (`use_symm_mem`).

NCCL (2.27+) runs its symmetric kernels, which copy over NVLink with fewer SMs and lower
latency than the ring kernels, when every buffer of a collective lies in a window that all ranks
registered at the same offset. Such memory is costly to make (allocation from the pool, then a
collective `rendezvous`), so it cannot be allocated per collective as the default staging is.
`SymmetricStaging` therefore holds one persistent buffer per (role, process group, dtype), sized
for the largest parameter group that uses it and made once, on every rank in the same order,
when the root's context is built:

- all-gather output: the all-gather stream orders its reuse (gather, copy out, gather the next
  unit);
- reduce-scatter input: the context has one reduce-scatter in flight at a time and the compute
  stream waits for it before packing the next, so it never writes the buffer while a collective
  still reads it.

The collectives run in place (the input is this rank's slice of the symmetric output, or the
output a slice of the symmetric input), so both their buffers lie in the window. Symmetric
kernels reduce only with SUM: averaging becomes SUM plus a local divide (`Collectives`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
_MIN_NCCL = (2, 27)


def check_symm_mem_support(device: torch.device, groups: list[dist.ProcessGroup]) -> None:
    """Raises a `ValueError` naming what is missing when `use_symm_mem` cannot work here."""
    problem = None
    if device.type != "cuda":
        problem = f"the parameters are on {device}, not a CUDA device"
    elif any(dist.get_backend(group) != "nccl" for group in groups):
        problem = "a data-parallel process group does not use the NCCL backend"
    else:
        try:
            from torch.distributed import _symmetric_memory as symm_mem
        except ImportError:
            symm_mem = None
        if symm_mem is None or not hasattr(symm_mem, "get_mem_pool"):
            problem = f"torch {torch.__version__} has no NCCL symmetric-memory pool"
        elif torch.cuda.nccl.version() < _MIN_NCCL:
            problem = f"NCCL {torch.cuda.nccl.version()} is older than 2.27"
    if problem is not None:
        raise ValueError(
            f"use_symm_mem=True needs CUDA, the NCCL backend, and torch with NCCL >= 2.27 "
            f"symmetric memory, but {problem}. Set use_symm_mem=False (--use-symm-mem off)."
        )


@dataclass(frozen=True)
class _Key:
    role: str
    group_name: str
    dtype: torch.dtype


class SymmetricStaging:
    """Persistent symmetric staging buffers: `reserve()` sizes them, `allocate()` makes them
    (collective), `buffer()` hands out views.

    Args:
        device: the CUDA device of the parameters.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._sizes: dict[_Key, int] = {}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._buffers: dict[_Key, torch.Tensor] = {}

    def reserve(self, role: str, group: dist.ProcessGroup, dtype: torch.dtype, numel: int) -> None:
        """Makes the buffers of (role, group, dtype) hold at least `numel` elements."""
        key = _Key(role, group.group_name, dtype)
        self._sizes[key] = max(self._sizes.get(key, 0), numel)
        self._groups[group.group_name] = group

    def allocate(self) -> None:
        """Allocates every reserved buffer from the NCCL pool and registers it with its group.

        Collective over each group, in an order every rank shares. Each group first runs a
        one-element all-reduce, so its NCCL communicator exists before the rendezvous.
        """
        from torch.distributed import _symmetric_memory as symm_mem

        if symm_mem.get_backend(self.device) != "NCCL":
            symm_mem.set_backend("NCCL")
        for name in sorted(self._groups):
            dist.all_reduce(torch.zeros(1, device=self.device), group=self._groups[name])
        pool = symm_mem.get_mem_pool(self.device)
        for key in sorted(self._sizes, key=lambda k: (k.role, k.group_name, str(k.dtype))):
            with torch.cuda.use_mem_pool(pool):
                tensor = torch.empty(self._sizes[key], dtype=key.dtype, device=self.device)
            symm_mem.rendezvous(tensor, self._groups[key.group_name])
            self._buffers[key] = tensor

    def buffer(
        self, role: str, group: dist.ProcessGroup, dtype: torch.dtype, numel: int
    ) -> torch.Tensor:
        """The first `numel` elements of the buffer of (role, group, dtype)."""
        return self._buffers[_Key(role, group.group_name, dtype)][:numel]

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in one of these buffers."""
        address = tensor.data_ptr()
        return any(
            buf.data_ptr() <= address < buf.data_ptr() + buf.numel() * buf.element_size()
            for buf in self._buffers.values()
        )
