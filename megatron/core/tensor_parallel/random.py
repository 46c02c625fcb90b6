"""Named random-generator states for model-parallel regions (Megatron-core's RNG tracker).

Dropout outside tensor-parallel (tp) regions must draw the same mask on every tp rank (the
activations are replicated there), while dropout inside a tp region (attention probabilities,
whose heads are split over tp) must draw different masks on different tp ranks. The default
generator serves the first case; the tracker keeps further named generator states and swaps
one in for the duration of `fork(name)`:

- "model-parallel-rng": seed + 2718 + tp rank, the default for `fork()`;
- "expert-parallel-rng": seed + 1024 + 100 * ep rank + etp rank;
- "data-parallel-rng": seed, the default generator's own seed.

The states belong to the generator of the device the process computes on, CUDA's or the
CPU's (so the same code runs on gloo/CPU ranks, GPUs present or not), chosen when the tracker
is seeded; `rng_tracker_device_type()` says which. The two kinds of state are not
interchangeable (a CUDA state is a seed and an offset, a CPU state a Mersenne Twister's), so a
checkpoint keeps the device type beside the states.

Activation recompute: non-reentrant `torch.utils.checkpoint` replays the default generator
only. A checkpointed function that forks the tracker would draw new masks in its recomputation
(and advance the tracker a second time). Pass `context_fn=rng_tracker_replay_contexts` (or
combine its pair with your own contexts) to replay the tracker states too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron.core import parallel_state
from megatron.core.utils import FreshContext

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"

_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def rng_tracker_device_type() -> str:
    """The device whose generator states the tracker holds, "cuda" or "cpu"."""
    return get_cuda_rng_tracker().device_type


def _compute_device_type() -> str:
    """The device this process computes on: CUDA under an NCCL process group (or, without a
    process group, wherever CUDA is available), else the CPU (a gloo group's ranks compute on
    CPU tensors even where GPUs are present)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "cuda" if "nccl" in torch.distributed.get_backend() else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_rng_state(device_type: str) -> torch.Tensor:
    if device_type == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named states of one device's generator, swapped in by `fork(name)`.

    Attributes:
        device_type: whose generator, "cuda" or "cpu" (set by `model_parallel_cuda_manual_seed`;
            until then CUDA's where it is available, asked at the first use: the tracker is
            made at import, and a process that has asked CUDA for its devices cannot use CUDA
            in the children it forks).
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: dict[str, int] = {}  # name -> the seed its state started from
        self._device_type: str | None = None

    @property
    def device_type(self) -> str:
        if self._device_type is None:
            self._device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return self._device_type

    @device_type.setter
    def device_type(self, device_type: str) -> None:
        self._device_type = device_type

    def is_initialized(self) -> bool:
        """Whether any state was added since the last reset."""
        return bool(self.states_)

    def reset(self) -> None:
        """Forgets every state and seed."""
        self.states_ = {}
        self.seeds_ = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (states are never modified in place)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replaces every state (from `get_states()`, e.g. a checkpoint or a recompute)."""
        self.states_ = dict(states)

    def get_seeds(self) -> dict[str, int]:
        """Name -> the seed `add()` gave that state: states of equal name and seed are one
        stream (those of the ranks of one tensor-parallel rank, say), which a checkpoint
        loaded at another layout matches by."""
        return dict(self.seeds_)

    def add(self, name: str, seed: int) -> None:
        """Adds a state `name` seeded with `seed`, leaving the device generator as it was.

        Raises:
            ValueError: `name` or `seed` is already tracked.
        """
        if seed in self.seeds_.values():
            raise ValueError(f"RNG seed {seed} is already tracked; give each state its own seed.")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists; reset() the tracker first.")
        self.seeds_[name] = seed
        original = _get_rng_state(self.device_type)
        _manual_seed(seed, self.device_type)
        self.states_[name] = _get_rng_state(self.device_type)
        _set_rng_state(original, self.device_type)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Runs the body with the device generator in state `name`, then stores the advanced
        state under `name` and gives the generator its previous state back.

        Raises:
            KeyError: `name` is not tracked (call `model_parallel_cuda_manual_seed` first).
        """
        if name not in self.states_:
            raise KeyError(
                f"RNG state {name!r} is not tracked; seed the tracker with "
                "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed() first."
            )
        original = _get_rng_state(self.device_type)
        _set_rng_state(self.states_[name], self.device_type)
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state(self.device_type)
            _set_rng_state(original, self.device_type)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker."""
    return _CUDA_RNG_STATE_TRACKER


def get_expert_parallel_rng_tracker_name() -> str:
    """Name of the state expert layers fork."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    """Name of the state seeded like the default generator."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(
    seed: int,
    *,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    device_type: str | None = None,
) -> None:
    """Seeds the compute device's default generator with `seed` and resets the tracker with
    the model-parallel, expert-parallel and data-parallel states of that device's generator.

    Args:
        seed: The training seed.
        tp_rank: Tensor-parallel rank; None: parallel_state's when initialised, else 0.
        ep_rank: Expert-parallel rank; None: parallel_state's when initialised, else 0.
        etp_rank: Expert tensor-parallel rank; None: parallel_state's when initialised, else 0.
        device_type: "cuda" or "cpu", where dropout draws; None: CUDA under an NCCL
            process group (or, without a process group, wherever CUDA is available), else the
            CPU.

    Raises:
        ValueError: `device_type` is neither, or "cuda" without CUDA.
    """
    device_type = device_type or _compute_device_type()
    if device_type not in ("cuda", "cpu") or (
        device_type == "cuda" and not torch.cuda.is_available()
    ):
        raise ValueError(
            f"device_type={device_type!r}: give 'cuda' (with CUDA available) or 'cpu'."
        )
    initialized = parallel_state.model_parallel_is_initialized()
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank() if initialized else 0
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank() if initialized else 0
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank() if initialized else 0
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.device_type = device_type
    _manual_seed(seed, device_type)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
    expert_seed = seed + _EXPERT_PARALLEL_SEED_OFFSET + 100 * ep_rank + etp_rank
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)


class _ReplayTrackerStates:
    """The pair of contexts for `torch.utils.checkpoint(context_fn=...)` that replays the
    tracker: the forward context records the states it starts from, the recompute context runs
    with them and then puts back the states the tracker had before the recompute (as
    checkpoint does for the default generator)."""

    def __init__(self) -> None:
        self.forward_states: dict[str, torch.Tensor] | None = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self.forward_states = get_cuda_rng_tracker().get_states()
        yield

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        tracker = get_cuda_rng_tracker()
        current = tracker.get_states()
        if self.forward_states is not None:
            tracker.set_states(self.forward_states)
        try:
            yield
        finally:
            tracker.set_states(current)


def rng_tracker_replay_contexts() -> tuple[
    contextlib.AbstractContextManager, contextlib.AbstractContextManager
]:
    """`(forward_context, recompute_context)` for non-reentrant `torch.utils.checkpoint`'s
    `context_fn`, so that recomputation forks the tracker states the forward forked (in every
    backward that recomputes: `retain_graph=True` allows more than one)."""
    replay = _ReplayTrackerStates()
    return replay.forward(), FreshContext(replay.recompute)


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """Megatron-core's `tensor_parallel.checkpoint`: `function(*args)` with its activations
    recomputed in backward, the default generator's and the tracker's states replayed
    (`megatron.core.transformer.recompute.recompute`, a non-reentrant checkpoint: unlike
    upstream's it also works under `torch.autograd.grad` and with inputs that need no grad).

    Raises:
        ValueError: `distribute_saved_activations` (splitting the saved inputs over the
            tensor-parallel ranks) is not built.
    """
    if distribute_saved_activations:
        raise ValueError(
            "checkpoint(distribute_saved_activations=True) is not built: pass False (with "
            "sequence parallelism the saved inputs are split over the ranks already)."
        )
    # Imported here: `recompute` builds on this module's replay contexts.
    from megatron.core.transformer.recompute import recompute

    return recompute(function, *args)
