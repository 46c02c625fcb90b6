"""`validate_args()`: the derived values of the flags, and bad combinations refused.

`validate_args()` fills the derived values of the flags `parse_args()` read (data-parallel size,
FFN width, params dtype, ...) and rejects bad combinations with a `ValueError` that names the flag
and the fix; every independent error of a command line is reported in one `FlagErrors` (a
`ValueError`), and a check that reads a value found bad is skipped (`_DERIVING_CHECKS`). The
configs the validated flags describe are built in `configs_from_args`;
`megatron.training.arguments` re-exports both: import them from there.

Each flag group's own checks live beside its flags (`flag_groups/*.py`, `validate_*`), called
from here; the range of every float flag is checked first (`flag_ranges.py`), features not built
are refused by name in `flag_groups/unbuilt.py`, and the parallel sizes not built yet (context
parallelism) in `_validate_parallelism`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from collections.abc import Callable

import torch

from megatron.core.datasets.dataset_builder import check_blend, parse_data_path
from megatron.core.datasets.gpt_dataset import DEFAULT_SPLIT, parse_and_normalize_split
from megatron.core.datasets.mock_dataset import SEED_LIMIT
from megatron.training.checkpoint_layout import same_directory
from megatron.training.configs_from_args import (
    ddp_config_from_flags,
    flag,
    given,
    optimizer_config_from_flags,
    transformer_config_from_flags,
)
from megatron.training.flag_errors import FlagErrorCollector
from megatron.training.flag_groups.checkpointing import CKPT_FORMATS, validate_checkpointing
from megatron.training.flag_groups.cuda_graphs import validate_cuda_graphs
from megatron.training.flag_groups.data import PER_SPLIT_FLAGS, validate_data, validate_tokenizer
from megatron.training.flag_groups.distributed import validate_distributed
from megatron.training.flag_groups.logs import validate_logging
from megatron.training.flag_groups.mla import validate_mla
from megatron.training.flag_groups.moe import validate_moe
from megatron.training.flag_groups.network import validate_network_options
from megatron.training.flag_groups.optimization import validate_lr_schedule
from megatron.training.flag_groups.pipeline import validate_interleaving, validate_pipeline
from megatron.training.flag_groups.precision import validate_precision
from megatron.training.flag_groups.profiling import validate_profiling
from megatron.training.flag_groups.training import validate_training_operations
from megatron.training.flag_groups.training_schedule import (
    validate_batch_schedule,
    validate_training_length,
)
from megatron.training.flag_groups.transformer import validate_transformer_options
from megatron.training.flag_groups.unbuilt import validate_unbuilt
from megatron.training.flag_groups.yarn import resolve_positions, validate_yarn
from megatron.training.flag_ranges import check_float_flags
from megatron.training.utils import print_rank_0

NUM_SPLITS = 3
"""train, validation, test: `--mock-data` draws split i with seed `--seed` + i."""

_FSDP_ONLY_FLAGS = ("create_all_gather_group", "init_model_with_meta_device")
"""Megatron-FSDP-only flags that set no `DistributedDataParallelConfig` field. The config
rejects its own Megatron-FSDP-only fields under the DDP engine (`ddp_config_from_flags`)."""

_DDP_ONLY_FLAGS = ("ddp_bucket_size", "ddp_average_in_collective")
"""Flags only the DDP engine reads; `DistributedDataParallelConfig` accepts their fields under
Megatron-FSDP, which would ignore them."""


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Fills the derived values of `args` and rejects bad combinations of flags.

    Idempotent: a validated namespace validates again unchanged.

    Args:
        args: From `parse_args`.
        world_size: Number of ranks; None reads `WORLD_SIZE` from the environment (1 if unset).

    Returns:
        `args`, updated in place with `world_size`, `data_parallel_size`, `global_batch_size`,
        `num_microbatches`, `num_query_groups`, `kv_channels`, `ffn_hidden_size`,
        `max_position_embeddings`, `padded_vocab_size` (without a `--tokenizer-type`: the
        tokenizer sets it), `params_dtype`, `lr_decay_iters` (or with `--train-samples`:
        `train_iters` and `lr_decay_samples`), `split` (with `--data-path`),
        `start_weight_decay` and `end_weight_decay`; `num_experts` 0 becomes None and a
        one-element `moe_router_load_balancing_type` / `moe_aux_loss_coeff` its element
        (`validate_moe`).

    Raises:
        ValueError: a flag is missing, out of range, contradicts another or needs something
            this machine lacks; the message names the flag(s) and the fix.
    """
    args.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    errors = FlagErrorCollector()
    # Checks of single flags and of features: independent of each other, all run (the precision
    # checks read the loss-scale floats, so only once those are in range).
    for check in _INDEPENDENT_CHECKS:
        needs = ("check_float_flags",) if check is validate_precision else ()
        errors.check(check, args, needs=needs)
    # Derived values and combinations: each runs only once what it reads is known to be valid.
    for check, name, needs in _DERIVING_CHECKS:
        errors.check(check, args, name=name, needs=needs)
    # The configs check their own fields too, among them the float ranges and combinations
    # reported above: built only from valid flags, they turn any remaining error into one at
    # start-up rather than after the process groups exist, without repeating one.
    if not errors.messages:
        errors.check(optimizer_config_from_flags, args)
    if not errors.messages:
        errors.check(transformer_config_from_flags, args)
    errors.raise_errors()
    return args


_REQUIRED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "micro_batch_size",
)


def _check_required(args: argparse.Namespace) -> None:
    for dest in (*_REQUIRED, "lr"):
        if getattr(args, dest) is None:
            raise ValueError(f"{flag(dest)} is required; pass it on the command line.")


def _check_sizes(args: argparse.Namespace) -> None:
    for dest in (
        *_REQUIRED,
        "train_iters",
        "global_batch_size",
        "tensor_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "num_distributed_optimizer_instances",
        "lr_decay_iters",
        "lr_wsd_decay_iters",
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
            raise ValueError(f"{flag(dest)} must be >= 1, got {value}.")
    for dest in ("eval_iters", "num_workers"):
        if getattr(args, dest) < 0:
            raise ValueError(f"{flag(dest)} must be >= 0, got {getattr(args, dest)}.")


def _validate_parallelism(args: argparse.Namespace) -> None:
    if len(args.cp_comm_type) != 1:
        raise ValueError(
            f"--cp-comm-type {' '.join(args.cp_comm_type)}: one value per layer is not built; "
            "give one of p2p, a2a or allgather for every layer."
        )
    if args.context_parallel_size > 1 and args.reset_attention_mask:
        raise ValueError(
            "--reset-attention-mask with --context-parallel-size "
            f"{args.context_parallel_size}: context-parallel attention computes the causal mask "
            "itself and takes no per-document mask; drop one of the two."
        )
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    model_parallel = tp * cp * args.pipeline_model_parallel_size
    if args.world_size % model_parallel:
        raise ValueError(
            f"The world size {args.world_size} is not a multiple of --tensor-model-parallel-size "
            f"{tp} x --context-parallel-size {cp} x --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size} = {model_parallel}; launch a multiple of "
            f"{model_parallel} ranks or lower these sizes."
        )
    args.data_parallel_size = args.world_size // model_parallel
    if tp == 1 and args.sequence_parallel:
        # As upstream: sequence parallelism splits what tensor parallelism shares, so without
        # it there is nothing to split and the flag changes no result.
        print_rank_0(
            "WARNING: --sequence-parallel needs --tensor-model-parallel-size > 1; disabling "
            "sequence parallelism.",
            logging.WARNING,
        )
        args.sequence_parallel = False
    _check_engine_flags(args)

    # The outer replicas cut the data x context-parallel group (world / tp ranks, as pp = 1).
    instances = args.num_distributed_optimizer_instances
    dp_cp = args.data_parallel_size * cp
    if dp_cp % instances:
        raise ValueError(
            f"--num-distributed-optimizer-instances {instances} does not divide the "
            f"data-parallel x context-parallel size {dp_cp} (world size {args.world_size} / "
            f"--tensor-model-parallel-size {tp}); choose a divisor of {dp_cp}."
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


def _validate_tensor_parallelism(args: argparse.Namespace) -> None:
    """Upstream's rules for splitting the model over `--tensor-model-parallel-size` ranks."""
    tp = args.tensor_model_parallel_size
    if tp == 1:
        return
    split = {
        "num_attention_heads": "attention heads",
        "num_query_groups": "key/value heads",
        "ffn_hidden_size": "MLP columns",
    }
    for dest, what in split.items():
        # Without --group-query-attention the query groups are the heads, checked first.
        if getattr(args, dest) % tp:
            raise ValueError(
                f"{flag(dest)} {getattr(args, dest)} is not divisible by "
                f"--tensor-model-parallel-size {tp}: each tensor-parallel rank holds an equal "
                f"share of the {what}; choose sizes where {tp} divides it."
            )
    cp = args.context_parallel_size
    if args.sequence_parallel and args.seq_length % (tp * cp):
        raise ValueError(
            f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size "
            f"{tp} x --context-parallel-size {cp}: --sequence-parallel splits each rank's part "
            f"of the sequence over the tensor-parallel ranks; use a multiple of {tp * cp}."
        )
    if args.num_experts is not None and not args.sequence_parallel:
        # Megatron-LM's MoE layer refuses to train this way: without sequence parallelism every
        # tensor-parallel rank would route the same tokens.
        raise ValueError(
            f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
            "(as in Megatron-LM): add --sequence-parallel."
        )


def _check_engine_flags(args: argparse.Namespace) -> None:
    """Rejects a flag that the engine this run selects would ignore.

    `DistributedDataParallelConfig` rejects its Megatron-FSDP-only fields under the DDP engine
    and contradictory fields (HFSDP, `--grad-reduce-in-fp32`): building it here reports those
    with their flag names. The flags it does not check default to off (False / None) whatever
    a script's `args_defaults` say, so a value that is set asks for that engine.
    """
    ddp_config_from_flags(args)
    for dest in _DDP_ONLY_FLAGS if args.use_megatron_fsdp else _FSDP_ONLY_FLAGS:
        value = getattr(args, dest)
        if value is None or value is False:
            continue
        spelled = given(dest, value)
        if args.use_megatron_fsdp:
            raise ValueError(
                f"{spelled} is read by the DDP engine only, which this run does not use; drop "
                f"{spelled} or --use-megatron-fsdp."
            )
        raise ValueError(
            f"{spelled} needs Megatron-FSDP: add --use-megatron-fsdp or drop {spelled}."
        )


def _validate_model(args: argparse.Namespace) -> None:
    heads = args.num_attention_heads
    if not args.group_query_attention:
        if args.num_query_groups not in (1, heads):
            # Megatron-LM reads --num-query-groups only with --group-query-attention.
            print_rank_0(
                f"WARNING: --num-query-groups {args.num_query_groups} is read only with "
                f"--group-query-attention; using {heads} key/value heads (one per head).",
                logging.WARNING,
            )
        args.num_query_groups = heads
    if args.num_query_groups < 1:
        raise ValueError(f"--num-query-groups must be >= 1, got {args.num_query_groups}.")
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

    args.params_dtype = (
        torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    )


def _check_transformer_impl(args: argparse.Namespace) -> None:
    # Independent of the model's sizes: its refusal leaves the checks that need them running.
    if args.transformer_impl == "transformer_engine":
        # Imported only here: importing it tries to import Transformer Engine, which is slow.
        from megatron.core.extensions import transformer_engine

        if not transformer_engine.HAVE_TE:
            raise ValueError(
                "--transformer-impl transformer_engine: transformer-engine is not importable "
                "(pip install --no-build-isolation transformer-engine[pytorch], needs CUDA); "
                "or use --transformer-impl local."
            )


def _validate_batch(args: argparse.Namespace) -> None:
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
            f"{args.data_parallel_size} (world size {args.world_size} / "
            f"(--tensor-model-parallel-size {args.tensor_model_parallel_size} x "
            f"--context-parallel-size {args.context_parallel_size})) = {per_step}; use a "
            f"multiple of {per_step}."
        )
    args.num_microbatches = args.global_batch_size // per_step


def _validate_weight_decay_and_lr_bounds(args: argparse.Namespace) -> None:
    if args.weight_decay_incr_style == "constant":
        for dest in ("start_weight_decay", "end_weight_decay"):
            if getattr(args, dest) not in (None, args.weight_decay):
                raise ValueError(
                    f"{flag(dest)} needs --weight-decay-incr-style linear or cosine; with "
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
                f"{flag(dest)} {getattr(args, dest)} must be in [0, --lr {args.lr}]; change "
                f"{flag(dest)}."
            )
    # The decay, warmup and WSD lengths: validate_lr_schedule, once the training length is known.


def _validate_data(args: argparse.Namespace) -> None:
    per_split = [f"--{s}-data-path" for s in PER_SPLIT_FLAGS if getattr(args, f"{s}_data_path")]
    choices = (
        ("--mock-data", args.mock_data),
        ("--data-path", args.data_path),
        (" ".join(per_split), per_split),
    )
    sources = [name for name, chosen in choices if chosen]
    if len(sources) > 1:
        raise ValueError(f"{' and '.join(sources)} are all data sources; choose one.")
    if not sources:
        raise ValueError(
            "No training data: pass --data-path PREFIX (a dataset tools/preprocess_data.py "
            "wrote) with its --tokenizer-type, --train-data-path (and --valid-data-path, "
            "--test-data-path) for datasets of each split, or --mock-data (synthetic tokens)."
        )
    if args.tokenizer_type is None:
        for dest in ("vocab_file", "merge_file", "tokenizer_model"):
            if getattr(args, dest) is not None:
                raise ValueError(f"{flag(dest)} needs --tokenizer-type (which reads it).")
    if args.data_path:
        _validate_data_path(args)
    elif per_split:
        _validate_per_split_data_paths(args, per_split)
    else:
        _validate_mock_data(args)
    if not args.mock_data and not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed {args.seed} must be in [0, 2**32) (it shuffles the data).")
    if args.tokenizer_type is None:
        args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args)
    # Else the tokenizer, which initialize_megatron() builds, sets it (Megatron-LM's order).


def _validate_data_path(args: argparse.Namespace) -> None:
    if args.tokenizer_type is None:
        raise ValueError(
            "--data-path needs --tokenizer-type: the tokenizer the data was preprocessed with "
            "(its vocabulary sizes the model), e.g. --tokenizer-type ByteLevelTokenizer."
        )
    try:
        check_blend(parse_data_path(args.data_path))
        if args.split is None:
            # Megatron-LM's legacy default, with its warning.
            print_rank_0(
                f"WARNING: Please specify --split when using --data-path. Using legacy default "
                f'value of "{DEFAULT_SPLIT}"',
                logging.WARNING,
            )
            args.split = DEFAULT_SPLIT
        parse_and_normalize_split(args.split)
    except ValueError as error:
        raise ValueError(f"--data-path / --split: {error}") from None


def _validate_per_split_data_paths(args: argparse.Namespace, given: list[str]) -> None:
    if args.tokenizer_type is None:
        raise ValueError(
            f"{given[0]} needs --tokenizer-type: the tokenizer the data was preprocessed with."
        )
    if not args.train_data_path:
        raise ValueError(f"{', '.join(given)} without --train-data-path: give the training data.")
    if args.split is not None:
        raise ValueError(
            f"--split {args.split} divides --data-path's datasets; the datasets of "
            f"{', '.join(given)} serve their split whole: drop --split."
        )
    for split in PER_SPLIT_FLAGS:
        paths = getattr(args, f"{split}_data_path")
        if paths:
            try:
                check_blend(parse_data_path(paths))
            except ValueError as error:
                raise ValueError(f"--{split}-data-path: {error}") from None


def _validate_mock_data(args: argparse.Namespace) -> None:
    for dest in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask"):
        if getattr(args, dest):
            raise ValueError(
                f"{flag(dest)} acts on end-of-document tokens, which --mock-data does not "
                f"produce; use --data-path, or drop {flag(dest)}."
            )
    if args.tokenizer_type is None and args.vocab_size is None:
        raise ValueError(
            "--mock-data needs --vocab-size (the token ids it draws from) or a --tokenizer-type "
            "(its vocabulary)."
        )
    largest_seed = SEED_LIMIT - NUM_SPLITS
    if not 0 <= args.seed <= largest_seed:
        raise ValueError(
            f"--seed {args.seed} must be in [0, {largest_seed}] with --mock-data: split i "
            f"(train, validation, test) draws with seed --seed + i, and seeds are in "
            f"[0, 2**31); choose a --seed in range."
        )


def vocab_size_with_padding(vocab_size: int, args: argparse.Namespace) -> int:
    """`vocab_size` rounded up to a multiple of `--make-vocab-size-divisible-by` x
    `--tensor-model-parallel-size` (Megatron-LM's padding: efficient GEMM shapes for the
    embedding and the logits, and equal vocabulary shards on every tensor-parallel rank)."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def _validate_logging_and_checkpointing(args: argparse.Namespace) -> None:
    if args.wandb_project is not None:
        _require_module("wandb", "--wandb-project", "wandb")
        if not args.wandb_exp_name:
            raise ValueError("--wandb-project needs --wandb-exp-name (the run's name).")
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save (the directory to save to).")
    if args.load is None:
        # --no-load-optim and --no-load-rng hold without --load (nothing is loaded), as
        # upstream: its gpt-oss script passes them with --save alone.
        for dest in ("ckpt_step", "finetune", "exit_on_missing_checkpoint"):
            if getattr(args, dest) not in (None, False):
                raise ValueError(f"{flag(dest)} needs --load (the checkpoint directory).")
    _validate_finetune_directories(args)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are both "
            "set: keep the flags' schedule or take the checkpoint's, not both."
        )
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ValueError(f"--ckpt-step {args.ckpt_step} must be >= 0.")
    if args.ckpt_format not in CKPT_FORMATS:
        raise ValueError(
            f"--ckpt-format {args.ckpt_format} is unknown; choose one of {', '.join(CKPT_FORMATS)}."
        )
    if args.ckpt_format == "fsdp_dtensor" and not args.use_megatron_fsdp:
        raise ValueError(
            "--ckpt-format fsdp_dtensor holds Megatron-FSDP's sharded state; add "
            "--use-megatron-fsdp or use --ckpt-format torch_dist."
        )


def _validate_finetune_directories(args: argparse.Namespace) -> None:
    """Refuses a finetuning run whose `--save` is the directory it finetunes from: its saves
    (from iteration 0) would replace that checkpoint, or point the tracker away from it, and a
    restart would finetune again from the run's own checkpoint."""
    pretrained = args.pretrained_checkpoint
    if pretrained is not None:
        if args.load is None:
            raise ValueError(
                "--pretrained-checkpoint needs --load: the directory a restarted job resumes "
                "from (normally the --save directory). The run finetunes from "
                "--pretrained-checkpoint while --load holds no checkpoint."
            )
        if args.save is not None and same_directory(pretrained, args.save):
            raise ValueError(
                f"--pretrained-checkpoint {pretrained} is the --save directory: the run would "
                "write its checkpoints over the one it finetunes from. Pass a new --save "
                "directory, and the same as --load."
            )
    if args.finetune and args.save is not None and same_directory(args.load, args.save):
        raise ValueError(
            f"--finetune with --load {args.load} as --save: the new run (from iteration 0) "
            "would write its checkpoints over the one it starts from, and a restart would "
            "finetune again from its own. Pass a new --save directory; for a job that restarts "
            f"itself, --pretrained-checkpoint {args.load} --load NEW --save NEW instead of "
            "--finetune (it finetunes from --pretrained-checkpoint until NEW holds a "
            "checkpoint, then resumes from NEW)."
        )


def _require_module(module: str, flag: str, package: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise ValueError(
            f"{flag} needs the {package} package, which is not importable ({error}); "
            f"pip install {package}, or drop {flag}."
        ) from error


_INDEPENDENT_CHECKS: tuple[Callable[[argparse.Namespace], None], ...] = (
    validate_unbuilt,
    check_float_flags,
    validate_checkpointing,
    validate_distributed,
    validate_precision,
    validate_logging,
    validate_profiling,
    validate_training_operations,
    validate_tokenizer,
    validate_data,
    _validate_logging_and_checkpointing,
    _check_transformer_impl,
)
"""Checks that read the flags as given (and the world size), each valid on its own."""

_DERIVING_CHECKS: tuple[tuple[Callable[[argparse.Namespace], None], str, tuple[str, ...]], ...] = (
    (resolve_positions, "positions", ()),  # fills --position-embedding-type: first
    (_check_required, "required", ()),
    (_check_sizes, "sizes", ()),
    (_validate_parallelism, "parallelism", ("sizes",)),
    (_validate_model, "model", ("required", "sizes", "positions")),
    (validate_moe, "moe", ("required", "sizes", "check_float_flags")),  # reads MoE floats
    (validate_pipeline, "pipeline", ("parallelism", "moe")),
    (_validate_tensor_parallelism, "tensor parallelism", ("parallelism", "model", "moe")),
    (validate_network_options, "network", ("required", "sizes", "positions")),
    (validate_yarn, "yarn", ("positions", "check_float_flags")),  # refuses YaRN floats
    (validate_mla, "mla", ("required", "sizes", "positions", "check_float_flags")),
    (validate_transformer_options, "transformer", ("model",)),
    (validate_batch_schedule, "batch schedule", ("parallelism",)),
    (_validate_batch, "batch", ("batch schedule",)),
    # Compares float flags: a value out of range would be reported again, as out of bounds.
    (
        _validate_weight_decay_and_lr_bounds,
        "weight decay and lr",
        ("required", "check_float_flags"),
    ),
    (validate_training_length, "training length", ("batch",)),
    # Every scheduled batch size within --train-iters.
    (validate_interleaving, "interleaving", ("pipeline", "batch", "training length")),
    (validate_lr_schedule, "lr schedule", ("training length", "weight decay and lr")),
    (validate_cuda_graphs, "cuda graphs", ("parallelism", "moe")),
    (_validate_data, "data sources", ("sizes", "validate_tokenizer", "validate_data")),
)
"""(check, name, the names of the checks it needs): checks that fill derived values, or read
them, in the order they run; one is skipped when a check it needs failed or was skipped."""
