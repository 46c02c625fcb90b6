"""Sliding-window attention and softmax sinks against full causal attention, on one GPU.

The core attention of one transformer layer (`DotProductAttention`, this rank's heads of a
gpt-oss-shaped layer by default: 64 query heads in 8 key/value groups of width 64) at
`--seq-length` (8192), forward and forward + backward in bf16, for:

- `causal`: full causal attention with the plain softmax, the `auto` backend's SDPA kernel
  (FlashAttention on H100/H200): the baseline;
- `causal flex`: the same attention by FlexAttention (`flex_attention_with_sinks` on a causal
  block mask), the kernel the next rows run;
- `causal + sinks`: full causal attention with learnable sinks (FlexAttention);
- `window`: a sliding window of `--window` positions, the query's own included (`--window-size
  W-1,0`; FlexAttention, block-sparse);
- `window + sinks`: gpt-oss's windowed layer.

Prints per row the median milliseconds of the forward and of forward + backward, the peak memory
the step allocates above its inputs, and the forward + backward speed-up over `causal`. The
first calls of each FlexAttention shape compile its kernel; the warm-up iterations absorb them.

    python tools/benchmark_attention.py [--seq-length 8192] [--window 128]
        [--micro-batch-size 1] [--num-attention-heads 64] [--num-query-groups 8]
        [--kv-channels 64] [--repeats 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.flex_attention import flex_attention_with_sinks, window_block_mask
from megatron.core.transformer.transformer_config import TransformerConfig

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """The median of `repeats` timings of `fn` on the GPU, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def core_attention(args: argparse.Namespace, window: int | None, sinks: bool) -> Attention:
    """The layer's `DotProductAttention` on the GPU in bf16, taking [b, s, n, d] tensors."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.num_attention_heads * args.kv_channels,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        attention_dropout=0.0,
        window_size=None if window is None else (window - 1, 0),
        softmax_type="learnable" if sinks else "vanilla",
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    attention = DotProductAttention(config).cuda()
    return lambda q, k, v: attention(*(t.transpose(0, 1) for t in (q, k, v)))


def flex_causal(args: argparse.Namespace) -> Attention:
    """FlexAttention's causal kernel without sinks, taking [b, s, n, d] tensors."""
    mask = window_block_mask(args.seq_length, None, torch.device("cuda"), None)
    return lambda q, k, v: flex_attention_with_sinks(
        *(t.transpose(1, 2) for t in (q, k, v)), mask, None, None
    )


def measure(attention: Attention, args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds of the forward and of forward + backward, and the peak memory (GiB) a
    forward + backward allocates above its inputs."""
    heads, groups, width = args.num_attention_heads, args.num_query_groups, args.kv_channels
    shape = (args.micro_batch_size, args.seq_length)
    options = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    query = torch.randn(*shape, heads, width, **options)
    key, value = (torch.randn(*shape, groups, width, **options) for _ in range(2))
    grad = torch.randn_like(attention(query, key, value))

    def step() -> None:
        torch.autograd.grad(attention(query, key, value), (query, key, value), grad)

    with torch.no_grad():
        forward = _median_ms(lambda: attention(query, key, value), args.repeats)
    both = _median_ms(step, args.repeats)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {"forward_ms": forward, "forward_backward_ms": both, "peak_gib": peak}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--window", type=int, default=128, help="Positions a query sees.")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--num-attention-heads", type=int, default=64)
    parser.add_argument("--num-query-groups", type=int, default=8)
    parser.add_argument("--kv-channels", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="Also write the rows to this file.")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_attention.py times CUDA kernels: it needs a GPU.")

    cases = {
        "causal": core_attention(args, None, sinks=False),
        "causal flex": flex_causal(args),
        "causal + sinks": core_attention(args, None, sinks=True),
        "window": core_attention(args, args.window, sinks=False),
        "window + sinks": core_attention(args, args.window, sinks=True),
    }
    rows = [{"case": name, **measure(attention, args)} for name, attention in cases.items()]
    baseline = rows[0]["forward_backward_ms"]
    print(
        f"{torch.cuda.get_device_name()}: seq {args.seq_length}, batch {args.micro_batch_size}, "
        f"{args.num_attention_heads} heads / {args.num_query_groups} groups x "
        f"{args.kv_channels}, window {args.window}, bf16"
    )
    print(f"{'case':<16}{'fwd ms':>10}{'fwd+bwd ms':>12}{'peak GiB':>10}{'speed-up':>10}")
    for row in rows:
        row["speedup"] = baseline / row["forward_backward_ms"]
        print(
            f"{row['case']:<16}{row['forward_ms']:>10.3f}{row['forward_backward_ms']:>12.3f}"
            f"{row['peak_gib']:>10.3f}{row['speedup']:>9.2f}x"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "rows": rows}, file, indent=2)
    return rows


if __name__ == "__main__":
    main()
