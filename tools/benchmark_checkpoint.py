"""Times saving and loading a GPT training checkpoint, with and without the file checksums.

Builds the model under Megatron-FSDP ZeRO-3 with its optimizer (AdamW, after one training step
so that its moments exist), then saves it with `save_checkpoint()` and loads it back with
`load_checkpoint()`, `--repeats` times each way: with the checksums recorded and verified (what
training does) and without them (the functions' `checksums=False`, there for this comparison
only). The model defaults to benchmark configuration L of `tools/benchmark_lib/gpt_model.py`, the
1.34B GPT of `examples/gpt_1.3b_fsdp.sh` (untied output layer; its checkpoint holds fp32 main
weights and two Adam moments):

    torchrun --nproc-per-node 2 tools/benchmark_checkpoint.py --bf16 --dir /scratch/ckpt-bench

`--fp8-format` (with `--fp8-recipe`) trains the model's transformer layers in FP8; under
delayed scaling its checkpoint also holds the amax histories and scales. On CPU (gloo) with a
tiny model; without torchrun it runs as a world of one:

    torchrun --nproc-per-node 2 tools/benchmark_checkpoint.py --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --vocab-size 128 --seq-length 32 --dir /tmp/ckpt-bench

`--dir` must be new or empty and shared by every rank; the checkpoints are removed after each
measurement, and the directory at the end. A load right after its save reads what the page cache
still holds of the files (all of them where memory allows), as both modes do alike. Rank 0
prints a table (medians) and one JSON line with every timing.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_lib.gpt_model import add_model_args

import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training.checkpoint_layout import checkpoint_dir, directory_bytes
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.initialize import destroy_megatron, initialize_megatron
from megatron.training.training import setup_model_and_optimizer, train_step

ITERATION = 1
"""The iteration every checkpoint is saved as (the one training step taken)."""


def parse_args() -> argparse.Namespace:
    """The flags, checked (bad ones exit through `parser.error`)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument(
        "--dir", required=True, help="new or empty directory for the checkpoints, on every rank"
    )
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per mode")
    parser.add_argument("--json-out", default=None, help="also write the JSON to this file")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1.")
    if os.path.exists(args.dir) and (not os.path.isdir(args.dir) or os.listdir(args.dir)):
        parser.error(f"--dir {args.dir} exists and is not an empty directory; pass a new one.")
    return args


def training_flags(args: argparse.Namespace, world_size: int) -> list[str]:
    """`pretrain_gpt.py`'s flags for the model of `args`, saved to and loaded from `--dir`."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    flags = (
        f"--num-layers {args.num_layers} --hidden-size {args.hidden_size} "
        f"--num-attention-heads {args.num_attention_heads} --seq-length {args.seq_length} "
        f"--max-position-embeddings {args.seq_length} --position-embedding-type rope "
        "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
        f"--micro-batch-size {args.micro_batch_size} "
        f"--global-batch-size {args.micro_batch_size * world_size} "
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
        f"--train-iters {ITERATION} --lr 1e-4 --mock-data --vocab-size {args.vocab_size} "
        f"--distributed-backend {backend} --logging-level {logging.WARNING}"
    ).split()
    flags += ["--save", args.dir, "--load", args.dir, *(["--bf16"] if args.bf16 else [])]
    if args.fp8_format is not None:
        flags += ["--fp8-format", args.fp8_format, "--fp8-recipe", args.fp8_recipe]
    return flags


def take_one_step(model, optimizer, scheduler, args: argparse.Namespace) -> None:
    """One training step on random tokens: the optimizer then holds its state tensors."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=generator
    )
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(args.micro_batch_size, args.seq_length),
        "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, -1),
    }
    microbatches = iter([batch] * args.num_microbatches)
    train_step(pretrain_gpt.forward_step, microbatches, model, optimizer, scheduler, args)


def timed(step: Callable[[], object]) -> float:
    """Seconds from every rank starting `step` to every rank finishing it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - start


def measure(model, optimizer, scheduler, args: argparse.Namespace, repeats: int) -> dict:
    """Save and load seconds per mode ("checksums", "none"), the modes alternating, and the
    checkpoint's size in bytes."""
    times: dict[str, dict[str, list[float]]] = {
        mode: {"save": [], "load": []} for mode in ("checksums", "none")
    }
    size = 0
    state = (model, optimizer, scheduler, args)
    for _ in range(repeats):
        for mode, checksums in (("checksums", True), ("none", False)):
            save = functools.partial(save_checkpoint, ITERATION, *state, checksums=checksums)
            times[mode]["save"].append(timed(save))
            if dist.get_rank() == 0:
                size = directory_bytes(checkpoint_dir(args.save, ITERATION))
            load = functools.partial(load_checkpoint, *state, checksums=checksums)
            times[mode]["load"].append(timed(load))
            if dist.get_rank() == 0:
                shutil.rmtree(args.save)
            dist.barrier()
    return {"seconds": times, "bytes": size}


def report(result: dict, config: dict) -> str:
    """The table of medians: each mode's save and load, and what the checksums add."""
    medians = {
        mode: {kind: statistics.median(values) for kind, values in kinds.items()}
        for mode, kinds in result["seconds"].items()
    }
    lines = [
        f"{config['params']:,} parameters, checkpoint {result['bytes'] / 2**30:.3f} GiB, "
        f"{config['world_size']} rank(s) on {config['device']}, median of {config['repeats']}",
        f"{'checksums':<10} {'save s':>9} {'load s':>9}",
    ]
    for mode, label in (("checksums", "on"), ("none", "off")):
        lines.append(f"{label:<10} {medians[mode]['save']:>9.3f} {medians[mode]['load']:>9.3f}")
    cost = []
    for kind in ("save", "load"):
        extra = medians["checksums"][kind] - medians["none"][kind]
        cost.append(f"{extra:>+9.3f} ({extra / medians['none'][kind]:+.0%})")
    lines.append(f"{'cost':<10} {cost[0]} {cost[1]}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    margs = initialize_megatron(argv=training_flags(args, world_size))
    try:
        model, optimizer, scheduler = setup_model_and_optimizer(
            pretrain_gpt.model_provider, ModelType.encoder_or_decoder, margs
        )
        take_one_step(model, optimizer, scheduler, margs)
        result = measure(model, optimizer, scheduler, margs, args.repeats)
        # Global sizes: the state dict's DTensors have the shapes of the whole tensors. Its
        # non-tensor values (the FP8 delayed-scaling state) are no parameters.
        params = sum(
            value.numel()
            for chunk in model
            for value in chunk.state_dict().values()
            if isinstance(value, torch.Tensor)
        )
        config = {
            "params": params,
            "world_size": dist.get_world_size(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "repeats": args.repeats,
            "model": {key: getattr(args, key) for key in vars(args) if key != "json_out"},
        }
        if dist.get_rank() == 0:
            print(report(result, config))
            line = json.dumps({"config": config, **result})
            print(line)
            if args.json_out:
                with open(args.json_out, "w") as file:
                    file.write(line + "\n")
    finally:
        destroy_megatron(destroy_default_group=True)
        if int(os.environ.get("RANK", "0")) == 0 and os.path.isdir(args.dir):
            shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
