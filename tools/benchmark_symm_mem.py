"""Times all-gather and reduce-scatter with and without NCCL symmetric memory.

With `use_symm_mem`, Megatron-FSDP's compute weights live in persistent NCCL symmetric windows
(`megatron/core/distributed/fsdp/symmetric_memory.py`) and each unit's tensors are all-gathered
in place there, one grouped call, so NCCL runs its symmetric kernel; gradients are
reduce-scattered from ordinary memory either way. This tool measures, on the GPUs of one host,
what that choice is worth:

- by message size (bytes of the gathered tensor, or of the reduce-scatter's input): one
  collective between caching-allocator tensors (`plain`) and in place in a registered window
  (`symm`);
- for one transformer layer of the GPT its model flags describe (those of
  `tools/benchmark_fsdp.py`; by default the 1.34B GPT's, 12 tensors), laid out and padded as
  Megatron-FSDP lays them out: the grouped all-gather of its bf16 weights into ordinary memory
  (the default) and into one window (`use_symm_mem`), and the grouped reduce-scatter of its
  fp32 gradients from each (the engine's is from ordinary memory).

    torchrun --nproc-per-node 2 tools/benchmark_symm_mem.py [--json-out FILE]

Rank 0 prints the median GPU microseconds of each (CUDA events) and, for the layer, the NCCL
kernels that ran in the window (`Symk` names the symmetric ones).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_collective_host import layer_shapes
from benchmark_lib.gpt_model import add_model_args

from megatron.core.distributed.fsdp.collectives import (
    _all_gather_coalesced,
    _reduce_scatter_coalesced,
)
from megatron.core.distributed.fsdp.dbuffer import ShardLayout
from megatron.training.initialize import default_rendezvous


def _time(fn: Callable[[], object], iters: int) -> float:
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


def _nccl_kernels(fn: Callable[[], object]) -> list[str]:
    """The names of the NCCL kernels one call of `fn` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if "nccl" in e.name.lower()})


def _empty(numel: int, dtype: torch.dtype, *, symmetric: bool) -> torch.Tensor:
    """`numel` uninitialised elements, from the caching allocator or a registered window."""
    if not symmetric:
        return torch.empty(numel, dtype=dtype, device="cuda")
    from torch.distributed import _symmetric_memory as symm_mem

    with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(torch.cuda.current_device())):
        tensor = torch.empty(numel, dtype=dtype, device="cuda")
    symm_mem.rendezvous(tensor, dist.group.WORLD)
    return tensor


def _reduce_scatter(numels: list[int], symmetric: bool) -> Callable[[], None]:
    """A grouped reduce-scatter of fp32 tensors of `numels` elements (laid out back to back)
    into this rank's share of each: in a window if `symmetric`, in place (each output is this
    rank's block of its input, so both lie in the window, as the symmetric kernels need)."""
    group = dist.group.WORLD
    whole = _empty(sum(numels), torch.float32, symmetric=symmetric).normal_()
    inputs = list(whole.split(numels))
    if symmetric:
        outputs = [tensor.view(group.size(), -1)[group.rank()] for tensor in inputs]
    else:
        outputs = [torch.empty(n // group.size(), device="cuda") for n in numels]
    total = dist.ReduceOp.SUM
    return lambda: _reduce_scatter_coalesced(outputs, inputs, op=total, group=group)


def _grouped_gather(shapes: list[torch.Size], symmetric: bool) -> Callable[[], None]:
    """The grouped all-gather of bf16 tensors of `shapes` into one buffer (a layer's weights,
    or one tensor), each padded to N chunks and gathered in place, as `GroupWeights` does."""
    group = dist.group.WORLD
    n, rank = group.size(), group.rank()
    layout = ShardLayout(shapes, n)
    whole = _empty(layout.numel, torch.bfloat16, symmetric=symmetric)
    outputs = list(whole.split([chunk * n for chunk in layout.chunk_numels]))
    own = [output.view(n, -1)[rank] for output in outputs]
    return lambda: _all_gather_coalesced(outputs, own, group=group)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--min-kib", type=int, default=64)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times NCCL collectives: run it on GPUs.")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl", device_id=torch.device("cuda", local_rank), **default_rendezvous()
    )
    from torch.distributed import _symmetric_memory as symm_mem

    symm_mem.set_backend("NCCL")
    world = dist.get_world_size()
    rows = []
    size = args.min_kib * 1024
    while size <= args.max_mib * 2**20:
        for name, dtype in (("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32)):
            numel = size // dtype.itemsize // world * world
            row = {"collective": name, "bytes": size}
            for label, symmetric in (("plain", False), ("symm", True)):
                if name == "all_gather":
                    fn = _grouped_gather([torch.Size([numel])], symmetric)
                else:
                    fn = _reduce_scatter([numel], symmetric)
                row[label] = _time(fn, args.iters)
            rows.append(row)
        size *= 4
    shapes = layer_shapes(args)
    layout = ShardLayout(shapes, world)
    padded = [chunk * world for chunk in layout.chunk_numels]
    layer = {}
    for label, symmetric in (("plain", False), ("symm", True)):
        gather = _grouped_gather(shapes, symmetric)
        scatter = _reduce_scatter(padded, symmetric)
        layer[label] = {
            "all_gather_us": _time(gather, args.iters),
            "reduce_scatter_us": _time(scatter, args.iters),
            "all_gather_kernels": _nccl_kernels(gather),
            "reduce_scatter_kernels": _nccl_kernels(scatter),
        }
    if dist.get_rank() == 0:
        print(f"{'collective':>15} {'bytes':>11} {'plain us':>9} {'symm us':>9}")
        for row in rows:
            print(
                f"{row['collective']:>15} {row['bytes']:>11} {row['plain']:9.1f} {row['symm']:9.1f}"
            )
        mib = layout.numel * 2 / 2**20
        print(f"one layer of hidden {args.hidden_size}, {len(shapes)} tensors, {mib:.1f} MiB:")
        for label, result in layer.items():
            print(
                f"  {label:5s} grouped all-gather {result['all_gather_us']:8.1f} us "
                f"{result['all_gather_kernels']}"
            )
            print(
                f"  {label:5s} fp32 reduce-scatter {result['reduce_scatter_us']:7.1f} us "
                f"{result['reduce_scatter_kernels']}"
            )
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"world_size": world, "rows": rows, "layer": layer}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
