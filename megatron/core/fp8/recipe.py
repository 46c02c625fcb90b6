"""FP8 recipes: Megatron-LM's `--fp8-format` and `--fp8-recipe`, the checks of the config's FP8
fields, and which transformer layers train in FP8.

A format names the FP8 dtypes: `e4m3` uses E4M3 for every FP8 tensor; `hybrid` uses E4M3 for the
forward tensors (inputs, weights) and E5M2, whose range is wider, for the output gradients of
backward (Transformer Engine's `Format.HYBRID`). A recipe says how each tensor's scale is chosen:

- `delayed`: from the history of the tensor's absolute maxima in earlier passes
  (`--fp8-amax-history-len`, `--fp8-amax-compute-algo`, `--fp8-margin`; `scaling.py`);
- `tensorwise`: from the tensor's own absolute maximum, when it is cast ("current scaling");
- `blockwise`: DeepSeek-V3's, Transformer Engine's `Float8BlockScaling`: a power-of-2 scale per
  1x128 block of each activation and output gradient and per 128x128 block of each weight, from
  the block's own absolute maximum (`blockwise.py`). E4M3 throughout: torch's blockwise GEMM
  multiplies E4M3 only, so the `hybrid` format is refused with it.

Weights are scaled from their current absolute maximum under the per-tensor recipes
(`weights.py`). Upstream's `mxfp8` and `custom` recipes are refused by name
(`check_fp8_config`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
"""Upstream's `--fp8-recipe` choices."""
BUILT_RECIPES = ("tensorwise", "delayed", "blockwise")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")

_DELAYED_ONLY = {"fp8_margin": 0, "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent"}
"""The fields only delayed scaling reads, and their defaults."""

FP8_FIELD_DEFAULTS = {
    "fp8_recipe": "delayed",
    **_DELAYED_ONLY,
    "fp8_interval": 1,
    "fp8_wgrad": True,
    "first_last_layers_bf16": False,
    "num_layers_at_start_in_bf16": 1,
    "num_layers_at_end_in_bf16": 1,
}
"""`TransformerConfig`'s FP8 fields besides `fp8` itself, with Megatron-LM's defaults."""


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return torch.finfo(dtype).max


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a model's FP8 linear layers quantise.

    Attributes:
        format: "e4m3" or "hybrid".
        kind: "delayed", "tensorwise" or "blockwise".
        margin: delayed scaling's scale is `fp8_max * 2**-margin / amax`.
        amax_history_len: delayed scaling's window of absolute maxima.
        amax_compute_algo: "max" (over the window) or "most_recent".
        wgrad: the weight-gradient GEMM runs in FP8 (else in the input's precision).
    """

    format: str
    kind: str
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True

    # The derived attributes are computed once per recipe: the linear layers read them at
    # every call.

    @functools.cached_property
    def forward_dtype(self) -> torch.dtype:
        """The dtype of inputs and weights."""
        return torch.float8_e4m3fn

    @functools.cached_property
    def backward_dtype(self) -> torch.dtype:
        """The dtype of output gradients: E5M2 under `hybrid`."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    @functools.cached_property
    def delayed(self) -> bool:
        """Whether activations and gradients are scaled from their amax history."""
        return self.kind == "delayed"

    @functools.cached_property
    def blockwise(self) -> bool:
        """Whether tensors are scaled per block (1x128, weights 128x128)."""
        return self.kind == "blockwise"

    @functools.cached_property
    def fprop_fast_accum(self) -> bool:
        """Whether the forward GEMM accumulates with Hopper's fast FP8 accumulation, as upstream
        (the two backward GEMMs never do, and no blockwise GEMM: Transformer Engine's recipe
        requires split accumulation)."""
        return not self.blockwise

    def describe(self) -> str:
        """The recipe in words, for logs: "hybrid format, delayed scaling (amax history 1024,
        max, margin 0)"."""
        text = f"{self.format} format, {self.kind} scaling"
        if self.delayed:
            text += (
                f" (amax history {self.amax_history_len}, {self.amax_compute_algo}, "
                f"margin {self.margin})"
            )
        if self.blockwise:
            text += " (1x128 activations and gradients, 128x128 weights)"
        if not self.wgrad:
            text += ", weight gradients in high precision"
        return text


def recipe_from_config(config: TransformerConfig) -> Fp8Recipe | None:
    """The recipe `config` asks for (checked by `check_fp8_config`), or None without FP8."""
    if config.fp8 is None:
        return None
    return Fp8Recipe(
        format=config.fp8,
        kind=config.fp8_recipe,
        margin=config.fp8_margin,
        amax_history_len=config.fp8_amax_history_len,
        amax_compute_algo=config.fp8_amax_compute_algo,
        wgrad=config.fp8_wgrad,
    )


def is_first_last_bf16_layer(config: TransformerConfig, layer_no: int) -> bool:
    """Whether layer `layer_no` (0-based, global) stays in high precision under
    `first_last_layers_bf16`: the first `num_layers_at_start_in_bf16` and the last
    `num_layers_at_end_in_bf16` layers (Megatron-LM's rule)."""
    if not config.first_last_layers_bf16 or layer_no < 0:
        return False
    at_start = layer_no < config.num_layers_at_start_in_bf16
    at_end = layer_no >= config.num_layers - config.num_layers_at_end_in_bf16
    return at_start or at_end


def check_fp8_config(config: TransformerConfig) -> None:
    """Checks the FP8 fields of `config` once, in `TransformerConfig.__post_init__`.

    Raises:
        ValueError: a bad or unbuilt value, or fields that contradict each other; the message
            names the field and the fix.
    """
    if config.fp8 is None:
        for name, default in FP8_FIELD_DEFAULTS.items():
            value = getattr(config, name)
            if value != default:
                raise ValueError(
                    f"{name}={value!r} applies to FP8 training only; set fp8 ('e4m3' or "
                    f"'hybrid') or leave {name} at its default ({default!r})."
                )
        return
    if config.fp8 not in FORMATS:
        raise ValueError(f"fp8={config.fp8!r} is not an FP8 format; choose among {FORMATS}.")
    _check_recipe(config.fp8_recipe)
    if config.fp8_recipe != "delayed":
        for name, default in _DELAYED_ONLY.items():
            value = getattr(config, name)
            if value != default:
                raise ValueError(
                    f"{name}={value!r} applies to delayed scaling only, not to "
                    f"fp8_recipe={config.fp8_recipe!r}; drop {name} or use delayed."
                )
    if config.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(
            f"fp8_amax_compute_algo={config.fp8_amax_compute_algo!r}: choose among "
            f"{AMAX_COMPUTE_ALGOS}."
        )
    if not isinstance(config.fp8_amax_history_len, int) or config.fp8_amax_history_len < 1:
        raise ValueError(
            f"fp8_amax_history_len={config.fp8_amax_history_len!r} must be an integer >= 1."
        )
    if not isinstance(config.fp8_margin, int) or config.fp8_margin < 0:
        raise ValueError(f"fp8_margin={config.fp8_margin!r} must be an integer >= 0.")
    if config.fp8_interval != 1:
        # Upstream's warning: Transformer Engine ignores the interval since v1.8.
        warnings.warn(
            "fp8_interval is deprecated and ignored from Transformer-Engine v1.8.0.",
            stacklevel=3,
        )
    _check_bf16_layers(config)
    if config.fp8_recipe == "blockwise":
        _check_blockwise(config)


def _check_recipe(recipe: str) -> None:
    refusals = {
        "mxfp8": _mxfp8_refusal,
        "custom": lambda: (
            "custom recipes need Transformer Engine's quantizer factories, which are not built here"
        ),
    }
    if recipe in refusals:
        raise ValueError(
            f"fp8_recipe={recipe!r}: {refusals[recipe]()}; choose tensorwise, delayed or "
            "blockwise for fp8_recipe."
        )
    if recipe not in BUILT_RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r}: choose among {RECIPES}.")


def _check_blockwise(config: TransformerConfig) -> None:
    if config.fp8 == "hybrid":
        raise ValueError(
            "fp8_recipe='blockwise' with fp8='hybrid': torch's blockwise-scaled GEMM multiplies "
            "E4M3 operands only, and hybrid casts output gradients to E5M2; use fp8='e4m3' "
            "(the blockwise recipe's default format in Transformer Engine) or another "
            "fp8_recipe."
        )
    if config.num_moe_experts is not None:
        raise ValueError(
            f"fp8_recipe='blockwise' with num_moe_experts={config.num_moe_experts}: blockwise "
            "FP8 experts are not built; use fp8_recipe 'tensorwise' or 'delayed' for an MoE "
            "model."
        )


def _mxfp8_refusal() -> str:
    """Transformer Engine's message on GPUs older than Blackwell; "not built" on Blackwell."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if major >= 10:
            return "MXFP8 is not built yet"
        where = f"this GPU has {major}.{minor}"
    else:
        where = "no CUDA GPU is visible"
    return f"Device compute capability 10.0 or higher required for MXFP8 execution ({where})"


def _check_bf16_layers(config: TransformerConfig) -> None:
    counts = ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
    if not config.first_last_layers_bf16:
        for name in counts:
            value = getattr(config, name)
            if value != 1:
                raise ValueError(
                    f"{name}={value!r} applies with first_last_layers_bf16 only; set "
                    f"first_last_layers_bf16=True or drop {name}."
                )
        return
    if config.fp8_recipe == "delayed":
        # Upstream's rule: its delayed scaling reduces amaxes once for the whole block.
        raise ValueError(
            "Delayed scaling does not support first / last layer in BF16 "
            "(first_last_layers_bf16=True with fp8_recipe='delayed'); use tensorwise for "
            "fp8_recipe or drop first_last_layers_bf16."
        )
    per_stage = config.num_layers // config.pipeline_model_parallel_size
    for name in counts:
        value = getattr(config, name)
        if not isinstance(value, int) or not 0 <= value <= per_stage:
            raise ValueError(
                f"{name}={value!r} must be between 0 and the number of layers per pipeline "
                f"stage ({per_stage})."
            )
