"""Measures the bytes of training state each rank holds under Megatron-FSDP, per strategy.

Builds the GPT on the `meta` device (no rank ever holds it whole), wraps it with
`FullyShardedDataParallel`, takes one AdamW step on mock tokens so optimizer state exists, and
reports per rank: main weights, compute-weight shards, gradient buffers, optimizer state, their
sum, and (on GPU) peak allocated memory. Launch one process per rank:

    torchrun --nproc-per-node 4 tools/fsdp_state_bytes.py --bf16

Defaults are the 1.34B benchmark configuration. Runs on CPU (gloo) too with a tiny model:

    torchrun --nproc-per-node 2 tools/fsdp_state_bytes.py --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --vocab-size 128 --seq-length 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_lib.gpt_model import add_model_args, build_gpt

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES
from megatron.core.distributed.fsdp import FullyShardedDataParallel, fully_shard_optimizer
from megatron.core.distributed.fsdp.roots import parameter_groups

GIB = 2**30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, micro_batch_size=1)
    parser.add_argument(
        "--strategies", nargs="+", default=list(SHARDING_STRATEGIES), choices=SHARDING_STRATEGIES
    )
    return parser.parse_args()


def measure(args: argparse.Namespace, strategy: str, device: torch.device) -> dict[str, float]:
    """One rank's state bytes after one step of `strategy`."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with torch.device("meta"):
        config, model = build_gpt(args)
    num_params = sum(p.numel() for p in model.parameters())
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        grad_reduce_in_fp32=True,
    )
    fsdp = FullyShardedDataParallel(config, ddp_config, model)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(fsdp.parameters(), lr=1e-4), fsdp)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length))
    tokens = tokens.to(device)
    fsdp(tokens, labels=tokens).mean().backward()
    fsdp.finish_grad_sync()
    optimizer.step()

    groups = parameter_groups(model)
    optimizer_state = sum(
        t.to_local().nbytes
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, DTensor)
    )
    main = {id(g.weights.sharded_main): g.weights.sharded_main for g in groups}
    # Compute-dtype weights held between steps (ZeRO-3 gathers them from the main weights).
    held = [g.weights.inner_shard or g.weights.unsharded for g in groups]
    model_weights = {id(b): b for b in held if b.is_allocated}
    grads = [g.grads.main_grad for g in groups if g.grads is not None]
    grads += [g.grads.optim_grad for g in groups if g.grads and g.grads.optim_grad is not None]
    result = {
        "num_params": num_params,
        "main_weights_bytes": sum(b.data.nbytes for k, b in main.items() if k not in model_weights),
        "model_weights_bytes": sum(b.data.nbytes for b in model_weights.values()),
        "grad_bytes": sum(b.data.nbytes for b in grads),
        "optimizer_state_bytes": optimizer_state,
    }
    result["total_bytes"] = sum(v for k, v in result.items() if k.endswith("_bytes"))
    if device.type == "cuda":
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    del optimizer, fsdp, model
    return result


def main() -> None:
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = []
    for strategy in args.strategies:
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, measure(args, strategy, device))
        rows.append({"strategy": strategy, "world_size": world_size, "ranks": per_rank})
    if rank == 0:
        full = rows[0]["ranks"][0]["num_params"]
        print(f"{full:,} parameters, {world_size} ranks, bf16={args.bf16}")
        header = f"{'strategy':<20}{'main':>9}{'model':>9}{'grads':>9}{'optim':>9}{'total':>9}"
        print(header + ("  peak (GiB, max over ranks)" if on_gpu else "  (GiB, rank 0)"))
        for row in rows:
            r0 = row["ranks"][0]
            values = [
                r0[k] / GIB
                for k in (
                    "main_weights_bytes",
                    "model_weights_bytes",
                    "grad_bytes",
                    "optimizer_state_bytes",
                    "total_bytes",
                )
            ]
            line = f"{row['strategy']:<20}" + "".join(f"{v:9.3f}" for v in values)
            if on_gpu:
                peak = max(r["peak_allocated_bytes"] for r in row["ranks"]) / GIB
                line += f"{peak:9.3f}"
            print(line)
        print(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
