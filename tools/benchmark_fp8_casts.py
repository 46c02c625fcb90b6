"""The FP8 casts of the linear layers' C++ path against the Triton kernels, on one GPU.

Each cast turns a bf16 activation or gradient into E4M3 bytes with the transposed copy the weight
gradient needs: under delayed scaling in one pass with the amax recorded, under current scaling
(`tensorwise`) after an amax pass. The extension's kernel (`megatron/core/fp8/csrc/`, built at
the first call) and the Triton kernel (`megatron.core.fp8.kernels`) each run 40 times back to
back; the GPU time per cast is the elapsed time of the 40 over 40, so where a kernel is shorter
than its launch it is the host's time.

Then the weights' kernels of `--fp8-param-gather`: each weight's transposed copy (made at its
unit's first backward need) by the extension, by the Triton kernel and, for the bandwidth a copy
of the same bytes reaches, by `clone`; and the refresh's cast of `--weight-layers` layers' fp32
main weights into E4M3 (rounded to bf16 first) in one `MultiTensorCast` launch.

    python tools/benchmark_fp8_casts.py [--shapes 4096x2048,4096x28672] [--weights 4096x4096]

Prints per shape and scaling the µs per cast of each and the extension's bandwidth (the input
read, the bytes and the transposed copy written; current scaling reads the input twice); per
weight shape the µs per transpose of each and the extension's bandwidth (1 byte per element read
and 1 written); and the refresh cast's µs and bandwidth (4 bytes per element read, 1 written).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable

import torch

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_lib.shapes import parse_shapes  # noqa: E402

from megatron.core.fp8 import cpp_linear, kernels  # noqa: E402
from megatron.core.fp8.multi_tensor_cast import MultiTensorCast  # noqa: E402

# Llama-3 8B's activations at 4096 tokens (hidden, qkv, fc2 input, fc1 output) and smaller ones.
DEFAULT_SHAPES = "4096x2048,4096x4096,4096x6144,4096x14336,4096x28672,4100x1408"
# A Llama-3 8B layer's FP8 weights: qkv, the attention's projection, fc1 (SwiGLU's two), fc2.
DEFAULT_WEIGHTS = "6144x4096,4096x4096,28672x4096,4096x14336"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated ROWSxCOLS")
    parser.add_argument(
        "--weights", default=DEFAULT_WEIGHTS, help="weight shapes, comma-separated ROWSxCOLS"
    )
    parser.add_argument(
        "--weight-layers",
        type=int,
        default=8,
        help="copies of --weights the refresh's cast takes in one launch (layers)",
    )
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args(argv)
    args.shapes = parse_shapes(parser, "--shapes", args.shapes, "ROWSxCOLS", "4096x4096")
    args.weights = parse_shapes(parser, "--weights", args.weights, "ROWSxCOLS", "4096x4096")
    if args.weight_layers < 1:
        parser.error(f"--weight-layers must be >= 1, got {args.weight_layers}.")
    return args


def gpu_us(cast: Callable[[], object], iters: int) -> float:
    for _ in range(5):
        cast()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        cast()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def cast_times(native, x: torch.Tensor, delayed: bool, iters: int) -> tuple[float, float]:
    """µs per cast of `x` by the extension and by the Triton kernel."""
    scale = torch.tensor(3.0, device="cuda") if delayed else None
    record = torch.zeros((), device="cuda") if delayed else None
    ours = gpu_us(lambda: native.cast(x, scale, record, True), iters)
    triton = gpu_us(
        lambda: kernels.cast_to_fp8(x, torch.float8_e4m3fn, scale, record, transpose=True), iters
    )
    return ours, triton


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() or kernels.triton is None:
        sys.exit("benchmark_fp8_casts.py compares GPU kernels: it needs CUDA and Triton.")
    native = cpp_linear.native_linear(torch.zeros(1, 16, device="cuda"))
    if native is None:
        sys.exit("The FP8 C++ extension did not build here (see the warning above).")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per cast")
    print(f"{'shape':>14} {'scaling':>8} {'C++':>8} {'Triton':>8} {'C++ GB/s':>9}")
    for rows, cols in args.shapes:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        for scaling in ("delayed", "current"):
            ours, triton = cast_times(native, x, scaling == "delayed", args.iters)
            # Read 2 bytes and write 2 per element, and read them again for current's amax.
            moved = x.numel() * (4 if scaling == "delayed" else 6)
            print(
                f"{f'{rows}x{cols}':>14} {scaling:>8} {ours:8.1f} {triton:8.1f} "
                f"{moved / ours / 1e3:9.0f}"
            )
    print("µs per weight transpose")
    print(f"{'shape':>14} {'C++':>8} {'Triton':>8} {'clone':>8} {'C++ GB/s':>9}")
    for rows, cols in args.weights:
        w = torch.randn(rows, cols, device="cuda").to(torch.float8_e4m3fn)
        ours = gpu_us(functools.partial(native.transpose, w), args.iters)
        triton = gpu_us(functools.partial(kernels.transpose_fp8, w), args.iters)
        copy = gpu_us(w.clone, args.iters)
        print(
            f"{f'{rows}x{cols}':>14} {ours:8.1f} {triton:8.1f} {copy:8.1f} "
            f"{2 * w.numel() / ours / 1e3:9.0f}"
        )
    refresh_cast(args.weights * args.weight_layers, args.iters)


def refresh_cast(shapes: list[tuple[int, int]], iters: int) -> None:
    """Times the cast of fp32 weights of `shapes` into E4M3, rounded to bf16 first, in one
    launch (`MultiTensorCast`), as the refresh of `--fp8-param-gather` casts them."""
    sources = [torch.randn(shape, device="cuda") for shape in shapes]
    targets = [torch.empty(shape, device="cuda", dtype=torch.float8_e4m3fn) for shape in shapes]
    cast = MultiTensorCast.make(sources, targets, list(range(len(shapes))), torch.bfloat16)
    if cast is None:
        sys.exit("MultiTensorCast does not take these weights here (see its module docstring).")
    scales = torch.rand(len(shapes), device="cuda") * 100
    elements = sum(source.numel() for source in sources)
    us = gpu_us(lambda: cast(scales), max(1, iters // 8))
    print(
        f"refresh cast of {len(shapes)} fp32 weights ({elements * 5 / 1e9:.2f} GB moved), one "
        f"launch: {us:.1f} µs, {elements * 5 / us / 1e3:.0f} GB/s"
    )


if __name__ == "__main__":
    main()
