"""FP8 copies of the weights: `fp8_weight_of(weight)`, made once per change of the weight.

Weights are scaled from their current absolute maximum under every recipe (delayed scaling
included: a cast made once per optimizer step gains nothing from a delayed scale, and cannot
overflow), per tensor, so the FP8 copy is a function of the weight alone:
`fp8(clamp(w * 448 / max|w|))`, each tensor-parallel shard scaled on its own, as upstream. The
blockwise recipe scales each 128x128 block by its own (`blockwise.quantize_128x128`,
`fp8_weight_of(weight, blockwise=True)`). The stacked weights of an MoE layer's experts
(`[num_experts, out, in]`) are scaled per expert (`Fp8ExpertWeights`): each expert's
`[out, in]` is a weight of its own, as Transformer Engine's grouped linear layers keep one weight
per expert.

Where the copy comes from:

- a provider an engine registered for the parameter (`register_fp8_weight`): the seam for an
  engine that keeps the FP8 weights itself (e.g. one that all-gathers FP8 bytes), per tensor
  only: a blockwise layer whose weight has one is refused. A provider answers None where its
  copy no longer follows the parameter (written since it was made): the cache below then
  makes one from the parameter;
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

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from megatron.core.fp8 import kernels
from megatron.core.fp8.blockwise import quantize_128x128, square_block_layout
from megatron.core.fp8.cpp_linear import native_transpose
from megatron.core.fp8.grouped_gemm import ExpertRows
from megatron.core.fp8.grouped_quantize import aligned_scale_invs, quantize_experts
from megatron.core.fp8.quantize import GEMM_ALIGNMENT, quantize
from megatron.core.fp8.tensor import BlockFp8Tensor, Fp8Tensor
from megatron.core.fusions.triton_launch import launches_on
from megatron.core.utils import cuda_graph_capturing

WEIGHT_DTYPE = torch.float8_e4m3fn
"""Weights are E4M3 under every format."""


class Fp8Weight:
    """A weight `[out, in]` in FP8, and its transpose, made at the first use.

    Args:
        tensor: the weight's FP8 bytes (row-major `[out, in]`) and scale, or scales of its
            128x128 blocks.
        transposes_with: where the weight is one of several whose transposes are needed
            together (a Megatron-FSDP unit's, whose backward takes them all), called with the
            weight at its transpose's first need: makes them all (`transpose_all`), or nothing
            (the weight then makes its own).
    """

    def __init__(
        self,
        tensor: Fp8Tensor | BlockFp8Tensor,
        transposes_with: Callable[[Fp8Weight], None] | None = None,
    ) -> None:
        self.tensor = tensor
        self._transposes_with = transposes_with
        self._transposed: Fp8Tensor | BlockFp8Tensor | None = None
        # The GEMM operands, views made at their first use rather than at every GEMM.
        self._fprop: Fp8Tensor | BlockFp8Tensor | None = None
        self._dgrad: Fp8Tensor | BlockFp8Tensor | None = None

    @classmethod
    def quantized(cls, weight: torch.Tensor, blockwise: bool = False) -> Fp8Weight:
        """The high-precision `weight` (2-D) cast to FP8, scaled by its current amax (of each
        128x128 block where `blockwise`)."""
        with torch.no_grad():
            if blockwise:
                return cls(quantize_128x128(weight.detach(), WEIGHT_DTYPE))
            return cls(quantize(weight.detach(), WEIGHT_DTYPE))

    def fprop_operand(self) -> Fp8Tensor | BlockFp8Tensor:
        """`W^T` `[in, out]` column-major: the second operand of `X W^T`."""
        if self._fprop is None:
            self._fprop = self.tensor.t()
        return self._fprop

    def dgrad_operand(self) -> Fp8Tensor | BlockFp8Tensor:
        """`W` `[out, in]` column-major: the second operand of `dY W`, the transposed view of
        the contiguous transpose (made once per copy; a 128x128 block transposes whole, so
        its scales are the transposed ones)."""
        if self._dgrad is None:
            self._dgrad = self.transposed().t()
        return self._dgrad

    def transposed(self) -> Fp8Tensor | BlockFp8Tensor:
        """The weight's contiguous transpose, `[in, out]` row-major (made once per copy, with
        others' where `transposes_with` says, or held: `hold_transpose`)."""
        if self._transposed is None and self._transposes_with is not None:
            self._transposes_with(self)
        if self._transposed is None:
            self._transposed = self._transpose()
        return self._transposed

    @staticmethod
    def transpose_all(weights: Sequence[Fp8Weight]) -> None:
        """Makes the transposes of `weights` (scaled per tensor) not yet made: in one call to
        the C++ extension where it runs (a launch each, without the Python of a call each:
        a 1.34B GPT's backward makes 96), else one by one."""
        pending = [weight for weight in weights if weight._transposed is None]
        if not pending:
            return
        datas = [weight.tensor.data for weight in pending]
        native = native_transpose(datas[0])
        if native is None or any(isinstance(w.tensor, BlockFp8Tensor) for w in pending):
            for weight in pending:
                weight._transposed = weight._transpose()
            return
        for weight, transposed in zip(pending, native.transpose_all(datas)):
            weight._transposed = Fp8Tensor(transposed, weight.tensor.scale_inv)

    def drop_transpose(self) -> None:
        """Frees the transpose (the bytes changed, or are freed): the next need makes it
        again. The weight's own views stay."""
        self._transposed = self._dgrad = None

    def hold_transpose(self, transposed: Fp8Tensor) -> None:
        """Makes `transposed` (the contiguous transpose's bytes, held elsewhere: a view of the
        stacked transposes of MoE experts) the one the input-gradient GEMM multiplies by,
        instead of a copy of its own."""
        self._transposed, self._dgrad = transposed, None

    def _transpose(self) -> Fp8Tensor | BlockFp8Tensor:
        """The weight's contiguous transpose, `[in, out]` row-major, and its scales: 1 byte per
        element read and written."""
        data = self.tensor.data
        native = native_transpose(data)
        if native is not None:
            transposed = native.transpose(data)
        elif launches_on(data) and data.is_contiguous():
            transposed = kernels.transpose_fp8(data)
        else:
            transposed = data.t().contiguous()
        if isinstance(self.tensor, BlockFp8Tensor):
            scale_inv = square_block_layout(self.tensor.scale_inv.t())
            return BlockFp8Tensor(transposed, scale_inv, self.tensor.block)
        return Fp8Tensor(transposed, self.tensor.scale_inv)


@functools.cache
def _stacked_rows(experts: int, out_features: int, device: torch.device) -> ExpertRows:
    """The rows of stacked weights `[experts, out, in]` on `device` as the cast's groups: one
    `ExpertRows` per shape, whose device table, copied from the host at the first cast, serves
    every later one (a CUDA graph's capture among them, which cannot copy from pageable host
    memory)."""
    rows = ExpertRows([out_features] * experts)
    rows.gemm_table(device)
    if device.type == "cuda":
        # Later casts may run on other streams: the copy must have landed before any reads it.
        torch.cuda.current_stream(device).synchronize()
    return rows


class Fp8ExpertWeights:
    """The stacked weights of an MoE projection's experts, `[num_experts, out, in]`, in FP8 with
    one scale per expert.

    The grouped GEMMs read the stacked bytes and scales as they are; each expert's own
    `Fp8Weight` (views of them, for one GEMM per expert) is made at the first use
    (`__getitem__`), so that making the copy costs the host the same for 8 experts as for 256.

    Args:
        data: the FP8 bytes, `[num_experts, out, in]` contiguous.
        scale_invs: each expert's dequantisation multiplier, `[num_experts]` fp32 (any stride:
            a column of `[num_experts, 4]` rows gives each its own 16-byte aligned address,
            which cuBLASLt needs of a GEMM's scale; other layouts are copied into such rows
            for the per-expert GEMMs).
    """

    def __init__(self, data: torch.Tensor, scale_invs: torch.Tensor) -> None:
        if data.dim() != 3 or scale_invs.shape != data.shape[:1]:
            raise ValueError(
                f"Fp8ExpertWeights: scales {list(scale_invs.shape)} for stacked weights "
                f"{list(data.shape)}; give one scale per expert of a 3-D tensor."
            )
        self.data = data
        self._scale_invs = scale_invs
        self._experts: list[Fp8Weight] | None = None
        self._stacked_scale_invs: torch.Tensor | None = None
        self._stacked_transposes: torch.Tensor | None = None

    @classmethod
    def quantized(cls, weight: torch.Tensor) -> Fp8ExpertWeights:
        """The high-precision `weight` (`[num_experts, out, in]`) cast to FP8, each expert
        scaled by its own current amax."""
        experts, out_features, in_features = weight.shape
        if out_features % GEMM_ALIGNMENT:
            raise ValueError(
                f"Fp8ExpertWeights: each expert's {out_features} output features must be a "
                f"multiple of {GEMM_ALIGNMENT} for FP8 GEMMs."
            )
        # All experts in one cast, each expert's `[out, in]` the rows of one group (unpadded).
        with torch.no_grad():
            cast = quantize_experts(
                weight.detach().reshape(-1, in_features),
                _stacked_rows(experts, out_features, weight.device),
                WEIGHT_DTYPE,
            )
        return cls(cast.data.view(weight.shape), cast.scale_invs)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, index: int) -> Fp8Weight:
        """Expert `index`'s weight (a view of the stacked bytes)."""
        return self.experts[index]

    @property
    def experts(self) -> list[Fp8Weight]:
        """Every expert's weight, made at the first use (with the transposes, once made)."""
        if self._experts is None:
            scale_invs = aligned_scale_invs(self._scale_invs)
            self._experts = [Fp8Weight(Fp8Tensor(d, s)) for d, s in zip(self.data, scale_invs)]
            if self._stacked_transposes is not None:
                self._hold_transposes()
        return self._experts

    @property
    def strided_scale_invs(self) -> torch.Tensor:
        """The experts' multipliers, `[num_experts]` fp32 as given (any stride: what the Triton
        grouped GEMMs read)."""
        return self._scale_invs

    def scale_invs(self) -> torch.Tensor:
        """The experts' multipliers, `[num_experts]` fp32 contiguous (made once per copy)."""
        if self._stacked_scale_invs is None:
            self._stacked_scale_invs = self._scale_invs.contiguous()
        return self._stacked_scale_invs

    def grouped_fprop_operand(self) -> torch.Tensor:
        """`W^T` per expert, `[num_experts, in, out]` column-major in its last two dimensions:
        the second operand of a grouped `X W^T`."""
        return self.data.transpose(1, 2)

    def grouped_dgrad_operand(self) -> torch.Tensor:
        """`W` per expert, `[num_experts, out, in]` column-major in its last two dimensions:
        the second operand of a grouped `dY W`, a view of the experts' contiguous transposes
        (`transposes`)."""
        return self.transposes().transpose(1, 2)

    def transposes(self) -> torch.Tensor:
        """The experts' contiguous transposes, `[num_experts, in, out]`, made once per copy for
        all the experts at once; each expert's `dgrad_operand` is then a view of them."""
        if self._stacked_transposes is None:
            data = self.data
            if launches_on(data) and data.is_contiguous():
                stacked = kernels.transpose_fp8(data)  # one launch for every expert
            else:  # as bytes: every build's copy kernels take them
                stacked = data.view(torch.uint8).transpose(1, 2).contiguous().view(WEIGHT_DTYPE)
            self._stacked_transposes = stacked
            if self._experts is not None:
                self._hold_transposes()
        return self._stacked_transposes

    def _hold_transposes(self) -> None:
        """The experts' own transposes become views of the stack: one copy is held, and the
        per-expert input-gradient GEMMs make none."""
        for expert, transposed in zip(self._experts, self._stacked_transposes):
            expert.hold_transpose(Fp8Tensor(transposed, expert.tensor.scale_inv))


def quantized_weight(weight: torch.Tensor, blockwise: bool = False) -> Fp8Weight | Fp8ExpertWeights:
    """`weight` cast to FP8: per tensor (2-D; per 128x128 block where `blockwise`), or per expert
    (3-D, stacked expert weights).

    Raises:
        ValueError: `blockwise` stacked expert weights (not built).
    """
    if weight.dim() != 3:
        return Fp8Weight.quantized(weight, blockwise)
    if blockwise:
        raise ValueError(
            "blockwise FP8 experts are not built; use fp8_recipe 'tensorwise' or 'delayed' for "
            "an MoE model."
        )
    return Fp8ExpertWeights.quantized(weight)


Provider = Callable[[torch.nn.Parameter], "Fp8Weight | Fp8ExpertWeights | None"]
"""The engine's FP8 copy of a parameter, or None where it does not follow the parameter now."""

_providers: dict[int, tuple[weakref.ref, weakref.WeakMethod | Callable]] = {}
"""id(parameter) -> (a weak reference to it, its provider)."""

_cache: dict[int, tuple[weakref.ref, tuple, Fp8Weight | Fp8ExpertWeights]] = {}
"""id(parameter) -> (a weak reference to it, the signals its copy was made at, the copy)."""

_optimizer_steps = 0
_step_hook: Any = None


def _count_step(*unused: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def register_fp8_weight(param: torch.nn.Parameter, provider: Provider) -> None:
    """Makes `fp8_weight_of(param)` return `provider(param)` while `param` lives, unless that
    is None (a bound method is held weakly: a dead engine's parameters fall back to the
    cache). A later registration for `param` replaces this one."""
    key = id(param)
    held = weakref.WeakMethod(provider) if hasattr(provider, "__self__") else provider
    _providers[key] = (weakref.ref(param, _forgetter(_providers, key)), held)


def forget_fp8_weights(params: Iterable[torch.Tensor]) -> None:
    """Drops the cached FP8 copies of `params` (their values changed, or their memory is
    freed): the next use makes them again."""
    if not _cache:  # bf16 training calls this at every unshard: no per-parameter work there
        return
    for param in params:
        _cache.pop(id(param), None)


def fp8_weight_of(weight: torch.Tensor, blockwise: bool = False) -> Fp8Weight | Fp8ExpertWeights:
    """The FP8 copy of `weight` (module docstring): an `Fp8Weight` for a 2-D weight (in 128x128
    blocks where `blockwise`), an `Fp8ExpertWeights` for stacked expert weights (3-D).

    Raises:
        ValueError: `blockwise`, and an engine keeps the parameter's FP8 copy (per tensor).
    """
    key = id(weight)
    entry = _providers.get(key)
    if entry is not None:
        provider = entry[1]() if isinstance(entry[1], weakref.WeakMethod) else entry[1]
        if provider is not None and blockwise:
            raise ValueError(
                "fp8_param_gather keeps FP8 weights scaled per tensor, and the blockwise recipe "
                "scales them per 128x128 block: not built; drop fp8_param_gather "
                "(--fp8-param-gather) or use fp8_recipe 'tensorwise' or 'delayed'."
            )
        made = provider(weight) if provider is not None else None
        if made is not None:
            return made
    if not isinstance(weight, torch.nn.Parameter) or cuda_graph_capturing():
        return quantized_weight(weight, blockwise)
    _watch_optimizer_steps()
    # The address too: a `.data` swap (`model.cuda()`, `model.to(dtype)`) bumps no version.
    signals = (weight._version, _optimizer_steps, weight.data_ptr(), weight.dtype, blockwise)
    cached = _cache.get(key)
    if cached is not None and cached[1] == signals:
        return cached[2]
    made = quantized_weight(weight, blockwise)
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
