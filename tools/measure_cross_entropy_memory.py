"""Peak GPU memory of one forward + backward of the 1.34B benchmark GPT, with and without
`--cross-entropy-loss-fusion` (the chunked cross-entropy of `megatron.core.fusions`).

Builds the model of `tools/benchmark_fsdp.py` (hidden 2048, 24 layers, vocab 32000, seq 2048,
micro-batch 2; `--bf16` for bf16 weights) on one CUDA GPU, runs the same batch through each
variant in turn (the other freed first), and prints the peak allocated memory above the
model's own (weights, and gradients after the first step) and the difference. Without CUDA it
says so and exits 0.

    python tools/measure_cross_entropy_memory.py --bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys

import torch
from benchmark_lib.gpt_model import add_model_args, build_gpt

from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec

GIB = 2**30


def peak_bytes(args: argparse.Namespace, fusion: bool, tokens: torch.Tensor) -> tuple[int, float]:
    """(peak bytes allocated above the model's own during forward + backward, mean loss)."""
    with torch.device("meta"):
        config, _ = build_gpt(args)
    # Derived again for the new config: they are filled once, in __post_init__.
    config = dataclasses.replace(
        config, cross_entropy_loss_fusion=fusion, init_method=None, output_layer_init_method=None
    )
    torch.manual_seed(args.seed)
    with torch.device("cuda"):
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=args.vocab_size,
            max_sequence_length=args.seq_length,
            position_embedding_type="rope",
        )
    # One step first, so the gradients exist and count in the baseline of the measured step.
    model(tokens, labels=tokens).mean().backward()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    value = loss.item()
    del model, loss
    gc.collect()
    torch.cuda.empty_cache()
    return peak, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("measure_cross_entropy_memory: CUDA is not available; nothing to measure.")
        sys.exit(0)
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(
        0, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=generator
    ).cuda()
    results = {fusion: peak_bytes(args, fusion, tokens) for fusion in (False, True)}
    dtype = "bf16" if args.bf16 else "fp32"
    print(
        f"GPT {args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}, "
        f"micro-batch {args.micro_batch_size} x seq {args.seq_length}, {dtype}, "
        f"{torch.cuda.get_device_name()}"
    )
    for fusion, (peak, loss) in results.items():
        name = "--cross-entropy-loss-fusion" if fusion else "F.cross_entropy(logits.float())"
        print(f"{name:34s} peak above model {peak / GIB:7.3f} GiB   loss {loss:.6f}")
    saved = results[False][0] - results[True][0]
    print(f"{'saved':34s} {saved / GIB:7.3f} GiB")


if __name__ == "__main__":
    main()
