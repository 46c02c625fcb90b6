"""Persistent NCCL symmetric windows that Megatron-FSDP gathers compute weights into
(`use_symm_mem`).

NCCL (2.27+) runs its symmetric kernels, which copy over NVLink with fewer SMs and lower latency
than its ring kernels, when every buffer of a collective lies in a window that all ranks
registered, at the same offset on each. A window is costly to make (an allocation from
PyTorch's NCCL pool, then a collective `rendezvous`), so the windows are made once, when the
root's context is built, and the compute weights the modules compute with *live* in them: each
tensor's chunks are all-gathered in place there (`Collectives.all_gather_tensors`), exactly as
into memory from the caching allocator, with no staging buffer and no copy.

`place_weights_in_windows` lays them out:

- weights that persist between uses (ZeRO-1/2 compute weights, refreshed by an all-gather after
  each optimizer step, and the root's) each have a place of their own;
- weights gathered for each use and freed after (ZeRO-3) share a ring of slots, one unit's
  weights per slot: the unit that is i-th in module order among the units that contain no
  other unit uses slot i mod K, with K = `max_unsharded_units` + 1 (the units held at once, and
  one more for a use out of module order); a unit that contains others is in use while they
  all run, so it has a place of its own. `Residency` never lets two units of one slot hold
  their weights at once: it reshards the holder before gathering into its slot (a prefetch
  whose slot is still in use is skipped). With `keep_unsharded_params` every unit may be kept
  at once, so each has its own place.

The windows are never freed: every place of its own, and K ring slots each the size of the
largest unit in it, are held for the whole run, between steps too. A unit's released weights
are therefore not freed memory but a slot another unit may overwrite: the engine gathers before
every use, and nothing else may read them while the unit holds none.

Every rank lays out the same units the same way, so each window and offset is the same on all.
Gradients are reduce-scattered from the caching allocator's memory as without `use_symm_mem`:
NCCL's symmetric reduce-scatter is no faster than its ring kernel for these sizes, and slower
for large ones (`docs/performance.md`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.residency import ScheduledUnit

_MIN_NCCL = (2, 27)
# Where each group's weights start in a window: a multiple of this many bytes (alignment for the
# widest vector loads of any dtype).
_ALIGN = 512
# The "slot" of the weights that have a place of their own.
_OWN = -1


def check_symm_mem_support(device: torch.device, groups: Sequence[dist.ProcessGroup]) -> None:
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


def place_weights_in_windows(
    units: Sequence[ScheduledUnit], ring_size: int | None, device: torch.device
) -> dict[int, int]:
    """Makes the windows and moves every whole-weights buffer that is all-gathered into them.

    Collective over every all-gather group, in an order all ranks share; before any forward
    (no autograd graph refers to the buffers yet).

    Args:
        units: the root first, then every unit below it in module order.
        ring_size: K, the slots that the transient weights of leaf units share; None gives
            every unit a place of its own.
        device: the CUDA device of the parameters.

    Returns:
        The ring slot of each unit (by position) whose weights live in one.
    """
    ring = [] if ring_size is None else [unit.position for unit in _ring_units(units)]
    slots = {position: i % ring_size for i, position in enumerate(ring)}
    sizes: dict[tuple[str, int], int] = {}  # bytes of each (process group, slot) window
    places = []
    process_groups: dict[str, dist.ProcessGroup] = {}
    if any(group.plan.fp8_gather for unit in units for group in unit.groups):
        raise ValueError(
            "use_symm_mem=True with fp8_param_gather is not built: the FP8 weights are gathered "
            "outside the symmetric windows. Drop one of them (--use-symm-mem, or "
            "--fp8-param-gather)."
        )
    for unit in units:
        taken: dict[tuple[str, int], int] = {}  # bytes this unit takes in each ring window
        for group in unit.groups:
            weights = group.weights
            if not weights.gathers:
                continue
            process_group = weights.groups.all_gather
            process_groups[process_group.group_name] = process_group
            shared = weights.plan.transient_unsharded and unit.position in slots
            key = (process_group.group_name, slots[unit.position] if shared else _OWN)
            offset = taken.get(key, 0) if shared else sizes.get(key, 0)
            end = offset + -(-weights.unsharded.data.nbytes // _ALIGN) * _ALIGN
            if shared:
                taken[key] = end
            sizes[key] = max(sizes.get(key, 0), end)
            places.append((weights, key, offset))
    check_symm_mem_support(device, list(process_groups.values()))
    # Each group's NCCL communicator must exist before its first rendezvous.
    for name in sorted(process_groups):
        dist.all_reduce(torch.zeros(1, device=device), group=process_groups[name])
    windows = {key: _window(sizes[key], process_groups[key[0]], device) for key in sorted(sizes)}
    for weights, key, offset in places:
        weights.place_unsharded(windows[key], offset)
    return slots


def _ring_units(units: Sequence[ScheduledUnit]) -> list[ScheduledUnit]:
    """The units whose transient weights share the ring, in module order: those other than
    the root that contain no other unit. A unit that contains others is in use while they run,
    however many, so it has a place of its own, as the root has."""
    names = [unit.name for unit in units[1:]]
    return [
        unit
        for unit in units[1:]
        if not any(name.startswith(unit.name + ".") for name in names)
        and any(g.weights.gathers and g.plan.transient_unsharded for g in unit.groups)
    ]


def _window(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """`nbytes` of symmetric memory registered with `group` (collective over it)."""
    from torch.distributed import _symmetric_memory as symm_mem

    if symm_mem.get_backend(device) != "NCCL":
        symm_mem.set_backend("NCCL")
    with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
        window = torch.empty(nbytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(window, group)
    return window
