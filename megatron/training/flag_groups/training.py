"""Training-loop flags: batch, iterations, optimizer choice, kernel-fusion switches, validation.

The recompute flags are in `flag_groups.transformer` (they are `TransformerConfig` fields).
"""

from __future__ import annotations

import argparse

from megatron.core.optimizer.optimizer_config import OPTIMIZERS
from megatron.training.determinism import check_deterministic_mode
from megatron.training.flag_groups.training_schedule import add_training_schedule_args

FUSION_TOGGLES: tuple[tuple[str, str], ...] = (
    ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
    ("--no-bias-gelu-fusion", "bias_gelu_fusion"),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
)
"""Upstream's kernel-fusion switches (flag, dest) that are no-ops here, all `store_false`
(fusion on by default)."""


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The "training" group: batch sizes, iterations, optimizer choice, fusion switches."""
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, help="Sequences per rank per forward.")
    group.add_argument(
        "--global-batch-size", type=int, help="Sequences per step; None: micro x data-parallel."
    )
    group.add_argument("--train-iters", type=int, help="Optimizer steps.")
    group.add_argument("--exit-interval", type=int, help="Exit at an iteration divisible by it.")
    add_training_schedule_args(group)
    # Kernel-fusion switches: Megatron-LM picks fused CUDA kernels with them. Here the model
    # runs PyTorch's kernels whatever they say, and no result depends on them: accepted, no-ops.
    for flag, dest in FUSION_TOGGLES:
        group.add_argument(flag, action="store_false", dest=dest, help="Accepted; a no-op here.")
    group.add_argument(
        "--no-bias-swiglu-fusion",
        action="store_false",
        dest="bias_swiglu_fusion",
        help="Run --swiglu's activation with PyTorch's ops instead of the fused Triton kernels "
        "(used by default where Triton and CUDA are present).",
    )
    group.add_argument(
        "--no-rope-fusion",
        action="store_false",
        dest="apply_rope_fusion",
        help="Rotate queries and keys with PyTorch's elementwise ops instead of the fused Triton "
        "kernel (used by default where Triton and CUDA are present).",
    )
    group.add_argument(
        "--no-gradient-accumulation-fusion",
        action="store_false",
        dest="gradient_accumulation_fusion",
        help="Compute linear layers' weight gradients in the parameters' dtype and add them to "
        "main_grad afterwards, instead of accumulating them into main_grad in the GEMM (DDP "
        "engine; Megatron-FSDP's whole sums with --megatron-fsdp-accumulate-unsharded-grads).",
    )
    group.add_argument(
        "--compile-layers",
        action="store_true",
        help="torch.compile each transformer layer (norms, residual adds, rotary embeddings, "
        "activations and attention fuse; a layer is one graph, with or without "
        "gradient-accumulation fusion). Costs compile time at the first steps. Not a "
        "Megatron-LM flag.",
    )
    group.add_argument(
        "--compile-backend",
        default="inductor",
        help="The torch.compile backend of --compile-layers (aot_eager: trace without "
        "generating kernels, to tell a compiler problem from a model one).",
    )
    group.add_argument(
        "--no-compile-cpp-wrapper",
        action="store_false",
        dest="compile_cpp_wrapper",
        help="Have inductor launch --compile-layers' kernels from generated Python code "
        "instead of generated C++ (its cpp_wrapper; on CUDA), which costs more host time per "
        "step and less compile time.",
    )
    group.add_argument(
        "--use-mcore-models",
        action="store_true",
        dest="deprecated_use_mcore_models",
        help="Deprecated upstream (Megatron-core models are the only ones); a no-op.",
    )
    group.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="Bitwise-reproducible runs: torch.use_deterministic_algorithms(True) and upstream's "
        "environment (NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8, unless set to another deterministic value). Slower.",
    )
    group.add_argument("--optimizer", default="adam", choices=OPTIMIZERS, help="adam is AdamW.")
    group.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Raise on a NaN/Inf loss or global gradient norm.",
    )
    group.add_argument(
        "--manual-gc",
        action="store_true",
        help="Turn Python's automatic garbage collector off; collect at evaluations and every "
        "--manual-gc-interval iterations, at the same point on every rank.",
    )
    group.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="Iterations between collections with --manual-gc; 0: only around evaluations.",
    )
    group.add_argument(
        "--no-manual-gc-eval",
        "--disable-manual-gc-eval",
        action="store_false",
        dest="manual_gc_eval",
        help="With --manual-gc, do not collect before and after each evaluation.",
    )
    group.add_argument(
        "--empty-unused-memory-level",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="torch.cuda.empty_cache(): 1 after each forward-backward, 2 also after the "
        "optimizer step (GPU only).",
    )


def add_validation_args(parser: argparse.ArgumentParser) -> None:
    """The "validation" group."""
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-iters", type=int, default=100, help="Iterations per eval.")
    group.add_argument(
        "--eval-interval",
        type=int,
        help="Iterations between evaluations; None: only at the end of training.",
    )


def validate_training_operations(args: argparse.Namespace) -> None:
    """Checks the garbage-collection flags and `--deterministic-mode`.

    Raises:
        ValueError: `--manual-gc-interval` is negative, or set without `--manual-gc`; or
            `--deterministic-mode` with what would break it (`check_deterministic_mode`).
    """
    check_deterministic_mode(args)
    if args.manual_gc_interval < 0:
        raise ValueError(
            f"--manual-gc-interval {args.manual_gc_interval} must be at least 0 (0: collect "
            "only around evaluations)."
        )
    if args.manual_gc_interval and not args.manual_gc:
        raise ValueError(
            "--manual-gc-interval needs --manual-gc (the automatic collector runs otherwise)."
        )
