"""Host and GPU time of the ways to all-gather and reduce-scatter one transformer layer's weights.

Megatron-FSDP gathers each tensor of a unit straight into the tensor the layer computes with, and
reduce-scatters each gradient straight out of its whole tensor (cast tensor by tensor into a send
buffer where the reduction dtype differs): one grouped NCCL call each per unit, with no packing or
unpacking kernel. A flat collective (one buffer for the whole unit, as FSDP2 issues) costs one
NCCL call but needs the shard-major layout: a copy out of the gathered buffer, and gradients
packed into it (several ways of packing are timed). Where the step is bound by the host, the host
time of each matters; where it is bound by the GPU, the GPU time. This tool times both for the
first transformer layer of the GPT its model flags describe (those of `tools/benchmark_fsdp.py`;
by default the 1.34B GPT, whose layer holds 12 tensors), bf16 weights, gradients reduced in
fp32, laid out and padded as Megatron-FSDP lays them out (`ShardLayout`):

    torchrun --nproc-per-node N tools/benchmark_collective_host.py [--hidden-size 2048]

Rank 0 prints, per operation, the host microseconds per call (the least of 5 rounds of
`--calls` calls, queued back to back) and the GPU microseconds per call (CUDA events over one
round). One rank (N = 1) runs NCCL's single-rank path: the host cost of issuing is what it
measures there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_lib.gpt_model import add_model_args, build_gpt

from megatron.core.distributed.fsdp.collectives import (
    _all_gather_coalesced,
    _reduce_scatter_coalesced,
    _reduce_scatter_single,
)
from megatron.core.distributed.fsdp.dbuffer import ShardLayout
from megatron.training.initialize import default_rendezvous


def layer_shapes(args: argparse.Namespace) -> list[torch.Size]:
    """The shapes of the first transformer layer's parameters, in module order."""
    with torch.device("meta"):
        _, model = build_gpt(args)
    return [param.shape for param in model.decoder.layers[0].parameters()]


def operations(shapes: list[torch.Size], group: dist.ProcessGroup) -> dict[str, Callable[[], None]]:
    """Each way to move one layer's tensors, as a function that issues it once."""
    n, rank = group.size(), group.rank()
    layout = ShardLayout(shapes, n)
    chunks, shard = layout.chunk_numels, layout.shard_numel
    numels = [chunk * n for chunk in chunks]  # each tensor padded to N full chunks

    def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="cuda")

    # All-gather: each tensor's chunk from the fp32 main shard into its bf16 compute tensor.
    main = empty(shard, torch.float32)
    main_chunks = list(main.split(chunks))
    whole = [empty(numel, torch.bfloat16) for numel in numels]
    own = [tensor.view(n, -1)[rank] for tensor in whole]
    gathered = empty(n * shard, torch.bfloat16)
    own_shard = gathered.view(n, shard)[rank]
    targets = [tensor.view(n, chunk) for tensor, chunk in zip(whole, chunks)]
    # Reduce-scatter: bf16 gradients, reduced in fp32 into the main gradient shard.
    grads = [torch.randn(numel, dtype=torch.bfloat16, device="cuda") for numel in numels]
    cast = [empty(numel, torch.float32) for numel in numels]
    packed = empty(n * shard, torch.float32)
    rows = packed.view(n, shard)
    blocks = [rows[r, o : o + c] for o, c in zip(layout.offsets, chunks) for r in range(n)]
    columns = [rows[:, o : o + c] for o, c in zip(layout.offsets, chunks)]
    main_grad = empty(shard, torch.float32)
    main_grad_chunks = list(main_grad.split(chunks))
    total = dist.ReduceOp.SUM
    count = f"{len(shapes)} tensors"
    largest = slice(i := numels.index(max(numels)), i + 1)

    def by_rank() -> list[torch.Tensor]:
        return [g.view(n, c) for g, c in zip(grads, chunks)]

    def pack_blocks() -> None:
        sources = [b for g, c in zip(grads, chunks) for b in g.view(n, c).unbind(0)]
        torch._foreach_copy_(blocks, sources)

    return {
        "cast main chunks into own blocks (foreach)": lambda: torch._foreach_copy_(
            own, main_chunks
        ),
        f"grouped all-gather, {count}": lambda: _all_gather_coalesced(whole, own, group=group),
        "grouped all-gather, the largest tensor": lambda: _all_gather_coalesced(
            whole[largest], own[largest], group=group
        ),
        "cast main shard into own shard (copy_)": lambda: own_shard.copy_(main),
        "flat all-gather": lambda: _all_gather_coalesced([gathered], [own_shard], group=group),
        "copy out of the flat buffer (split_with_sizes_copy)": lambda: torch.split_with_sizes_copy(
            gathered.view(n, shard), chunks, dim=1, out=targets
        ),
        "cast gradients, tensor-major (foreach)": lambda: torch._foreach_copy_(cast, grads),
        f"grouped reduce-scatter, {count}": lambda: _reduce_scatter_coalesced(
            main_grad_chunks, cast, op=total, group=group
        ),
        "cast and pack gradients (_chunk_cat)": lambda: torch._chunk_cat(
            grads, dim=0, num_chunks=n, out=rows
        ),
        "cast and pack gradients (foreach of blocks)": pack_blocks,
        "cast and pack gradients (foreach of [N, chunk] columns)": lambda: torch._foreach_copy_(
            columns, by_rank()
        ),
        "cast and pack gradients (cat of [N, chunk] views)": lambda: torch.cat(
            by_rank(), dim=1, out=rows
        ),
        "flat reduce-scatter": lambda: _reduce_scatter_single(
            main_grad, packed, op=total, group=group
        ),
    }


def time_host_and_gpu(fn: Callable[[], None], calls: int) -> tuple[float, float]:
    """Host microseconds per call (least of 5 rounds) and GPU microseconds per call."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return min(host), begin.elapsed_time(end) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--calls", type=int, default=100, help="calls per timed round")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        parser.error("it times NCCL collectives: run it on GPUs.")
    if args.calls < 1:
        parser.error("--calls must be >= 1.")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl", device_id=torch.device("cuda", local_rank), **default_rendezvous()
    )
    group = dist.group.WORLD
    rows = [
        (name, *time_host_and_gpu(fn, args.calls))
        for name, fn in operations(layer_shapes(args), group).items()
    ]
    if dist.get_rank() == 0:
        print(f"one layer of hidden {args.hidden_size}, {world} rank(s): host / GPU us per call")
        for name, host, gpu in rows:
            print(f"  {name:56s} {host:8.1f} {gpu:8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
