"""Times one GPT training step (forward, backward, AdamW) on a single device, no parallelism.

The compute-only reference the sharded engines are compared against:

    python tools/benchmark_gpt_step.py --hidden-size 2048 --num-layers 24 \
        --num-attention-heads 16 --seq-length 2048 --micro-batch-size 2 --bf16

Prints step time, tokens/s, model TFLOP/s (Megatron-LM's FLOP count) and peak memory, then the
same as one JSON line. Runs on CPU too (use a tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_lib.gpt_model import add_model_args, build_gpt

from megatron.training.flops import num_floating_point_operations


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:
        config, model = build_gpt(args)
    # fused=True is the fast CUDA path; the CPU build has no fused AdamW for bf16.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    shape = (args.micro_batch_size, args.seq_length)
    tokens = torch.randint(0, args.vocab_size, shape, device=device)
    labels = torch.randint(0, args.vocab_size, shape, device=device)

    step_times = []
    for step in range(args.warmup_steps + args.steps):
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(tokens, labels=labels).mean().backward()
        optimizer.step()
        synchronize(device)
        if step >= args.warmup_steps:
            step_times.append(time.perf_counter() - start)

    step_s = statistics.median(step_times)
    tokens_per_step = args.micro_batch_size * args.seq_length
    flops = num_floating_point_operations(
        config, args.vocab_size, args.seq_length, args.micro_batch_size
    )
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": sum(p.numel() for p in model.parameters()),
        "step_ms": step_s * 1000,
        "tokens_per_s": tokens_per_step / step_s,
        "tflops_per_s": flops / step_s / 1e12,
        "peak_gib": (
            torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        ),
    }
    print(
        f"{result['device']}: {result['params'] / 1e9:.2f}B params, step "
        f"{result['step_ms']:.1f} ms (median of {args.steps}), "
        f"{result['tokens_per_s']:,.0f} tokens/s, {result['tflops_per_s']:.1f} TFLOP/s"
        + (f", peak {result['peak_gib']:.1f} GiB" if result["peak_gib"] is not None else "")
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
