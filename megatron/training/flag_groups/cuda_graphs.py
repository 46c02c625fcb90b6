"""CUDA-graph flags, with Megatron-LM's names: `--cuda-graph-impl`, `--cuda-graph-scope`,
`--cuda-graph-warmup-steps`, and what a graphed training iteration needs of the other flags.

Built: the whole training iteration in one CUDA graph (`megatron.training.cuda_graphs`), asked
for as `--cuda-graph-impl full_iteration` (upstream's current spelling) or `--cuda-graph-impl
local --cuda-graph-scope full_iteration` (its earlier one, which upstream still accepts), MoE
models included where their layers read nothing on the host (`_moe_host_reads`).
Per-layer graphs (`local` with another scope, `transformer_engine`) and inference graphs are not
built; asking for them is refused with what to use instead, as is every flag whose work needs the
host inside the iteration (`validate_cuda_graphs`).
"""

from __future__ import annotations

import argparse

import torch

from megatron.core.transformer.moe.experts import grouped_fp8_takes_device_counts

CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
CUDA_GRAPH_SCOPES = (
    "full",
    "attn",
    "mlp",
    "moe",
    "moe_router",
    "moe_preprocess",
    "mamba",
    "full_iteration",
    "full_iteration_inference",
)
"""Upstream's values (`full`: the deprecated name of the whole layer; `full_iteration*`: the
deprecated spelling of whole-iteration graphs)."""

DEFAULT_WARMUP_STEPS = 3


def add_cuda_graph_args(parser: argparse.ArgumentParser) -> None:
    """The "cuda graphs" group."""
    group = parser.add_argument_group(title="cuda graphs")
    group.add_argument(
        "--cuda-graph-impl",
        default="none",
        choices=CUDA_GRAPH_IMPLS,
        help="full_iteration (or local with --cuda-graph-scope full_iteration): capture the "
        "whole training iteration in one CUDA graph and replay it; local's per-layer graphs and "
        "transformer_engine are not built.",
    )
    group.add_argument(
        "--cuda-graph-scope",
        nargs="+",
        choices=CUDA_GRAPH_SCOPES,
        help="With --cuda-graph-impl local: full_iteration, the only scope built.",
    )
    group.add_argument(
        "--cuda-graph-warmup-steps",
        type=int,
        default=DEFAULT_WARMUP_STEPS,
        help="Training iterations run eagerly before the capture.",
    )


def full_iteration_cuda_graph(args: argparse.Namespace) -> bool:
    """Whether the flags ask for the whole training iteration in a CUDA graph."""
    if args.cuda_graph_impl == "full_iteration":
        return True
    return args.cuda_graph_impl == "local" and "full_iteration" in (args.cuda_graph_scope or ())


def _spelled(args: argparse.Namespace) -> str:
    """The graph flags as given, for messages."""
    spelled = f"--cuda-graph-impl {args.cuda_graph_impl}"
    if args.cuda_graph_scope:
        spelled += f" --cuda-graph-scope {' '.join(args.cuda_graph_scope)}"
    return spelled


def validate_cuda_graphs(args: argparse.Namespace) -> None:
    """Refuses the graph flags that ask for what is not built, and with a full-iteration graph
    every flag whose work needs the host inside the iteration (a graph replays device work
    only) or changes between iterations what the graph holds fixed.

    Raises:
        ValueError: the message names the flag(s) and the fix.
    """
    _validate_impl_and_scope(args)
    if not full_iteration_cuda_graph(args):
        if args.cuda_graph_warmup_steps != DEFAULT_WARMUP_STEPS:
            raise ValueError(
                f"--cuda-graph-warmup-steps {args.cuda_graph_warmup_steps} applies to CUDA "
                "graphs only: add --cuda-graph-impl full_iteration or drop the flag."
            )
        return
    graphs = _spelled(args)
    if args.cuda_graph_warmup_steps < 1:
        raise ValueError(
            f"--cuda-graph-warmup-steps {args.cuda_graph_warmup_steps} must be >= 1: the "
            "optimizer creates its state in its first step, which a graph cannot capture."
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"{graphs} needs CUDA, which is not available; drop it to train without graphs."
        )
    if args.distributed_backend != "nccl":
        raise ValueError(
            f"{graphs} needs --distributed-backend nccl (a graph captures NCCL collectives), "
            f"not {args.distributed_backend}."
        )
    for refused, message in _refusals(args):
        if refused:
            raise ValueError(f"{graphs}: {message}.")


def _validate_impl_and_scope(args: argparse.Namespace) -> None:
    """Refuses the implementations and scopes that are not built, and a scope that would be
    ignored."""
    scopes = args.cuda_graph_scope or []
    impl = args.cuda_graph_impl
    if impl == "transformer_engine":
        raise ValueError(
            "--cuda-graph-impl transformer_engine: Transformer Engine's per-layer CUDA graphs "
            "are not built in this project; use --cuda-graph-impl full_iteration (the whole "
            "training iteration in one graph) or drop the flag."
        )
    if scopes and impl == "none":
        raise ValueError(
            f"--cuda-graph-scope {' '.join(scopes)} needs --cuda-graph-impl local; for the whole "
            "training iteration in one graph pass --cuda-graph-impl full_iteration alone."
        )
    others = [scope for scope in scopes if scope != "full_iteration"]
    if others:
        raise ValueError(
            f"{_spelled(args)}: only the full_iteration scope is built (the whole training "
            f"iteration in one graph); per-layer and inference graphs ({', '.join(others)}) "
            "are not. Pass --cuda-graph-scope full_iteration."
        )
    if impl == "local" and not scopes:
        raise ValueError(
            "--cuda-graph-impl local without --cuda-graph-scope asks for per-layer CUDA graphs, "
            "which are not built in this project; add --cuda-graph-scope full_iteration (the "
            "whole training iteration in one graph), or use --cuda-graph-impl full_iteration."
        )


def _moe_host_reads(args: argparse.Namespace) -> list[str]:
    """What makes the MoE layers read their token counts on the host (none for a dense model):
    the flags to add or drop, as `docs/moe.md` ("Host reads") lists them."""
    if args.num_experts is None:
        return []
    missing = []
    if args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor >= 0:
        missing.append("drop --moe-expert-capacity-factor")
    if not args.moe_grouped_gemm:
        missing.append("add --moe-grouped-gemm")
    if not args.bf16:
        missing.append("add --bf16 (the grouped GEMM's kernel; other dtypes read on the host)")
    if args.fp8 is not None:
        missing += _fp8_expert_host_reads(args)
    exchange = args.expert_model_parallel_size * args.expert_tensor_parallel_size
    if exchange > 1 and not args.moe_pad_dispatch_to_worst_case:
        missing.append("add --moe-pad-dispatch-to-worst-case")
    return missing


def _fp8_expert_host_reads(args: argparse.Namespace) -> list[str]:
    """What makes grouped FP8 experts read their counts on the host: they take them on the
    device through their Triton kernels only (`grouped_fp8_takes_device_counts`), with FP8
    weight gradients."""
    if not args.fp8_wgrad:
        return ["drop --no-fp8-wgrad (the high-precision weight gradients read on the host)"]
    if not grouped_fp8_takes_device_counts():
        return [
            f"drop --fp8-format {args.fp8} (the FP8 experts' grouped kernels, which take the "
            "counts on the device, need Triton and a GPU of compute capability 9.0 or later)"
        ]
    return []


def _moe_refusal(args: argparse.Namespace) -> str:
    missing = _moe_host_reads(args)
    return (
        "MoE layers (--num-experts) size their token exchange or their experts' GEMMs on the "
        "host unless they are dropless, with --moe-grouped-gemm in bf16 (in FP8 on Hopper or "
        "newer), and with expert parallelism with --moe-pad-dispatch-to-worst-case; "
        f"{'; '.join(missing)}, or drop the graph flags"
    )


def _refusals(args: argparse.Namespace) -> list[tuple[bool, str]]:
    """(set, why and what to do) for each flag a full-iteration graph cannot honour."""
    tp = args.tensor_model_parallel_size > 1
    return [
        (
            args.use_megatron_fsdp and args.fsdp_all_gather_in_start_param_sync,
            "--fsdp-all-gather-in-start-param-sync (on by default) starts the first unit's "
            "all-gather before the iteration, on a stream the graph does not capture; pass "
            "--no-fsdp-all-gather-in-start-param-sync",
        ),
        (
            args.fp16 or args.loss_scale is not None,
            "loss scaling (--fp16, --loss-scale) decides on the host whether a step overflowed; "
            "train with --bf16 (without --loss-scale) or fp32",
        ),
        (
            args.rampup_batch_size is not None or args.step_batch_size_schedule is not None,
            "a batch-size schedule (--rampup-batch-size, --step-batch-size-schedule) changes "
            "the number of microbatches, which a graph holds fixed; drop the schedule",
        ),
        (bool(_moe_host_reads(args)), _moe_refusal(args)),
        (
            args.recompute_granularity is not None,
            "activation recomputation (--recompute-granularity) saves the random-generator "
            "state on the host; drop it or the graph flags",
        ),
        (
            args.sequence_parallel or (tp and args.attention_dropout > 0),
            "the tensor-parallel random-generator states (used under --sequence-parallel, and "
            "by attention dropout under tensor parallelism) are swapped on the host; drop "
            "--sequence-parallel and set --attention-dropout 0",
        ),
        (
            args.empty_unused_memory_level > 0,
            f"--empty-unused-memory-level {args.empty_unused_memory_level} empties the "
            "allocator's cache inside the iteration; drop it",
        ),
        (
            args.weight_decay_incr_style != "constant",
            f"--weight-decay-incr-style {args.weight_decay_incr_style} changes the weight "
            "decay, which the graph's optimizer step holds fixed; use a constant weight decay",
        ),
    ]
