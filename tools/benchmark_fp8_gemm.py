"""What FP8 saves per linear layer, and what its casts cost, on one GPU.

For each GEMM of a transformer layer (QKV, attention output, fc1, fc2; Llama-3 8B's shapes by
default) at a number of tokens, the three GEMMs of a linear layer (forward `X W^T`, input
gradient `dY W`, weight gradient `dY^T X`) in bf16 against FP8 (`torch._scaled_mm`, E4M3
forward and E5M2 output gradients: the `hybrid` format), and the casts FP8 adds: the input to
FP8 with its transposed copy (forward, for the weight gradient) and the output gradient
likewise (backward), by the fused CUDA kernels (`megatron.core.fp8.kernels`) and by plain torch
ops. The weights' casts happen once per optimizer step, not per GEMM, and are left out.

`--recipe blockwise` measures the blockwise recipe instead (`megatron.core.fp8.blockwise`): E4M3
throughout, 1x128 scales for the input and output gradient, 128x128 for the weight, the GEMMs
`torch.nn.functional.scaled_mm`'s blockwise ones (compute capability 9.0, sizes in multiples of
128), the casts the one-pass kernels of `block_kernels.py` (each block's scale from its own
values: no delayed variant) against the torch ops the CPU runs.

    python tools/benchmark_fp8_gemm.py [--recipe tensorwise|blockwise] [--tokens 4096]
        [--hidden-size 4096] [--ffn-hidden-size 14336] [--num-query-groups 8]
        [--kv-channels 128] [--num-attention-heads 32] [--json F]

Prints one row per layer GEMM: milliseconds of the three bf16 GEMMs, of the three FP8 GEMMs, of
the fused casts (current scaling: two passes; delayed scaling: one; blockwise: one) and of the
torch-op casts, and the speed-up of FP8 with each kind of cast.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from collections.abc import Callable

import torch

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.fp8 import block_kernels, blockwise, kernels
from megatron.core.fp8.gemm import fp8_mm
from megatron.core.fp8.weights import Fp8Weight

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _time_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 5) -> float:
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


def _torch_cast(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain torch-op cast with current scaling, and its transposed copy."""
    limit = torch.finfo(dtype).max
    scale = limit / x.abs().amax().float()
    data = (x.float() * scale).clamp(-limit, limit).to(dtype)
    return data, data.t().contiguous()


def measure_gemm(tokens: int, out_features: int, in_features: int) -> dict[str, float]:
    """Milliseconds of one linear layer's three GEMMs in bf16 and FP8, and of its casts."""
    device = torch.device("cuda")
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)
    w = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)
    one = torch.ones((), device=device)

    bf16 = _time_ms(lambda: (x @ w.t(), dy @ w, dy.t() @ x))

    x8, xt8 = x.to(E4M3), x.t().contiguous().to(E4M3)
    w8, wt8 = w.to(E4M3), w.t().contiguous().to(E4M3)
    dy8, dyt8 = dy.to(E5M2), dy.t().contiguous().to(E5M2)

    def fp8_gemms():
        bf = torch.bfloat16
        torch._scaled_mm(x8, w8.t(), one, one, out_dtype=bf, use_fast_accum=True)
        torch._scaled_mm(dy8, wt8.t(), one, one, out_dtype=bf)
        torch._scaled_mm(dyt8, xt8.t(), one, one, out_dtype=torch.float32)

    fp8 = _time_ms(fp8_gemms)

    def fused_casts():  # current scaling: the absolute maximum, then the cast
        kernels.cast_to_fp8(x, E4M3, None, None, transpose=True)
        kernels.cast_to_fp8(dy, E5M2, None, None, transpose=True)

    amax = torch.zeros(1, device=device)

    def delayed_casts():  # delayed scaling: one pass, the maximum recorded on the way
        kernels.cast_to_fp8(x, E4M3, one, amax, transpose=True)
        kernels.cast_to_fp8(dy, E5M2, one, amax, transpose=True)

    def torch_casts():
        _torch_cast(x, E4M3)
        _torch_cast(dy, E5M2)

    fused, plain = _time_ms(fused_casts), _time_ms(torch_casts)
    delayed = _time_ms(delayed_casts)
    return {
        "bf16_ms": bf16,
        "fp8_gemm_ms": fp8,
        "fused_cast_ms": fused,
        "delayed_cast_ms": delayed,
        "torch_cast_ms": plain,
        "speedup_fused": bf16 / (fp8 + fused),
        "speedup_delayed": bf16 / (fp8 + delayed),
        "speedup_torch_casts": bf16 / (fp8 + plain),
        "tflops_bf16": 3 * 2 * tokens * out_features * in_features / bf16 / 1e9,
    }


def measure_blockwise_gemm(tokens: int, out_features: int, in_features: int) -> dict[str, float]:
    """Milliseconds of one linear layer's three GEMMs in bf16 and in blockwise FP8, and of its
    blockwise casts.

    Raises:
        RuntimeError: the blockwise GEMM would run dequantised here (not Hopper, or a size not
            a multiple of 128).
    """
    device = torch.device("cuda")
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)
    w = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)

    bf16 = _time_ms(lambda: (x @ w.t(), dy @ w, dy.t() @ x))

    x8 = blockwise.quantize_1x128(x, E4M3, transpose=True)
    dy8 = blockwise.quantize_1x128(dy, E4M3, transpose=True)
    w8 = Fp8Weight.quantized(w, blockwise=True)
    fprop_w, dgrad_w = w8.fprop_operand(), w8.dgrad_operand()
    dyt8, xt8 = dy8.transposed_operand(), x8.transposed_operand().t()

    def fp8_gemms():
        fp8_mm(x8, fprop_w, out_dtype=torch.bfloat16)
        fp8_mm(dy8, dgrad_w, out_dtype=torch.bfloat16)
        fp8_mm(dyt8, xt8, out_dtype=torch.float32)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            fp8_gemms()
        except UserWarning as dequantised:
            raise RuntimeError(f"no blockwise GEMM kernel to time: {dequantised}") from None
    fp8 = _time_ms(fp8_gemms)

    def fused_casts():
        block_kernels.cast_1x128(x, E4M3, rowwise=True, transpose=True)
        block_kernels.cast_1x128(dy, E4M3, rowwise=True, transpose=True)

    def torch_casts():  # the torch ops the CPU runs
        for tensor in (x, dy):
            blockwise._quantize_reference(tensor, E4M3, blockwise.ROW_BLOCK)
            blockwise._quantize_transposed_reference(tensor, E4M3)

    fused, plain = _time_ms(fused_casts), _time_ms(torch_casts)
    return {
        "bf16_ms": bf16,
        "fp8_gemm_ms": fp8,
        "fused_cast_ms": fused,
        "torch_cast_ms": plain,
        "speedup_fused": bf16 / (fp8 + fused),
        "speedup_torch_casts": bf16 / (fp8 + plain),
        "tflops_bf16": 3 * 2 * tokens * out_features * in_features / bf16 / 1e9,
    }


COLUMNS = {
    "tensorwise": [
        ("bf16_ms", "bf16 ms", "{:7.3f}"),
        ("fp8_gemm_ms", "fp8 ms", "{:7.3f}"),
        ("fused_cast_ms", "fused cast", "{:10.3f}"),
        ("delayed_cast_ms", "delayed", "{:8.3f}"),
        ("torch_cast_ms", "torch cast", "{:11.3f}"),
        ("speedup_fused", "x fused", "{:8.2f}"),
        ("speedup_delayed", "x delayed", "{:10.2f}"),
        ("speedup_torch_casts", "x torch", "{:8.2f}"),
    ],
    "blockwise": [
        ("bf16_ms", "bf16 ms", "{:7.3f}"),
        ("fp8_gemm_ms", "fp8 ms", "{:7.3f}"),
        ("fused_cast_ms", "fused cast", "{:10.3f}"),
        ("torch_cast_ms", "torch cast", "{:11.3f}"),
        ("speedup_fused", "x fused", "{:8.2f}"),
        ("speedup_torch_casts", "x torch", "{:8.2f}"),
    ],
}
"""Each recipe's printed columns: (row key, header, format)."""


def layer_gemms(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """(out features, in features) of each linear layer of a transformer layer."""
    heads, groups, kv = args.num_attention_heads, args.num_query_groups, args.kv_channels
    return {
        "qkv": ((heads + 2 * groups) * kv, args.hidden_size),
        "proj": (args.hidden_size, heads * kv),
        "fc1": (2 * args.ffn_hidden_size, args.hidden_size),
        "fc2": (args.hidden_size, args.ffn_hidden_size),
    }


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe",
        choices=list(COLUMNS),
        default="tensorwise",
        help="tensorwise: per-tensor scales, hybrid format (current and delayed-scaling casts); "
        "blockwise: 1x128 / 128x128 block scales, E4M3",
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--ffn-hidden-size", type=int, default=14336)
    parser.add_argument("--num-attention-heads", type=int, default=32)
    parser.add_argument("--num-query-groups", type=int, default=8)
    parser.add_argument("--kv-channels", type=int, default=128)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (FP8 GEMMs run on Hopper or newer)")
    measure = measure_blockwise_gemm if args.recipe == "blockwise" else measure_gemm
    columns = COLUMNS[args.recipe]
    rows = []
    print("gemm   shape (out x in)   " + "  ".join(header for _, header, _ in columns))
    for name, (out_features, in_features) in layer_gemms(args).items():
        row = {"gemm": name, "recipe": args.recipe, "tokens": args.tokens}
        row.update({"out": out_features, "in": in_features})
        row.update(measure(args.tokens, out_features, in_features))
        rows.append(row)
        cells = " ".join(form.format(row[key]) for key, _, form in columns)
        print(f"{name:<6} {out_features:>6} x {in_features:<6}    {cells}")
    total = {key: sum(row[key] for row in rows) for key in rows[0] if key.endswith("_ms")}
    bf16, gemms = total["bf16_ms"], total["fp8_gemm_ms"]
    fused, plain = total["fused_cast_ms"], total["torch_cast_ms"]
    summary = (
        f"layer: bf16 {bf16:.3f} ms; FP8 GEMMs {gemms:.3f} ms + fused casts {fused:.3f} ms "
        f"({bf16 / (gemms + fused):.2f}x), "
    )
    if "delayed_cast_ms" in total:
        delayed = total["delayed_cast_ms"]
        summary += f"+ delayed-scaling casts {delayed:.3f} ms ({bf16 / (gemms + delayed):.2f}x), "
    print(summary + f"or + torch casts {plain:.3f} ms ({bf16 / (gemms + plain):.2f}x)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return rows


if __name__ == "__main__":
    main()
