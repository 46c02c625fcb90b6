"""The random generators' states in a checkpoint: each rank's Python, NumPy, torch and CUDA
generators, and the tensor-parallel RNG tracker's named states, saved with every checkpoint and
restored on loading (unless `--no-load-rng`), so a resumed run draws what the uninterrupted one
would have (dropout masks, data order)."""

from __future__ import annotations

import random
from typing import Any

import numpy
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, rng_tracker_device_type
from megatron.training.utils import print_rank_0


def rng_state() -> dict[str, Any]:
    """This rank's generator states: Python's, NumPy's, torch's, CUDA's (once initialised) and
    the tensor-parallel RNG tracker's named states (with their seeds, and the device whose
    generator they belong to)."""
    tracker = get_cuda_rng_tracker()
    state = {
        "random": random.getstate(),
        "numpy": numpy.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": None,
        "rng_tracker_states": tracker.get_states(),
        "rng_tracker_seeds": tracker.get_seeds(),
        "rng_tracker_device": rng_tracker_device_type(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(states: list[dict[str, Any]], path: str) -> None:
    """This rank's saved generator states; rank 0's when the world size changed (Megatron's
    ranks of one model replica share their seeds, and so their states). None saved (a
    checkpoint converted from model weights): the generators keep their state. The RNG
    tracker's states: see `set_tracker_states`."""
    if not states:
        print_rank_0(f"> {path} holds no RNG states: the random generators keep theirs")
        return
    rank = dist.get_rank()
    same_world = len(states) == dist.get_world_size()
    if not same_world:
        print_rank_0(
            f"> the checkpoint has the RNG states of {len(states)} ranks, this run "
            f"{dist.get_world_size()}: every rank takes rank 0's (and the RNG tracker's of "
            "the rank that seeded them alike)"
        )
    state = states[rank if same_world else 0]
    random.setstate(state["random"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    set_tracker_states(states, rank if same_world else None, path)


def set_tracker_states(states: list[dict[str, Any]], rank: int | None, path: str) -> None:
    """Restores each state of the tensor-parallel RNG tracker from a saved one of the same name
    and seed: this rank's (`rank`, None at another world size) if it matches, else the first
    rank's that does. Matching by seed keeps the states of different tensor-parallel ranks
    apart at any layout, where taking rank 0's would give every tp rank the same dropout masks.
    A state no saved rank seeded alike (a tp rank that did not exist), and every state of a
    checkpoint saved before the tracker's states were, or on another kind of device (CUDA and
    CPU generator states differ), keeps its seeded value: training resumes, but dropout
    inside tensor-parallel regions draws other masks than an uninterrupted run's."""
    tracker = get_cuda_rng_tracker()
    if not tracker.is_initialized():
        return  # nothing forks it: not seeded by model_parallel_cuda_manual_seed
    if any("rng_tracker_states" not in state for state in states):
        print_rank_0(
            f"> {path} holds no RNG tracker states (saved before they were checkpointed): "
            "dropout inside tensor-parallel regions starts again from --seed's states"
        )
        return
    device = rng_tracker_device_type()
    saved_device = states[0]["rng_tracker_device"]
    if saved_device != device:
        print_rank_0(
            f"> {path} holds the RNG tracker states of {saved_device} generators, this run "
            f"draws from {device} ones: dropout inside tensor-parallel regions starts again "
            "from --seed's states"
        )
        return
    candidates = states if rank is None else [states[rank], *states]
    restored = tracker.get_states()
    for name, seed in tracker.get_seeds().items():
        for saved in candidates:
            if saved["rng_tracker_seeds"].get(name) == seed:
                restored[name] = saved["rng_tracker_states"][name]
                break
    tracker.set_states(restored)
