"""The fused rotary embedding's two kernels on one GPU: the C++ node's CUDA kernel against the
Triton kernel, GPU time alone.

A layer's rotation (`megatron.core.fusions.fused_rope.fused_rotary_pos_emb`: its queries and keys,
forward and backward) runs 20 times inside one CUDA graph, so the host's launches leave no gaps
between the kernels; the graph is replayed 10 times and the GPU time per rotation is the
replays' elapsed time over the 200 rotations. The queries and keys are views of one QKV tensor,
as the attention's are. The extension (`megatron.core.fusions.native_rope`) is built at the
first call.

    python tools/benchmark_rope_kernels.py [--shapes 2048x2x16x128,4096x1x32x128]

Prints per shape (positions x batch x heads x head width; the keys have as many heads as the
queries) the µs per rotation, forward and backward, of each kernel, and the largest difference
between their results (outputs and input gradients) in units in the last place of bf16 at the
tensor's largest magnitude. The kernels round their fp32 multiply-adds in different orders, so
results can differ in the last place; where a rotation nearly cancels, a difference of one fp32
rounding is many units of the small result's own last place, but stays below this one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

import torch

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_lib.shapes import parse_shapes  # noqa: E402

from megatron.core.fusions import fused_rope  # noqa: E402
from megatron.core.fusions.native_rope import native_rope, triton_kernel  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import (  # noqa: E402
    RotaryEmbedding,
    _rotation_tables,
)

# The 1.34B model at S and L (16 heads of 128), Llama-3 8B's queries (32 heads) and keys (8).
DEFAULT_SHAPES = "1024x1x16x128,2048x2x16x128,4096x1x32x128,4096x1x8x128"
ROTATIONS_PER_GRAPH = 20
REPLAYS = 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help="comma-separated SEQxBATCHxHEADSxHEAD_WIDTH"
    )
    args = parser.parse_args(argv)
    args.shapes = parse_shapes(
        parser, "--shapes", args.shapes, "SEQxBATCHxHEADSxHEAD_WIDTH", "2048x2x16x128"
    )
    if any(shape[3] % 2 for shape in args.shapes):
        parser.error("--shapes: each shape's head width is even.")
    return args


def graphed_us(rotate: Callable[[], object]) -> float:
    """GPU µs per call of `rotate`, from replays of a CUDA graph of `ROTATIONS_PER_GRAPH` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton's compilation) outside the capture
        for _ in range(3):
            rotate()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ROTATIONS_PER_GRAPH):
            rotate()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (REPLAYS * ROTATIONS_PER_GRAPH) * 1e3


def compare(shape: tuple[int, int, int, int]) -> tuple[float, float, float]:
    """µs per rotation (forward and backward) of the C++ node's kernel and of the Triton kernel,
    and the largest difference of their outputs and input gradients in bf16 ulps."""
    seq, batch, heads, dim = shape
    cos, sin = _rotation_tables(RotaryEmbedding(dim)(seq).cuda(), torch.float32, False)
    qkv = torch.randn(seq, batch, 3 * heads, dim, device="cuda", dtype=torch.bfloat16)
    query, key = qkv[:, :, :heads], qkv[:, :, heads : 2 * heads]
    grads = [torch.randn(seq, batch, heads, dim, device="cuda", dtype=torch.bfloat16)] * 2
    results = {}

    def rotate(kernel: Callable[[], contextlib.AbstractContextManager]) -> list[torch.Tensor]:
        q, k = query.detach().requires_grad_(), key.detach().requires_grad_()
        with kernel():
            outputs = fused_rope.fused_rotary_pos_emb(q, k, cos, sin, False)
        torch.autograd.backward(outputs, grads)
        return [*outputs, q.grad, k.grad]

    times = []
    for name, kernel in (("cpp", contextlib.nullcontext), ("triton", triton_kernel)):
        times.append(graphed_us(lambda kernel=kernel: rotate(kernel)))
        results[name] = rotate(kernel)
    ulps = max(
        ((a.float() - b.float()).abs().max() / _bf16_ulp(b.float().abs().max())).item()
        for a, b in zip(results["cpp"], results["triton"])
    )
    return times[0], times[1], ulps


def _bf16_ulp(magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at `magnitude` (8 significand bits)."""
    return torch.exp2(torch.floor(torch.log2(magnitude)) - 7)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() or fused_rope.triton is None:
        sys.exit("benchmark_rope_kernels.py compares GPU kernels: it needs CUDA and Triton.")
    if native_rope(torch.empty(1, device="cuda")) is None:
        sys.exit("The rotary C++ extension is not in use here (see the warning above, or unset "
                 "MEGATRON_ROPE_CPP).")  # fmt: skip
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per rotation, fwd+bwd")
    print(f"{'shape':>18} {'C++':>8} {'Triton':>8} {'C++/Triton':>10} {'max ulps':>8}")
    for shape in args.shapes:
        ours, triton, ulps = compare(shape)
        name = "x".join(map(str, shape))
        print(f"{name:>18} {ours:8.1f} {triton:8.1f} {ours / triton:10.2f} {ulps:8.1f}")


if __name__ == "__main__":
    main()
