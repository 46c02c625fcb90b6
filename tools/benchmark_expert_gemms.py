"""Times an MoE layer's FP8 expert GEMMs by each kernel that runs them, on one GPU.

An FP8 expert projection (`megatron.core.fp8.experts`) runs three GEMMs over all its experts'
rows: the forward `X_e W_e^T`, the input gradient `dY_e W_e` and the weight gradient
`dY_e^T X_e` (here added to an fp32 `main_grad`, as the engines fuse it). Each can run one
`torch._scaled_mm` per expert, as PyTorch's grouped `torch._scaled_grouped_mm` (E4M3 operands
and a bf16 output only), or as this package's Triton grouped GEMMs
(`megatron.core.fp8.expert_gemm_kernels`). For the two projections of a SwiGLU expert (fc1
`[2F, H]`, fc2 `[H, F]`) and tokens routed uniformly at random (top-k of the experts), this
prints for each GEMM and kernel:

- GPU ms: the kernels' time on the GPU (the profiler's sum of their durations), median of
  `--repeats` calls;
- host us: the call's time on the host, which launches its kernels without waiting for them,
  median of `--repeats` calls after a synchronisation each;
- TFLOP/s: the real rows' FLOPs (not the padding's) over the GPU time.

A step is bound by the larger of its host and GPU times: the per-expert loop's host time grows
with the number of experts, a grouped kernel's does not.

    python tools/benchmark_expert_gemms.py [--num-experts 64] [--hidden-size 2048]
        [--moe-ffn-hidden-size 1408] [--tokens 4096] [--topk 6] [--format hybrid]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.fp8 import expert_gemm_kernels, grouped_gemm
from megatron.core.fp8.experts import ExpertGemm, _expert_mm, _fp8_wgrad
from megatron.core.fp8.grouped_gemm import ExpertRows
from megatron.core.fp8.grouped_quantize import quantize_experts
from megatron.core.fp8.weights import Fp8ExpertWeights
from megatron.core.tensor_parallel.grad_accumulation import FusionTarget

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _gpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """The median over `repeats` calls of the GPU time of the kernels one call launches."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        times.append(sum(e.device_time for e in kernels) / 1e3)
    return statistics.median(times)


def _host_us(fn: Callable[[], object], repeats: int) -> float:
    """The median over `repeats` calls of the host time of one call (the GPU idle at each)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def routed_counts(experts: int, tokens: int, topk: int, seed: int) -> list[int]:
    """Rows per expert when each token picks `topk` distinct experts uniformly at random."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.rand(tokens, experts, generator=generator).topk(topk, dim=1).indices
    return torch.bincount(picks.flatten(), minlength=experts).tolist()


def measure_projection(
    counts: list[int],
    out_features: int,
    in_features: int,
    backward_dtype: torch.dtype,
    repeats: int,
) -> list[tuple[str, str, float, float, float]]:
    """(GEMM, kernel, GPU ms, host us, TFLOP/s) of each GEMM of one projection by each kernel
    that runs it here."""
    device = torch.device("cuda")
    rows = ExpertRows(counts)
    x = torch.randn(rows.rows, in_features, device=device, dtype=torch.bfloat16)
    dy = torch.randn(rows.rows, out_features, device=device, dtype=torch.bfloat16)
    inputs = quantize_experts(x, rows, E4M3, transpose=True)
    grads = quantize_experts(dy, rows, backward_dtype, transpose=True)
    weight = torch.randn(len(counts), out_features, in_features, device=device)
    weights = Fp8ExpertWeights.quantized(weight.to(torch.bfloat16))
    target = FusionTarget(torch.zeros_like(weight), overwrite=False)
    flops = 2.0 * rows.rows * out_features * in_features

    torch_grouped = grouped_gemm.grouped_kernel_available(device)
    kernels = [ExpertGemm.PER_EXPERT]
    if expert_gemm_kernels.kernels_available(device):
        kernels.append(ExpertGemm.TRITON)
    results = []
    for name, applies_to_torch in (
        ("forward", torch_grouped),
        ("input gradient", torch_grouped and backward_dtype == E4M3),
        ("weight gradient", False),
    ):
        candidates = kernels + ([ExpertGemm.SCALED_GROUPED_MM] if applies_to_torch else [])
        for kernel in candidates:
            if name == "weight gradient":

                def call(kernel=kernel):
                    _fp8_wgrad(grads, inputs, weight, target, kernel)

            else:
                forward = name == "forward"
                cast = inputs if forward else grads

                def call(kernel=kernel, cast=cast, forward=forward):
                    _expert_mm(
                        cast,
                        weights,
                        kernel=kernel,
                        dgrad=not forward,
                        out_dtype=torch.bfloat16,
                        fast_accum=forward,
                    )

            for _ in range(3):  # compilation, cuBLASLt's heuristics, the weights' transposes
                call()
            gpu = _gpu_ms(call, repeats)
            host = _host_us(call, repeats)
            results.append((name, kernel.value, gpu, host, flops / gpu / 1e9))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=1408)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--format", choices=("hybrid", "e4m3"), default="hybrid")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("num_experts", "tokens", "topk", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("hidden_size", "moe_ffn_hidden_size"):
        if getattr(args, name) < 16 or getattr(args, name) % 16:
            parser.error(f"--{name.replace('_', '-')} must be a positive multiple of 16 (FP8)")
    if args.topk > args.num_experts:
        parser.error(f"--topk {args.topk} exceeds --num-experts {args.num_experts}")
    if not torch.cuda.is_available():
        parser.error("it times GPU kernels: run it on a GPU")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    counts = routed_counts(args.num_experts, args.tokens, args.topk, args.seed)
    hidden, ffn = args.hidden_size, args.moe_ffn_hidden_size
    backward_dtype = E5M2 if args.format == "hybrid" else E4M3
    print(
        f"{args.num_experts} experts, {args.tokens} tokens top-{args.topk} ({min(counts)}-"
        f"{max(counts)} rows per expert), hidden {hidden}, expert FFN {ffn}, {args.format}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    print(f"{'projection':<12}{'GEMM':<17}{'kernel':<34}{'GPU ms':>8}{'host us':>9}{'TFLOP/s':>9}")
    for projection, shape in (("fc1", (2 * ffn, hidden)), ("fc2", (hidden, ffn))):
        for gemm, kernel, gpu, host, tflops in measure_projection(
            counts, *shape, backward_dtype, args.repeats
        ):
            print(f"{projection:<12}{gemm:<17}{kernel:<34}{gpu:>8.3f}{host:>9.0f}{tflops:>9.0f}")


if __name__ == "__main__":
    main()
