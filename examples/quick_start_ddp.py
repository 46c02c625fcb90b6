"""Quick start: train a tiny GPT with the DDP engine on N ranks and watch the loss fall.

    torchrun --nproc-per-node 2 examples/quick_start_ddp.py

Runs on CPU with gloo, or on GPUs with NCCL when every rank has one. The data is a learnable toy
language: each sequence counts up from a random start by a random stride (mod the vocabulary), so
the model must read the context to predict the next token.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

# Runnable from a checkout without installing the package (as Megatron-LM's tools are).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig


def counting_batch(
    batch_size: int, seq_length: int, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq_length + 1)) % vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=40)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--num-microbatches", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")
    )
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
    )
    torch.manual_seed(1234)  # the same initial weights on every rank
    with device:
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=args.vocab_size,
            max_sequence_length=args.seq_length,
            position_embedding_type="rope",
        )
    ddp_model = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=True), model
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(rank)  # each rank sees different data

    if rank == 0:
        print(
            f"Training a {sum(p.numel() for p in model.parameters()):,}-parameter GPT with DDP "
            f"on {world_size} ranks ({device.type})",
            flush=True,
        )
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        ddp_model.zero_grad_buffer()
        total_loss = torch.zeros((), device=device)
        for micro in range(args.num_microbatches):
            tokens, labels = counting_batch(
                args.micro_batch_size, args.seq_length, args.vocab_size, generator
            )
            last = micro == args.num_microbatches - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                loss = ddp_model(tokens.to(device), labels=labels.to(device)).mean()
                (loss / args.num_microbatches).backward()
            total_loss += loss.detach() / args.num_microbatches
        ddp_model.finish_grad_sync()
        for param in model.parameters():
            param.grad = param.main_grad  # the engine reduces into main_grad
        optimizer.step()
        dist.all_reduce(total_loss)
        if rank == 0:
            elapsed_ms = (time.perf_counter() - start) * 1000
            print(
                f"iteration {iteration:4d}/{args.train_iters} | loss "
                f"{total_loss.item() / world_size:.4f} | {elapsed_ms:.1f} ms",
                flush=True,
            )

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
