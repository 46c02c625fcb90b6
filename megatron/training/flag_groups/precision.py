"""Mixed-precision flags: Megatron-LM's "mixed precision" group, its FP8 / FP4 flags, and their
checks.

`--fp16` trains with fp16 compute weights, fp32 main weights and loss scaling (dynamic unless
`--loss-scale`); `--bf16` with bf16 compute weights and fp32 main weights. Gradients accumulate
and reduce in fp32 with `--accumulate-allreduce-grads-in-fp32` (or this project's older name,
`--grad-reduce-in-fp32`), and, as in Megatron-LM, by default under `--bf16` with the DDP engine
unless `--grad-reduce-in-bf16` (see `grad_reduce_in_fp32`).

FP8 training of the transformer layers' linears is built (`megatron.core.fp8`): `--fp8-format`,
`--fp8-recipe` (delayed, tensorwise, blockwise) and their options set `TransformerConfig`
fields, which check them (`configs_from_args` names the flags in their errors);
`--fp8-param-gather` (not with blockwise scaling) and `--keep-fp8-transpose-cache` set the
`DistributedDataParallelConfig` fields of their names, which check them. The MXFP8 /
custom-recipe flags and FP4 are not built: their flags parse with Megatron-LM's names, types and
defaults so that launch scripts parse, and `validate_precision` refuses any value other than the
default, naming what is not built.
"""

from __future__ import annotations

import argparse
from typing import Any

DYNAMIC_LOSS_SCALE_DEFAULTS: dict[str, Any] = {
    "initial_loss_scale": 2.0**32,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
}
"""The dynamic loss-scaling flags and Megatron-LM's defaults for them."""

FP8_FIELDS = (
    "fp8",
    "fp8_recipe",
    "fp8_margin",
    "fp8_interval",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
)
"""The FP8 flags that set `TransformerConfig` fields of the same names (which check them)."""

_FP4 = "FP4 training is not built in this project (train with --bf16 or --fp8-format)"

UNBUILT_DEFAULTS: dict[str, tuple[Any, str]] = {
    "fp8_quantizer_factory": (
        None,
        "custom FP8 recipes need Transformer Engine's quantizer factories, which are not built",
    ),
    "fp8_output_proj": (False, "the MXFP8 output projection is not built"),
    "reuse_grad_buf_for_mxfp8_param_ag": (False, "MXFP8 parameter all-gathers are not built"),
    "fp4": (None, _FP4),
    "fp4_recipe": ("nvfp4", _FP4),
    "fp4_param_gather": (False, _FP4),
    "fp4_quantizer_factory": (None, _FP4),
}
"""Each unbuilt FP8 / FP4 flag's destination, Megatron-LM's default (any other value is
refused) and what is not built."""

_FLAG_NAMES = {
    "fp8": "--fp8-format",
    "fp8_wgrad": "--no-fp8-wgrad",
    "fp4": "--fp4-format",
}
"""Destinations whose flag is not `--` + the destination with dashes."""


def add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    """The "mixed precision" group and the FP8 / FP4 flags (Megatron-LM's "transformer
    configuration" and "Transformer-Engine" groups)."""
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument(
        "--disable-bf16-reduced-precision-matmul",
        action="store_true",
        help="bf16 GEMMs on CUDA accumulate without reduced-precision reductions "
        "(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False).",
    )
    group.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 compute weights, fp32 main weights, loss scaling.",
    )
    group.add_argument(
        "--bf16", action="store_true", help="bf16 compute weights, fp32 main weights."
    )
    group.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="Static loss scaling (a positive power of 2 helps fp16 convergence). If None, "
        "dynamic loss scaling is used with --fp16.",
    )
    group.add_argument(
        "--initial-loss-scale",
        type=float,
        default=DYNAMIC_LOSS_SCALE_DEFAULTS["initial_loss_scale"],
        help="Initial loss-scale for dynamic loss scaling.",
    )
    group.add_argument(
        "--min-loss-scale",
        type=float,
        default=DYNAMIC_LOSS_SCALE_DEFAULTS["min_loss_scale"],
        help="Minimum loss scale for dynamic loss scaling.",
    )
    group.add_argument(
        "--loss-scale-window",
        type=float,
        default=DYNAMIC_LOSS_SCALE_DEFAULTS["loss_scale_window"],
        help="Window over which to raise/lower dynamic scale.",
    )
    group.add_argument(
        "--hysteresis",
        type=int,
        default=DYNAMIC_LOSS_SCALE_DEFAULTS["hysteresis"],
        help="hysteresis for dynamic loss scaling",
    )
    group.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Gradient accumulation and all-reduce in fp32.",
    )
    group.add_argument(
        "--attention-softmax-in-fp32",
        action="store_true",
        help="Attention masking and softmax in fp32 (the local backend; SDPA kernels always).",
    )
    group.add_argument(
        "--grad-reduce-in-fp32",
        action="store_true",
        help="Gradient accumulation and all-reduce in fp32 (this project's older name).",
    )
    group.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="Reduce gradients in bfloat16 (with --bf16, where the DDP engine reduces in fp32).",
    )
    _add_fp8_args(parser)


def _add_fp8_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="fp8 / fp4")
    group.add_argument(
        "--fp8-format",
        dest="fp8",
        choices=["e4m3", "hybrid"],
        default=None,
        help="Train the linear layers of the transformer layers in FP8: e4m3 throughout, or "
        "hybrid (E5M2 output gradients).",
    )
    group.add_argument(
        "--fp8-recipe",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"],
        default="delayed",
        help="How FP8 scales are chosen: delayed (amax history), tensorwise (current "
        "scaling) or blockwise (per 1x128 / 128x128 block, with --fp8-format e4m3); mxfp8 and "
        "custom are not built.",
    )
    group.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="All-gather the weights of the FP8 linear layers as FP8 bytes, cast once per step "
        "(Megatron-FSDP, which also keeps them in FP8, or the DDP engine with "
        "--use-distributed-optimizer).",
    )
    group.add_argument("--fp8-quantizer-factory", type=str, default=None)
    group.add_argument(
        "--fp8-margin", type=int, default=0, help="Delayed scaling: scale margin (powers of 2)."
    )
    group.add_argument(
        "--fp8-interval", type=int, default=1, help="Deprecated and ignored, as upstream."
    )
    group.add_argument(
        "--fp8-amax-history-len",
        type=int,
        default=1,
        help="Delayed scaling: length of the amax history window.",
    )
    group.add_argument(
        "--fp8-amax-compute-algo",
        choices=["most_recent", "max"],
        default="most_recent",
        help="Delayed scaling: the amax the scale comes from.",
    )
    group.add_argument(
        "--no-fp8-wgrad",
        "--disable-fp8-wgrad",
        dest="fp8_wgrad",
        action="store_false",
        help="Compute the weight gradients in high precision.",
    )
    group.add_argument("--fp8-output-proj", action="store_true")
    group.add_argument(
        "--first-last-layers-bf16",
        action="store_true",
        help="Keep the first and last transformer layers in high precision (not with delayed "
        "scaling).",
    )
    group.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    group.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)
    group.add_argument(
        "--keep-fp8-transpose-cache",
        action="store_true",
        help="Megatron-FSDP, --fp8-param-gather: keep FP8 weights' transposes until the next "
        "step (1 byte per FP8 weight element) instead of making them in each backward.",
    )
    group.add_argument("--reuse-grad-buf-for-mxfp8-param-ag", action="store_true")
    group.add_argument("--fp4-format", dest="fp4", choices=["e2m1"], default=None)
    group.add_argument("--fp4-recipe", choices=["nvfp4", "custom"], default="nvfp4")
    group.add_argument("--fp4-param-gather", action="store_true")
    group.add_argument("--fp4-quantizer-factory", type=str, default=None)


def _flag(dest: str) -> str:
    return _FLAG_NAMES.get(dest, "--" + dest.replace("_", "-"))


def grad_reduce_in_fp32(args: argparse.Namespace) -> bool:
    """Whether gradients accumulate and reduce in fp32 (`DistributedDataParallelConfig.
    grad_reduce_in_fp32`): asked for by name, or by default under `--bf16` with the DDP engine
    unless `--grad-reduce-in-bf16`.

    Megatron-LM's `validate_args` turns `accumulate_allreduce_grads_in_fp32` on under `--bf16`,
    but its Megatron-FSDP ignores that field: its gradients take
    `--megatron-fsdp-main-grads-dtype`, whose `auto` is the model's dtype. So the default stays
    off under `--use-megatron-fsdp`, where this project's adapter would honour it.
    """
    if args.accumulate_allreduce_grads_in_fp32 or args.grad_reduce_in_fp32:
        return True
    return args.bf16 and not args.grad_reduce_in_bf16 and not args.use_megatron_fsdp


def validate_precision(args: argparse.Namespace) -> None:
    """Refuses contradictory or unused precision flags and the unbuilt FP8 / FP4 flags (the
    built FP8 flags are checked by `TransformerConfig`).

    Raises:
        ValueError: the message names the flag and the fix.
    """
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are both given; keep one of them.")
    if args.fp8_param_gather and args.fp8 is None:
        # Before the model exists: FullyShardedDataParallel refuses it too, for library code.
        raise ValueError(
            "--fp8-param-gather gathers the weights of FP8 linear layers, and without "
            "--fp8-format there are none: add --fp8-format or drop --fp8-param-gather."
        )
    if args.fp8_param_gather and args.fp8_recipe == "blockwise" and args.fp8 is not None:
        # FullyShardedDataParallel refuses it too, for library code.
        raise ValueError(
            "--fp8-param-gather with --fp8-recipe blockwise: the FP8 weights are gathered with "
            "one scale per tensor, and blockwise needs one per 128x128 block (not built); drop "
            "--fp8-param-gather or use --fp8-recipe tensorwise or delayed."
        )
    for dest, (default, unbuilt) in UNBUILT_DEFAULTS.items():
        value = getattr(args, dest)
        if value != default:
            spelled = _flag(dest) if isinstance(value, bool) else f"{_flag(dest)} {value}"
            raise ValueError(f"{spelled}: {unbuilt}; drop {_flag(dest)}.")
    _validate_loss_scaling(args)
    fp32_flags = [
        _flag(dest)
        for dest in ("accumulate_allreduce_grads_in_fp32", "grad_reduce_in_fp32")
        if getattr(args, dest)
    ]
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            raise ValueError(
                "--grad-reduce-in-bf16 applies to --bf16 only (it keeps bf16 gradients, which "
                "otherwise reduce in fp32); add --bf16 or drop --grad-reduce-in-bf16."
            )
        if fp32_flags:
            raise ValueError(
                f"--grad-reduce-in-bf16 contradicts {fp32_flags[0]}; keep one of them."
            )


def _validate_loss_scaling(args: argparse.Namespace) -> None:
    if args.loss_scale is not None:
        if not (args.fp16 or args.bf16):
            raise ValueError(
                f"--loss-scale {args.loss_scale} applies to --fp16 or --bf16 only (fp32 "
                "training scales no loss); add one of them or drop --loss-scale."
            )
    dynamic = args.fp16 and args.loss_scale is None
    for dest, default in DYNAMIC_LOSS_SCALE_DEFAULTS.items():
        value = getattr(args, dest)
        if value != default and not dynamic:
            raise ValueError(
                f"{_flag(dest)} {value} applies to dynamic loss scaling only (--fp16 without "
                "--loss-scale); drop it, or use --fp16 without --loss-scale."
            )
    if args.min_loss_scale > args.initial_loss_scale:
        raise ValueError(
            f"--min-loss-scale {args.min_loss_scale} must be in (0, --initial-loss-scale "
            f"{args.initial_loss_scale}]."
        )
    window = args.loss_scale_window
    if window != int(window):
        raise ValueError(f"--loss-scale-window {window} must be a whole number.")
    if args.hysteresis < 1:
        raise ValueError(f"--hysteresis {args.hysteresis} must be >= 1.")
