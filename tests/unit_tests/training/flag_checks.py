"""A tiny valid command line, and `validated()`, for the tests of flags and their validation."""

from __future__ import annotations

import argparse

from megatron.training.arguments import parse_args, validate_args

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --vocab-size 100 "
    "--distributed-backend gloo"
).split()
"""A tiny valid run on CPU; later flags override these (argparse keeps the last value)."""

FSDP = "--use-megatron-fsdp"
ZERO3 = f"{FSDP} --data-parallel-sharding-strategy optim_grads_params"
HFSDP = f"{ZERO3} --outer-dp-sharding-strategy optim --num-distributed-optimizer-instances 2"


def validated(
    *flags: str, world_size: int = 2, base: tuple[str, ...] = tuple(BASE)
) -> argparse.Namespace:
    """`BASE` (or `base`) plus `flags`, parsed and validated for `world_size` ranks."""
    return validate_args(parse_args(args=[*base, *flags]), world_size=world_size)
