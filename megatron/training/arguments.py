"""Megatron-LM's command-line flags for GPT training: parse, validate, turn into configs.

`parse_args()` reads the flags (Megatron-LM's names and meanings; `docs/flags.md` lists them);
this module defines them. `validate_args()` fills the derived values (data-parallel size, FFN
width, params dtype, ...) and rejects bad combinations with a `ValueError` that names the flag
and the fix, and the `*_from_args` / `get_*` functions build what the library takes:
`TransformerConfig`, `DistributedDataParallelConfig` and the keyword arguments of
`parallel_state.initialize_model_parallel()`. Those live in `arguments_validation.py` and
`configs_from_args.py` and are re-exported here. A training script does:

    args = validate_args(parse_args())
    parallel_state.initialize_model_parallel(**get_parallel_state_kwargs(args))
    config = core_transformer_config_from_args(args)
    ddp_config = get_megatron_ddp_config(args)

There is no tensor, pipeline, context or expert parallelism yet, so the data-parallel size is
the world size.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron.core.datasets.tokenizers import TOKENIZER_TYPES
from megatron.core.distributed.distributed_data_parallel_config import (
    OUTER_SHARDING_STRATEGIES,
    SHARDING_STRATEGIES,
)
from megatron.core.models.common.embeddings.language_model_embedding import (
    POSITION_EMBEDDING_TYPES,
)
from megatron.core.optimizer.optimizer_config import OPTIMIZERS
from megatron.core.optimizer_param_scheduler import (
    LR_DECAY_STYLES,
    LR_WSD_DECAY_STYLES,
    WD_INCR_STYLES,
)
from megatron.core.transformer.transformer_config import NORMALIZATIONS
from megatron.training.arguments_validation import CKPT_FORMATS, DEFAULT_SPLIT, validate_args
from megatron.training.configs_from_args import (
    FSDP_DTYPES,
    core_transformer_config_from_args,
    get_megatron_ddp_config,
    get_megatron_optimizer_config,
    get_parallel_state_kwargs,
)

__all__ = [
    "CKPT_FORMATS",
    "FSDP_DTYPES",
    "add_megatron_arguments",
    "core_transformer_config_from_args",
    "get_megatron_ddp_config",
    "get_megatron_optimizer_config",
    "get_parallel_state_kwargs",
    "parse_args",
    "validate_args",
]


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
        add_tokenizer_args,
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
        choices=WD_INCR_STYLES,
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
    group.add_argument("--optimizer", default="adam", choices=OPTIMIZERS, help="adam is AdamW.")
    group.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Raise on a NaN/Inf loss or global gradient norm.",
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
        choices=LR_DECAY_STYLES,
        help="Decay after warmup.",
    )
    group.add_argument("--lr-decay-iters", type=int, help="None: --train-iters.")
    group.add_argument(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=LR_WSD_DECAY_STYLES,
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
    group.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        help="On loading, keep these flags' schedule (the checkpoint's step count only).",
    )
    group.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="On loading, take the checkpoint's schedule over these flags.",
    )


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", help="Checkpoint directory to save to.")
    group.add_argument(
        "--save-interval", type=int, help="Iterations between saves (and one at the end)."
    )
    group.add_argument("--load", help="Checkpoint directory to resume from.")
    group.add_argument(
        "--ckpt-step", type=int, help="Iteration to load; None: the tracker file's (latest)."
    )
    group.add_argument(
        "--no-load-optim", action="store_true", help="Load weights only, no optimizer state."
    )
    group.add_argument(
        "--no-load-rng", action="store_true", help="Keep the seeded RNG states on loading."
    )
    group.add_argument(
        "--finetune",
        action="store_true",
        help="Load the weights only and start at iteration 0 (a new run from them).",
    )
    group.add_argument(
        "--ckpt-format",
        default="torch_dist",
        choices=CKPT_FORMATS,
        help="Checkpoint format: fsdp_dtensor (Megatron-FSDP) or torch_dist; both are "
        "torch.distributed.checkpoint directories.",
    )


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true", help="Not supported yet: use --bf16.")
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
    group.add_argument("--context-parallel-size", type=int, default=1, help="Only 1 for now.")
    group.add_argument(
        "--expert-model-parallel-size", type=int, default=1, help="Only 1 (no MoE layers yet)."
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
    group.add_argument(
        "--data-path",
        nargs="*",
        help="Prefixes of .bin/.idx datasets (tools/preprocess_data.py): PREFIX, or "
        "WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ... to blend.",
    )
    group.add_argument(
        "--split", default=DEFAULT_SPLIT, help="Train, validation and test weights of the data."
    )
    group.add_argument(
        "--data-cache-path", help="Folder of cached sample indices; None: beside the data."
    )
    group.add_argument(
        "--no-mmap-bin-files",
        action="store_false",
        dest="mmap_bin_files",
        help="Read the .bin files instead of memory-mapping them.",
    )
    group.add_argument("--seq-length", type=int, help="Tokens per sequence.")
    group.add_argument("--num-workers", type=int, default=2, help="Dataloader workers.")
    group.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")
    group.add_argument(
        "--reset-position-ids", action="store_true", help="Positions restart after each EOD."
    )
    group.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="No attention across EOD tokens (samples carry a mask).",
    )


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The tokenizer flags, which `tools/preprocess_data.py` shares; returns their group."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--vocab-size",
        type=int,
        help="Token ids of --mock-data without a tokenizer; NullTokenizer's vocabulary.",
    )
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="The tokenizer.")
    group.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json.")
    group.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt.")
    group.add_argument(
        "--tokenizer-model",
        help="SentencePiece .model file, or local HuggingFace tokenizer directory.",
    )
    return group


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
