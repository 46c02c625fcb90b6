"""Trains one GPT under Megatron-FSDP at several tensor-parallel sizes (2-D: TP inside, FSDP over
the rest), under FSDP2 alone, and under PyTorch's own 2-D composition, and compares step time,
tokens/s/GPU, MFU and peak memory.

Engines (`--engines`, run in the order given):

- `megatron_fsdp`: the model's tensor-parallel layers (`--sequence-parallel` optional) inside
  Megatron-FSDP ZeRO-3 over the data-parallel ranks, once per size in `--tensor-parallel-sizes`
  (default: the world size, halved down to 1); a row per size, `megatron_fsdp_tp<T>`;
- `fsdp2`: PyTorch FSDP2 on the same model at TP 1;
- `torch_2d`: the same architecture as plain PyTorch modules
  (`benchmark_lib/torch_2d_model.py`), tensor-parallel with `parallelize_module` (torchtitan's
  recipe, sequence parallel, loss on vocabulary-sharded logits) inside FSDP2 over the
  data-parallel ranks, at the largest TP size.

All run bf16 compute with fp32 main weights and AdamW, fp32 gradient reduction. tokens/s/GPU and
TFLOP/s/GPU count each GPU's share (a tensor-parallel group works on one micro-batch together);
MFU divides by `--peak-tflops` (989: dense bf16 on H100/H200 SXM).

    # 1.34B (L), 2 GPUs: TP 2 x FSDP 1 against FSDP 2
    torchrun --nproc-per-node 2 tools/benchmark_tp.py --bf16 --sequence-parallel
    # ~6.7B (hidden 4096, 32 layers), seq 8192, micro-batch 1, against PyTorch's 2-D composition
    torchrun --nproc-per-node 2 tools/benchmark_tp.py --bf16 --sequence-parallel \\
        --hidden-size 4096 --num-layers 32 --num-attention-heads 32 --seq-length 8192 \\
        --micro-batch-size 1 --engines megatron_fsdp,torch_2d --tensor-parallel-sizes 2
    # tiny, on CPU (gloo):
    torchrun --nproc-per-node 2 tools/benchmark_tp.py --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --vocab-size 128 --seq-length 32 --steps 2 --warmup-steps 1
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import benchmark_fsdp as bench
import benchmark_lib.engines as engines
from benchmark_lib.gpt_model import build_gpt, parallel_sizes, set_parallel_state
from benchmark_lib.report import report
from benchmark_lib.torch_2d_model import TorchGPT, parallelize

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

ENGINES = ("megatron_fsdp", "fsdp2", "torch_2d")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of `benchmark_fsdp.py` (engines and TP sizes of this benchmark; `argv`: default
    the command line)."""
    parser = bench.build_parser()
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(engines=",".join(ENGINES))
    parser.add_argument(
        "--tensor-parallel-sizes",
        default=None,
        help="comma-separated TP sizes for megatron_fsdp (default: the world size halved down "
        "to 1); torch_2d runs at the largest",
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="for the MFU column")
    args = bench.check_args(parser, parser.parse_args(argv), ENGINES)
    if args.global_batch_size is not None:
        parser.error(
            "--global-batch-size: each TP size has its own data-parallel size, so one global "
            "batch means other microbatch counts per row; give --num-microbatches instead."
        )
    if args.cuda_graph:
        parser.error("--cuda-graph is not offered here (torch_2d cannot be captured).")
    args.tensor_parallel_sizes = parallel_sizes(
        parser,
        "--tensor-parallel-sizes",
        args.tensor_parallel_sizes,
        ("--num-attention-heads", args.num_attention_heads),
    )
    return args


def build_torch_2d(args: argparse.Namespace, tp: int) -> engines.StepFn:
    """PyTorch's TP x FSDP2 composition of the plain-PyTorch GPT (module docstring) at TP `tp`."""
    device_type = torch.device(args.device).type
    mesh = init_device_mesh(
        device_type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp")
    )
    with torch.device("meta"):
        model = TorchGPT(args)
    parallelize(model, mesh["tp"], mesh["dp"], args.bf16)
    model.to_empty(device=torch.get_default_device())
    model.init_weights()
    optimizer = engines.make_adamw(model.parameters(), args)

    def step(batches: list[engines.Batch]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=batches[0][0].device)
        for i, (tokens, labels) in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            with loss_parallel():
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) / len(batches)
                loss.backward()
            total += loss.full_tensor().detach()
        optimizer.step()
        return total

    return step


def build(name: str, args: argparse.Namespace, tp: int) -> engines.StepFn:
    """The step function of `name` at TP `tp` (parallel_state is set by the caller)."""
    # Sequence-parallel layers draw from the tracker's tensor-parallel state in training.
    model_parallel_cuda_manual_seed(args.seed)
    if name == "torch_2d":
        return build_torch_2d(args, tp)
    return engines.build_engine("megatron_fsdp_zero3" if name == "megatron_fsdp" else name, args)


def run(name: str, tp: int, args: argparse.Namespace, device: torch.device) -> dict:
    """One table row: engine `name` at tensor-parallel size `tp`."""
    tp_size = 1 if name == "torch_2d" else tp
    set_parallel_state(args.create_all_gather_group, tensor_model_parallel_size=tp_size)
    with torch.device("meta"):
        config, _ = build_gpt(args)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    measured = bench.run_engine(name, args, device, build=functools.partial(build, tp=tp))
    row = bench.summarize(name, measured, args, config, device)
    row["engine"] = f"{name}_tp{tp}"
    if name == "torch_2d":
        compute = "bf16 compute (FSDP2 mp_policy)" if args.bf16 else "fp32 compute"
        row["precision"] = (
            f"fp32 sharded params = main weights (AdamW on DTensors), {compute}, TP by "
            "parallelize_module, grads reduced in fp32"
        )
    # A tensor-parallel group computes one micro-batch together: each GPU does 1/TP of it.
    row["tokens_per_s_per_gpu"] /= tp
    row["tflops_per_s_per_gpu"] /= tp
    row["mfu"] = row["tflops_per_s_per_gpu"] / args.peak_tflops
    row["vs_single"] = None
    return row


def main() -> None:
    """Runs every engine at its TP sizes; rank 0 prints (and writes) the results."""
    args = parse_args()
    device = bench.init_distributed(torch.device(args.device).type)
    set_parallel_state(args.create_all_gather_group)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in build_gpt(args)[1].parameters())
    rows = []
    for name in args.engines:
        if name == "megatron_fsdp":
            rows.extend(run(name, tp, args, device) for tp in args.tensor_parallel_sizes)
        else:
            tp = max(args.tensor_parallel_sizes) if name == "torch_2d" else 1
            rows.append(run(name, tp, args, device))
    reference = next((r for r in rows if r["engine"].startswith("torch_2d")), None)
    for row in rows:
        if reference is not None:
            row["tokens_vs_torch_2d"] = (
                row["tokens_per_s_per_gpu"] / reference["tokens_per_s_per_gpu"]
            )
    notes = []
    for row in rows:
        ratio = row.get("tokens_vs_torch_2d")
        versus = "" if ratio is None else f", tokens/s {ratio:.2f}x torch_2d's"
        notes.append(f"{row['engine']}: MFU {row['mfu']:.1%}{versus}")
    report(rows, args, device, num_params, notes)
    gc.collect()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
