"""Megatron-LM's command-line flags for GPT training: parse, validate, turn into configs.

`parse_args()` reads the flags (Megatron-LM's names and meanings; `docs/flags.md` lists them),
`validate_args()` fills the derived values (data-parallel size, FFN width, params dtype, ...) and
rejects bad combinations with a `ValueError` that names the flag and the fix, and the
`*_from_args` / `get_*` functions build what the library takes: `TransformerConfig`,
`DistributedDataParallelConfig` and the keyword arguments of
`parallel_state.initialize_model_parallel()`. A training script does:

    args = validate_args(parse_args())
    parallel_state.initialize_model_parallel(**get_parallel_state_kwargs(args))
    config = core_transformer_config_from_args(args)
    ddp_config = get_megatron_ddp_config(args)

There is no tensor or pipeline parallelism, so the data-parallel size is
world size / `--context-parallel-size`.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.distributed.distributed_data_parallel_config import (
    OUTER_SHARDING_STRATEGIES,
    SHARDING_STRATEGIES,
    DistributedDataParallelConfig,
)
from megatron.core.models.common.embeddings.language_model_embedding import (
    POSITION_EMBEDDING_TYPES,
)
from megatron.core.transformer.transformer_config import NORMALIZATIONS, TransformerConfig

CKPT_FORMATS = ("fsdp_dtensor", "torch_dist")
"""Checkpoint formats `--ckpt-format` accepts (saving and loading come in a later change)."""

FSDP_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "auto": None,
}
"""Values of the `--megatron-fsdp-*-dtype` flags; "auto" (None) lets the engine derive it."""

_FSDP_ONLY_FLAGS = (
    "data_parallel_sharding_strategy",
    "outer_dp_sharding_strategy",
    "num_distributed_optimizer_instances",
    "fsdp_all_gather_in_start_param_sync",
    "create_all_gather_group",
    "use_symm_mem",
    "overlap_param_gather",
    "megatron_fsdp_main_params_dtype",
    "megatron_fsdp_main_grads_dtype",
    "megatron_fsdp_grad_comm_dtype",
    "init_model_with_meta_device",
)
"""Destinations of flags only Megatron-FSDP reads: the DDP engine would ignore them."""

_DDP_ONLY_FLAGS = ("ddp_bucket_size", "ddp_average_in_collective")
"""Destinations of flags only the DDP engine reads: Megatron-FSDP would ignore them."""


def parse_args(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    ignore_unknown_args: bool = False,
    args: list[str] | None = None,
) -> argparse.Namespace:
    """Parses Megatron-LM's flags (no validation: see `validate_args`).

    Args:
        extra_args_provider: Adds a script's own flags: takes the parser and returns it.
        ignore_unknown_args: Ignore flags nobody defined instead of exiting with an error.
        args: The flags to parse; None reads `sys.argv[1:]`.

    Returns:
        The namespace; derived values are filled in by `validate_args`.
    """
    parser = argparse.ArgumentParser(
        description="Megatron-LM arguments; docs/flags.md explains each flag.",
        allow_abbrev=False,  # a typo must not silently select another flag
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        return parser.parse_known_args(args)[0]
    return parser.parse_args(args)


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every flag of this module to `parser`, in Megatron-LM's argument groups."""
    for add_group in (
        _add_network_size_args,
        _add_regularization_args,
        _add_training_args,
        _add_initialization_args,
        _add_learning_rate_args,
        _add_checkpointing_args,
        _add_mixed_precision_args,
        _add_distributed_args,
        _add_validation_args,
        _add_data_args,
        _add_tokenizer_args,
        _add_logging_args,
    ):
        add_group(parser)
    return parser


def _add_network_size_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, help="Number of transformer layers.")
    group.add_argument("--hidden-size", type=int, help="Transformer hidden size.")
    group.add_argument(
        "--ffn-hidden-size",
        type=int,
        help="MLP width; None: 4 x hidden, or int(4 x hidden x 2/3 / 64) x 64 with --swiglu.",
    )
    group.add_argument("--num-attention-heads", type=int, help="Number of query heads.")
    group.add_argument("--kv-channels", type=int, help="Head width; None: hidden / heads.")
    group.add_argument("--group-query-attention", action="store_true", help="Use GQA.")
    group.add_argument("--num-query-groups", type=int, help="Key/value heads with GQA.")
    group.add_argument(
        "--max-position-embeddings", type=int, help="Learned position rows; None: --seq-length."
    )
    group.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=POSITION_EMBEDDING_TYPES,
        help="Position encoding.",
    )
    group.add_argument("--rotary-base", type=int, default=10000, help="RoPE base period.")
    group.add_argument(
        "--rotary-percent", type=float, default=1.0, help="Fraction of head channels RoPE rotates."
    )
    group.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128, help="Pad the vocabulary."
    )
    group.add_argument(
        "--normalization", default="LayerNorm", choices=NORMALIZATIONS, help="Norm layers."
    )
    group.add_argument("--norm-epsilon", type=float, default=1e-5, help="Norm epsilon.")
    group.add_argument(
        "--apply-residual-connection-post-layernorm",
        action="store_true",
        help="Residual from the layer norm's output instead of its input.",
    )
    group.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated, SiLU).")
    group.add_argument(
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help="No bias in the linear layers (add_bias_linear, default %(default)s).",
    )
    group.add_argument("--add-qkv-bias", action="store_true", help="Bias in the QKV linear.")
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Own output layer instead of the word embeddings.",
    )
    group.add_argument(
        "--transformer-impl",
        default="local",
        choices=("local", "transformer_engine"),
        help="PyTorch layers, or Transformer Engine's (CUDA).",
    )


def _add_regularization_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="regularization")
    group.add_argument(
        "--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities."
    )
    group.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.1,
        help="Dropout on embeddings and residual branches.",
    )
    group.add_argument("--weight-decay", type=float, default=0.01, help="Constant weight decay.")
    group.add_argument("--start-weight-decay", type=float, help="Weight decay at iteration 0.")
    group.add_argument("--end-weight-decay", type=float, help="Weight decay at the end.")
    group.add_argument(
        "--weight-decay-incr-style",
        default="constant",
        choices=("constant", "linear", "cosine"),
        help="From --start- to --end-weight-decay.",
    )
    group.add_argument("--clip-grad", type=float, default=1.0, help="Max global grad norm.")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    group.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, help="Sequences per rank per forward.")
    group.add_argument(
        "--global-batch-size", type=int, help="Sequences per step; None: micro x data-parallel."
    )
    group.add_argument("--train-iters", type=int, help="Optimizer steps.")
    group.add_argument("--exit-interval", type=int, help="Exit at an iteration divisible by it.")
    group.add_argument(
        "--recompute-granularity", choices=("full", "selective"), help="Activation recompute."
    )
    group.add_argument("--recompute-method", choices=("uniform", "block"), help="Only uniform.")
    group.add_argument("--recompute-num-layers", type=int, help="Layers per chunk; only 1.")
    group.add_argument(
        "--optimizer", default="adam", choices=("adam", "sgd"), help="adam is AdamW."
    )
    group.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Raise on a NaN/Inf loss or (DDP engine) gradient.",
    )


def _add_initialization_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="initialization")
    group.add_argument("--seed", type=int, default=1234, help="Random seed.")
    group.add_argument(
        "--init-method-std", type=float, default=0.02, help="Std of the normal weight init."
    )


def _add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, help="Peak learning rate.")
    group.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
        help="Decay after warmup.",
    )
    group.add_argument("--lr-decay-iters", type=int, help="None: --train-iters.")
    group.add_argument(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
        help="Decay of the WSD annealing phase.",
    )
    group.add_argument("--lr-wsd-decay-iters", type=int, help="WSD annealing iterations.")
    group.add_argument(
        "--lr-warmup-iters", type=int, default=0, help="Iterations of linear warmup."
    )
    group.add_argument(
        "--lr-warmup-init", type=float, default=0.0, help="Learning rate warmup starts from."
    )
    group.add_argument(
        "--min-lr", type=float, default=0.0, help="Learning rate never decays below this."
    )


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", help="Checkpoint directory to save to.")
    group.add_argument("--save-interval", type=int, help="Iterations between saves.")
    group.add_argument("--load", help="Checkpoint directory to load from.")
    group.add_argument("--no-load-optim", action="store_true", help="Skip optimizer state.")
    group.add_argument("--no-load-rng", action="store_true", help="Skip RNG state.")
    group.add_argument(
        "--finetune", action="store_true", help="Load the model only; start at iteration 0."
    )
    group.add_argument(
        "--ckpt-format", default="torch_dist", choices=CKPT_FORMATS, help="Checkpoint format."
    )


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true", help="fp16 parameters and compute.")
    group.add_argument("--bf16", action="store_true", help="bf16 parameters and compute.")
    group.add_argument(
        "--grad-reduce-in-fp32",
        action="store_true",
        help="Accumulate and reduce gradients in fp32.",
    )


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Only 1.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Only 1.")
    group.add_argument("--context-parallel-size", type=int, default=1, help="dp = world / cp.")
    group.add_argument(
        "--expert-model-parallel-size", type=int, default=1, help="Ranks splitting MoE experts."
    )
    group.add_argument(
        "--distributed-backend", default="nccl", choices=("nccl", "gloo"), help="gloo on CPU."
    )
    group.add_argument(
        "--distributed-timeout-minutes", type=int, default=10, help="Collective timeout."
    )
    group.add_argument(
        "--overlap-grad-reduce", action="store_true", help="Reduce gradients during backward."
    )
    group.add_argument(
        "--overlap-param-gather", action="store_true", help="Megatron-FSDP: prefetch all-gathers."
    )
    group.add_argument("--ddp-bucket-size", type=int, help="DDP engine; None: automatic.")
    group.add_argument("--ddp-average-in-collective", action="store_true", help="ReduceOp.AVG.")
    group.add_argument("--use-megatron-fsdp", action="store_true", help="Megatron-FSDP engine.")
    group.add_argument(
        "--data-parallel-sharding-strategy",
        default="no_shard",
        choices=SHARDING_STRATEGIES,
        help="ZeRO-0/1/2/3.",
    )
    group.add_argument(
        "--outer-dp-sharding-strategy",
        default="no_shard",
        choices=OUTER_SHARDING_STRATEGIES,
        help="HSDP (no_shard) or HFSDP (optim).",
    )
    group.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="Outer replicas (HSDP / HFSDP).",
    )
    group.add_argument(
        "--fsdp-all-gather-in-start-param-sync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Off for CUDA-graph capture.",
    )
    group.add_argument(
        "--create-all-gather-group", action="store_true", help="Separate all-gather communicator."
    )
    group.add_argument("--use-symm-mem", action="store_true", help="CUDA and NCCL only.")
    dtypes = tuple(FSDP_DTYPES)
    group.add_argument(
        "--megatron-fsdp-main-params-dtype",
        default="fp32",
        choices=dtypes,
        help="Main (optimizer) weights.",
    )
    group.add_argument(
        "--megatron-fsdp-main-grads-dtype",
        default="auto",
        choices=dtypes,
        help="Gradient accumulation.",
    )
    group.add_argument(
        "--megatron-fsdp-grad-comm-dtype",
        default="auto",
        choices=dtypes,
        help="Gradient reduction.",
    )
    group.add_argument(
        "--init-model-with-meta-device",
        action="store_true",
        help="Build on meta; Megatron-FSDP materialises shards.",
    )


def _add_validation_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-iters", type=int, default=100, help="Iterations per eval.")
    group.add_argument(
        "--eval-interval", type=int, default=1000, help="Iterations between evaluations."
    )


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="data and dataloader")
    group.add_argument("--mock-data", action="store_true", help="Synthetic tokens.")
    group.add_argument("--data-path", nargs="*", help="Datasets on disk: not supported yet.")
    group.add_argument("--split", default="969,30,1", help="Train,valid,test weights.")
    group.add_argument("--seq-length", type=int, help="Tokens per sequence.")
    group.add_argument("--num-workers", type=int, default=2, help="Dataloader workers.")
    group.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")
    group.add_argument(
        "--reset-position-ids", action="store_true", help="Restart position ids after EOD."
    )
    group.add_argument(
        "--reset-attention-mask", action="store_true", help="Do not attend across EOD."
    )


def _add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--vocab-size", type=int, help="Token ids --mock-data draws from.")
    group.add_argument("--tokenizer-type", help="Not supported yet.")
    group.add_argument("--vocab-file", help="Not supported yet.")
    group.add_argument("--merge-file", help="Not supported yet.")
    group.add_argument("--tokenizer-model", help="Not supported yet.")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="logging")
    group.add_argument(
        "--log-interval", type=int, default=100, help="Iterations between log lines."
    )
    group.add_argument("--log-throughput", action="store_true", help="TFLOP/s and tokens/s.")
    group.add_argument("--tensorboard-dir", help="Needs the tensorboard package.")
    group.add_argument(
        "--tensorboard-log-interval", type=int, default=1, help="Iterations between writes."
    )
    group.add_argument("--wandb-project", help="Needs the wandb package.")
    group.add_argument("--wandb-exp-name", help="Run name.")


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Fills the derived values of `args` and rejects bad combinations of flags.

    Idempotent: a validated namespace validates again unchanged.

    Args:
        args: From `parse_args`.
        world_size: Number of ranks; None reads `WORLD_SIZE` from the environment (1 if unset).

    Returns:
        `args`, updated in place with `world_size`, `data_parallel_size`, `global_batch_size`,
        `num_microbatches`, `num_query_groups`, `kv_channels`, `ffn_hidden_size`,
        `max_position_embeddings`, `padded_vocab_size`, `params_dtype`, `lr_decay_iters`,
        `start_weight_decay` and `end_weight_decay`.

    Raises:
        ValueError: a flag is missing, out of range, contradicts another or needs something
            this machine lacks; the message names the flag(s) and the fix.
    """
    args.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    _check_required(args)
    _validate_parallelism(args)
    _validate_model(args)
    _validate_batch_and_optimizer(args)
    _validate_data(args)
    _validate_logging_and_checkpointing(args)
    # The configs check their own fields too; building them here turns any remaining error into
    # one at start-up rather than after the process groups exist.
    core_transformer_config_from_args(args)
    get_megatron_ddp_config(args)
    return args


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(dest: str, value: Any) -> str:
    """How the user spelled a flag that set `dest` to `value`."""
    if value is True:
        return _flag(dest)
    if value is False:
        return "--no-" + _flag(dest)[2:]
    return f"{_flag(dest)} {value}"


def _check_required(args: argparse.Namespace) -> None:
    for dest in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "train_iters",
        "lr",
    ):
        if getattr(args, dest) is None:
            raise ValueError(f"{_flag(dest)} is required; pass it on the command line.")
    for dest in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "train_iters",
        "global_batch_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "num_distributed_optimizer_instances",
        "lr_decay_iters",
        "lr_wsd_decay_iters",
        "num_query_groups",
        "kv_channels",
        "ffn_hidden_size",
        "max_position_embeddings",
        "vocab_size",
        "make_vocab_size_divisible_by",
        "log_interval",
        "tensorboard_log_interval",
        "eval_interval",
        "exit_interval",
        "save_interval",
    ):
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ValueError(f"{_flag(dest)} must be >= 1, got {value}.")
    for dest in ("eval_iters", "num_workers"):
        if getattr(args, dest) < 0:
            raise ValueError(f"{_flag(dest)} must be >= 0, got {getattr(args, dest)}.")


def _validate_parallelism(args: argparse.Namespace) -> None:
    world = args.world_size
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(args, dest) != 1:
            raise ValueError(
                f"{_flag(dest)}={getattr(args, dest)}: tensor and pipeline parallelism are not "
                f"supported; set {_flag(dest)} 1 and scale with data parallelism "
                "(--use-megatron-fsdp)."
            )
    for dest in ("context_parallel_size", "expert_model_parallel_size"):
        if world % getattr(args, dest):
            raise ValueError(
                f"The world size {world} is not divisible by {_flag(dest)} "
                f"{getattr(args, dest)}; choose a divisor of {world}."
            )
    args.data_parallel_size = world // args.context_parallel_size

    engine_flags, other_engine = (
        (_DDP_ONLY_FLAGS, "the DDP engine")
        if args.use_megatron_fsdp
        else (_FSDP_ONLY_FLAGS, "Megatron-FSDP")
    )
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    for dest in engine_flags:
        value = getattr(args, dest)
        if value != parser.get_default(dest):
            given = _given(dest, value)
            fix = (
                f"drop {given} or --use-megatron-fsdp"
                if args.use_megatron_fsdp
                else f"add --use-megatron-fsdp or drop {given}"
            )
            raise ValueError(
                f"{given} is read by {other_engine} only, which this run does not use; {fix}."
            )

    # The outer replicas cut the data x context-parallel group (every rank, as tp = pp = 1) and
    # the expert data-parallel group, as parallel_state lays them out.
    instances = args.num_distributed_optimizer_instances
    expert_dp = world // args.expert_model_parallel_size
    for size, what in (
        (world, "data-parallel x context-parallel size"),
        (expert_dp, "expert data-parallel size (world / --expert-model-parallel-size)"),
    ):
        if size % instances:
            raise ValueError(
                f"--num-distributed-optimizer-instances {instances} does not divide the {what} "
                f"{size}; choose a divisor of {size}."
            )

    if args.outer_dp_sharding_strategy == "optim":
        if args.data_parallel_sharding_strategy != "optim_grads_params":
            raise ValueError(
                "--outer-dp-sharding-strategy optim (HFSDP) needs "
                "--data-parallel-sharding-strategy optim_grads_params, got "
                f"{args.data_parallel_sharding_strategy}; change one of them."
            )
        if instances < 2:
            raise ValueError(
                "--outer-dp-sharding-strategy optim (HFSDP) needs an outer group: set "
                "--num-distributed-optimizer-instances > 1."
            )
    if args.use_symm_mem:
        if not torch.cuda.is_available():
            raise ValueError(
                "--use-symm-mem needs CUDA (NCCL symmetric memory), which is not available; "
                "drop --use-symm-mem."
            )
        if args.distributed_backend != "nccl":
            raise ValueError(
                "--use-symm-mem needs --distributed-backend nccl; change the backend or drop "
                "--use-symm-mem."
            )
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "--distributed-backend nccl needs CUDA, which is not available; use "
            "--distributed-backend gloo on CPU."
        )
    if args.grad_reduce_in_fp32 and args.megatron_fsdp_main_grads_dtype not in ("auto", "fp32"):
        raise ValueError(
            "--grad-reduce-in-fp32 contradicts --megatron-fsdp-main-grads-dtype "
            f"{args.megatron_fsdp_main_grads_dtype}; set only one of them."
        )


def _validate_model(args: argparse.Namespace) -> None:
    heads = args.num_attention_heads
    if args.group_query_attention:
        if args.num_query_groups is None:
            raise ValueError(
                "--group-query-attention needs --num-query-groups (the number of key/value "
                "heads); add it."
            )
    elif args.num_query_groups not in (None, heads):
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} is used only with "
            "--group-query-attention; add --group-query-attention or drop --num-query-groups."
        )
    else:
        args.num_query_groups = heads
    if heads % args.num_query_groups:
        raise ValueError(
            f"--num-attention-heads {heads} is not divisible by --num-query-groups "
            f"{args.num_query_groups}; choose a divisor of {heads}."
        )

    if args.kv_channels is None:
        if args.hidden_size % heads:
            raise ValueError(
                f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{heads}; change one of them or set --kv-channels."
            )
        args.kv_channels = args.hidden_size // heads
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Megatron's default: two fc1 projections of 2/3 the width keep the parameter count
            # of a 4h MLP, rounded down to a multiple of 64 for GEMM-friendly shapes.
            args.ffn_hidden_size = (8 * args.hidden_size // 3) // 64 * 64
            if args.ffn_hidden_size < 1:
                raise ValueError(
                    f"--swiglu with --hidden-size {args.hidden_size} gives a default MLP width "
                    "of 0 (int(4 x hidden x 2/3 / 64) x 64); set --ffn-hidden-size."
                )
        else:
            args.ffn_hidden_size = 4 * args.hidden_size

    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if (
        args.position_embedding_type == "learned_absolute"
        and args.seq_length > args.max_position_embeddings
    ):
        raise ValueError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings} of the learned position table; raise "
            "--max-position-embeddings or use --position-embedding-type rope."
        )

    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are both set; choose at most one.")
    args.params_dtype = (
        torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    )

    if args.recompute_granularity != "full":
        for dest in ("recompute_method", "recompute_num_layers"):
            if getattr(args, dest) is not None:
                raise ValueError(
                    f"{_flag(dest)} applies to --recompute-granularity full only; add it or "
                    f"drop {_flag(dest)}."
                )
    elif args.recompute_method == "block" or args.recompute_num_layers not in (None, 1):
        raise ValueError(
            f"--recompute-method {args.recompute_method} --recompute-num-layers "
            f"{args.recompute_num_layers} is not implemented: full recompute checkpoints every "
            "layer (--recompute-method uniform --recompute-num-layers 1); use those or omit them."
        )

    if args.transformer_impl == "transformer_engine":
        # Imported only here: importing it tries to import Transformer Engine, which is slow.
        from megatron.core.extensions import transformer_engine

        if not transformer_engine.HAVE_TE:
            raise ValueError(
                "--transformer-impl transformer_engine: transformer-engine is not importable "
                "(pip install --no-build-isolation transformer-engine[pytorch], needs CUDA); "
                "or use --transformer-impl local."
            )


def _validate_batch_and_optimizer(args: argparse.Namespace) -> None:
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
            f"{args.data_parallel_size} (world size {args.world_size} / "
            f"--context-parallel-size {args.context_parallel_size}) = {per_step}; use a "
            f"multiple of {per_step}."
        )
    args.num_microbatches = args.global_batch_size // per_step

    if args.weight_decay_incr_style == "constant":
        for dest in ("start_weight_decay", "end_weight_decay"):
            if getattr(args, dest) not in (None, args.weight_decay):
                raise ValueError(
                    f"{_flag(dest)} needs --weight-decay-incr-style linear or cosine; with "
                    "constant weight decay use --weight-decay."
                )
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        raise ValueError(
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both "
            "--start-weight-decay and --end-weight-decay."
        )
    # The scheduler only increases weight decay, as in Megatron-LM.
    if not 0 <= args.start_weight_decay <= args.end_weight_decay:
        raise ValueError(
            f"Need 0 <= --start-weight-decay ({args.start_weight_decay}) <= --end-weight-decay "
            f"({args.end_weight_decay}); the weight decay can only grow."
        )

    for dest in ("min_lr", "lr_warmup_init"):
        if not 0 <= getattr(args, dest) <= args.lr:
            raise ValueError(
                f"{_flag(dest)} {getattr(args, dest)} must be in [0, --lr {args.lr}]; change "
                f"{_flag(dest)}."
            )
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    # Whatever the decay style: the scheduler needs iterations left after warmup, as Megatron's.
    if not 0 <= args.lr_warmup_iters < args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --lr-decay-iters "
            f"{args.lr_decay_iters}) (--lr-decay-iters defaults to --train-iters); shorten the "
            "warmup or lengthen the decay."
        )
    if args.lr_decay_style == "WSD" and (
        args.lr_wsd_decay_iters is None or args.lr_wsd_decay_iters > args.lr_decay_iters
    ):
        raise ValueError(
            "--lr-decay-style WSD needs --lr-wsd-decay-iters (the annealing phase), at most "
            f"--lr-decay-iters {args.lr_decay_iters}."
        )


def _validate_data(args: argparse.Namespace) -> None:
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path are both set; choose one.")
    if not args.mock_data and not args.data_path:
        raise ValueError("No training data: pass --mock-data (synthetic tokens).")
    # Not built yet: lift these checks when the indexed dataset and the tokenizers land.
    if args.data_path:
        raise ValueError(
            "--data-path: datasets on disk are not supported yet; use --mock-data --vocab-size N."
        )
    for dest in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"):
        if getattr(args, dest) is not None:
            raise ValueError(
                f"{_flag(dest)}: tokenizers are not supported yet and --mock-data needs none; "
                f"drop {_flag(dest)} and set --vocab-size."
            )
    if args.vocab_size is None:
        raise ValueError("--mock-data needs --vocab-size (the token ids it draws from).")

    multiple = args.make_vocab_size_divisible_by
    args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple


def _validate_logging_and_checkpointing(args: argparse.Namespace) -> None:
    if args.tensorboard_dir is not None:
        _require_module("torch.utils.tensorboard", "--tensorboard-dir", "tensorboard")
    if args.wandb_project is not None:
        _require_module("wandb", "--wandb-project", "wandb")
        if not args.wandb_exp_name:
            raise ValueError("--wandb-project needs --wandb-exp-name (the run's name).")
    # Not built yet: lift this check when checkpointing lands.
    for dest in ("save", "load", "save_interval"):
        if getattr(args, dest) is not None:
            raise ValueError(
                f"{_flag(dest)}: saving and loading checkpoints is not implemented yet; drop "
                f"{_flag(dest)}."
            )
    if args.ckpt_format not in CKPT_FORMATS:
        raise ValueError(
            f"--ckpt-format {args.ckpt_format} is unknown; choose one of {', '.join(CKPT_FORMATS)}."
        )
    if args.ckpt_format == "fsdp_dtensor" and not args.use_megatron_fsdp:
        raise ValueError(
            "--ckpt-format fsdp_dtensor holds Megatron-FSDP's sharded state; add "
            "--use-megatron-fsdp or use --ckpt-format torch_dist."
        )


def _require_module(module: str, flag: str, package: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise ValueError(
            f"{flag} needs the {package} package, which is not importable ({error}); "
            f"pip install {package}, or drop {flag}."
        ) from error


def core_transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """The `TransformerConfig` the flags describe.

    Args:
        args: Validated by `validate_args` (it fills `params_dtype` and the derived widths).

    Returns:
        The model's config.
    """
    return TransformerConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        params_dtype=args.params_dtype,
        fp16=args.fp16,
        bf16=args.bf16,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        init_method_std=args.init_method_std,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        recompute_granularity=args.recompute_granularity,
        seq_length=args.seq_length,
    )


def get_megatron_ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The `DistributedDataParallelConfig` the flags describe (for DDP or Megatron-FSDP).

    Args:
        args: Validated by `validate_args`.

    Returns:
        The data-parallel config; `use_megatron_fsdp` selects the engine.
    """
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
        use_megatron_fsdp=args.use_megatron_fsdp,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
        fsdp_all_gather_in_start_param_sync=args.fsdp_all_gather_in_start_param_sync,
        use_symm_mem=args.use_symm_mem,
        megatron_fsdp_main_params_dtype=FSDP_DTYPES[args.megatron_fsdp_main_params_dtype],
        megatron_fsdp_main_grads_dtype=FSDP_DTYPES[args.megatron_fsdp_main_grads_dtype],
        megatron_fsdp_grad_comm_dtype=FSDP_DTYPES[args.megatron_fsdp_grad_comm_dtype],
    )


def get_parallel_state_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of `parallel_state.initialize_model_parallel()` the flags describe.

    Args:
        args: Validated by `validate_args`.

    Returns:
        `initialize_model_parallel(**kwargs)`'s arguments.
    """
    return dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        create_all_gather_group=args.create_all_gather_group,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
