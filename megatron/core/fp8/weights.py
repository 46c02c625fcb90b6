"""FP8 copies of the weights: `fp8_weight_of(weight)`, made once per change of the weight.

Weights are scaled from their current absolute maximum under every recipe (delayed scaling
included: a cast made once per optimizer step gains nothing from a delayed scale, and cannot
overflow), per tensor, so the FP8 copy is a function of the weight alone:
`fp8(clamp(w * 448 / max|w|))`, each tensor-parallel shard scaled on its own, as upstream.

Where the copy comes from:

- a provider an engine registered for the parameter (`register_fp8_weight`): the seam for an
  engine that keeps the FP8 weights itself (e.g. one that all-gathers FP8 bytes);
- otherwise a cache kept here per parameter, made at the first use and made again once the
  weight may have changed. "May have changed" is read from three signals, since no single one
  sees every write:

  * the parameter's version counter, which in-place writes through it bump (`copy_`,
    `load_state_dict`, torch's for-loop and foreach optimizers);
  * a count of optimizer steps, from torch's global step hook: fused optimizer kernels (torch's
    `fused=True`, this project's `step_and_copy`) write without bumping version counters,
    and the DDP engine's distributed optimizer gathers the stepped weights after its step;
  * the parameter's address and dtype, which a `.data` swap (`model.cuda()`) changes.

  An engine that rewrites compute weights without either (Megatron-FSDP's gathers keep version
  counters as they are, on purpose) calls `forget_fp8_weights(params)` where it does.
  Under CUDA-graph capture nothing is cached: the graph casts the weights at each replay.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from megatron.core.fp8 import kernels
from megatron.core.fp8.quantize import quantize
from megatron.core.fp8.tensor import Fp8Tensor
from megatron.core.utils import cuda_graph_capturing

WEIGHT_DTYPE = torch.float8_e4m3fn
"""Weights are E4M3 under every format."""


class Fp8Weight:
    """A weight `[out, in]` in FP8, and its transpose, made at the first use.

    Args:
        tensor: the weight's FP8 bytes (row-major `[out, in]`) and scale.
    """

    def __init__(self, tensor: Fp8Tensor) -> None:
        self.tensor = tensor
        self._transposed: Fp8Tensor | None = None

    @classmethod
    def quantized(cls, weight: torch.Tensor) -> Fp8Weight:
        """The high-precision `weight` (2-D) cast to FP8, scaled by its current amax."""
        with torch.no_grad():
            return cls(quantize(weight.detach(), WEIGHT_DTYPE))

    def fprop_operand(self) -> Fp8Tensor:
        """`W^T` `[in, out]` column-major: the second operand of `X W^T`."""
        return self.tensor.t()

    def dgrad_operand(self) -> Fp8Tensor:
        """`W` `[out, in]` column-major: the second operand of `dY W`, the transposed view of
        the contiguous transpose (made once per copy)."""
        if self._transposed is None:
            data = self.tensor.data
            if kernels.triton is not None and data.is_cuda and data.is_contiguous():
                transposed = kernels.transpose_fp8(data)
            else:
                transposed = data.t().contiguous()
            self._transposed = Fp8Tensor(transposed, self.tensor.scale_inv)
        return self._transposed.t()


Provider = Callable[[torch.nn.Parameter], Fp8Weight]

_providers: dict[int, tuple[weakref.ref, weakref.WeakMethod | Callable]] = {}
"""id(parameter) -> (a weak reference to it, its provider)."""

_cache: dict[int, tuple[weakref.ref, tuple, Fp8Weight]] = {}
"""id(parameter) -> (a weak reference to it, the signals its copy was made at, the copy)."""

_optimizer_steps = 0
_step_hook: Any = None


def _count_step(*unused: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def register_fp8_weight(param: torch.nn.Parameter, provider: Provider) -> None:
    """Makes `fp8_weight_of(param)` return `provider(param)` while `param` lives (a bound
    method is held weakly: a dead engine's parameters fall back to the cache)."""
    key = id(param)
    held = weakref.WeakMethod(provider) if hasattr(provider, "__self__") else provider
    _providers[key] = (weakref.ref(param, _forgetter(_providers, key)), held)


def forget_fp8_weights(params: Iterable[torch.Tensor]) -> None:
    """Drops the cached FP8 copies of `params` (their values changed, or their memory is
    freed): the next use makes them again."""
    for param in params:
        _cache.pop(id(param), None)


def fp8_weight_of(weight: torch.Tensor) -> Fp8Weight:
    """The FP8 copy of `weight` (module docstring)."""
    key = id(weight)
    entry = _providers.get(key)
    if entry is not None:
        provider = entry[1]() if isinstance(entry[1], weakref.WeakMethod) else entry[1]
        if provider is not None:
            return provider(weight)
    if not isinstance(weight, torch.nn.Parameter) or cuda_graph_capturing():
        return Fp8Weight.quantized(weight)
    _watch_optimizer_steps()
    # The address too: a `.data` swap (`model.cuda()`, `model.to(dtype)`) bumps no version.
    signals = (weight._version, _optimizer_steps, weight.data_ptr(), weight.dtype)
    cached = _cache.get(key)
    if cached is not None and cached[1] == signals:
        return cached[2]
    made = Fp8Weight.quantized(weight)
    _cache[key] = (weakref.ref(weight, _forgetter(_cache, key)), signals, made)
    return made


def _watch_optimizer_steps() -> None:
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_count_step)


def _forgetter(table: dict[int, tuple], key: int) -> Callable[[weakref.ref], None]:
    """A weak reference callback removing `table[key]` as its parameter dies (unless a later
    entry for a new object of the same id replaced it)."""

    def forget(ref: weakref.ref) -> None:
        entry = table.get(key)
        if entry is not None and entry[0] is ref:
            del table[key]

    return forget
