"""Times all-gather and reduce-scatter with and without NCCL symmetric memory, by message size.

Megatron-FSDP's `use_symm_mem` stages its collectives in persistent symmetric buffers
(`megatron/core/distributed/fsdp/symmetric_memory.py`): the all-gather runs in place in the
symmetric output, then the gathered weights are copied out; the reduce-scatter's input is packed
into the symmetric input first. This tool measures, per message size (bytes of the gathered
tensor, or of the reduce-scatter's input), what each path costs on the GPUs of one host:

- `plain`: the collective between caching-allocator tensors (Megatron-FSDP's default);
- `symm`: the collective in place in registered symmetric memory;
- `symm+copy`: the same plus the copy the engine makes (out of the all-gather, into the
  reduce-scatter), i.e. what `use_symm_mem` costs the engine.

    torchrun --nproc-per-node 2 tools/benchmark_symm_mem.py [--json-out FILE]

Rank 0 prints one row per (collective, size) with the median microseconds of each path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist


def _time(fn, iters: int) -> float:
    """Median microseconds of `fn()` over `iters` runs, each timed by CUDA events."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def _symmetric(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
        tensor = torch.empty(numel, dtype=dtype, device=device)
    symm_mem.rendezvous(tensor, dist.group.WORLD)
    return tensor


def _paths(
    name: str,
    whole: torch.Tensor,
    part: torch.Tensor,
    symmetric: torch.Tensor,
    mine: torch.Tensor,
) -> dict[str, Callable[[], None]]:
    """The three ways to run collective `name` between this rank's `part` and the `whole`:
    plain tensors, in place in `symmetric` (`mine` is this rank's slice of it), and in place
    with the engine's copy into or out of the staging buffer."""
    gathers = name == "all_gather"
    collective = dist.all_gather_into_tensor if gathers else dist.reduce_scatter_tensor
    # Each way's (output, input): the gather writes the whole from the part, the reduce-scatter
    # the part from the whole.
    src, dst = (part, whole) if gathers else (whole, part)
    symm_src, symm_dst = (mine, symmetric) if gathers else (symmetric, mine)

    def staged() -> None:
        symm_src.copy_(src)
        collective(symm_dst, symm_src)
        dst.copy_(symm_dst)

    return {
        "plain": lambda: collective(dst, src),
        "symm": lambda: collective(symm_dst, symm_src),
        "symm+copy": staged,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-kib", type=int, default=64)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    from torch.distributed import _symmetric_memory as symm_mem

    symm_mem.set_backend("NCCL")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    size = args.min_kib * 1024
    while size <= args.max_mib * 2**20:
        for name, dtype in (("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32)):
            numel = size // torch.tensor([], dtype=dtype).element_size()
            numel -= numel % world
            chunk = numel // world
            whole = torch.randn(numel, device=device).to(dtype)
            part = torch.randn(chunk, device=device).to(dtype)
            symmetric = _symmetric(numel, dtype, device)
            mine = symmetric[rank * chunk : (rank + 1) * chunk]
            paths = _paths(name, whole, part, symmetric, mine)
            row = {"collective": name, "bytes": size}
            for label, fn in paths.items():
                row[label] = _time(fn, args.iters)
            rows.append(row)
            del symmetric
        size *= 4
    if rank == 0:
        print(f"{'collective':>15} {'bytes':>11} {'plain us':>9} {'symm us':>9} {'symm+copy':>9}")
        for row in rows:
            print(
                f"{row['collective']:>15} {row['bytes']:>11} {row['plain']:9.1f} "
                f"{row['symm']:9.1f} {row['symm+copy']:9.1f}"
            )
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"world_size": world, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
