"""The pretraining loop: `pretrain()`, Megatron-LM's entry point, and the steps it is made of.

`pretrain()` initialises the job (`initialize_megatron`), builds the model through the
script's `model_provider` and wraps it with Megatron-FSDP (`--use-megatron-fsdp`) or the DDP
engine, builds the optimizer and learning-rate schedule, the data iterators from the script's
dataset provider, then trains for `--train-iters` iterations, evaluating every
`--eval-interval`, and once more (validation and test) at the end.

The loop (`train()`) is in `megatron.training.training_loop`. One iteration of it
(`start_train_step`, in `megatron.training.train_step`; the optimizer step's outcome is read as
`megatron.training.optimizer_step` says) on either engine::

    model.zero_grad_buffer(); optimizer.zero_grad()
    model.start_param_sync()           # Megatron-FSDP: gather the first unit early
    MoEAuxLossAutoScaler.set_loss_scale(loss scale x cp / num_microbatches)  # MoE and MTP
    for each of the num_microbatches = global batch / (micro batch x data-parallel size):
        with no_sync() but for the last:  # reductions run once, after the last one
            forward, loss / num_microbatches, backward
    model.finish_grad_sync()
    update_expert_bias(...)            # --moe-router-enable-expert-bias
    average_loss_dicts(...)            # the reported losses, on the device until read
    read the previous iteration's step # its skip flag and norm, copied to the host meanwhile,
    scheduler.step(global batch)       # then its schedule step: in samples, only after a real
                                       # update, as Megatron-LM's
    optimizer.step_without_host_sync() # global grad norm; skip if not finite; clip; step; read
                                       # next iteration (fp16, unfused SGD: step(), read now)
    # with --check-for-nan-in-loss-and-grad (the default): raise on a non-finite loss or norm
    # (a skipped step's where it is read; a taken step's where the loop reads its losses)
    get_moe_metrics_tracker().reduce(...)  # every step: the MoE losses of the log, cleared
    get_mtp_loss_logging_helper().reduce(...)  # likewise the multi-token prediction losses

The script supplies `forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`,
where `loss_func(output_tensor) -> (loss, {"lm loss": loss, ...})`: the scalar to
backpropagate (this microbatch's mean) and the values to report, which the loop averages over
microbatches and data-parallel ranks (or, with `--calculate-per-token-loss`, Megatron-LM's
`(loss sum, num_tokens, report)`: `megatron.training.schedules`).

With `--cuda-graph-impl full_iteration` the device work of an iteration (everything above up to
the optimizer step, which then runs on the device) is captured in one CUDA graph after
`--cuda-graph-warmup-steps` eager iterations and replayed (`megatron.training.cuda_graphs`);
the schedule, the checks, logging and evaluation stay on the host, outside the graph.

With `--load`, training resumes from a checkpoint (weights, optimizer state, schedule, RNG
states, and the progress: a `TrainState`, whose consumed-sample counts are the data position);
with `--save`, a checkpoint is written every `--save-interval` iterations and when training
stops (`megatron.training.checkpointing`) into a directory the run holds (`save_directory`).
The arguments are read-only once set up (`ReadOnlyArguments`); the progress is the
`TrainState` that `pretrain()` passes to the loop, the log and the checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, data_parallel_class
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.enums import ModelType
from megatron.core.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.tied_embeddings import broadcast_tied_embeddings
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.arguments import get_megatron_ddp_config, get_megatron_optimizer_config
from megatron.training.checkpointing import CheckpointError, load_checkpoint
from megatron.training.data_iterators import DatasetProvider, build_train_valid_test_data_iterators
from megatron.training.dist_signal_handler import ExitConditions
from megatron.training.evaluation import evaluate_and_print_results
from megatron.training.flag_errors import reported_as_flag_errors
from megatron.training.flag_groups.cuda_graphs import full_iteration_cuda_graph
from megatron.training.flag_groups.optimization import lr_schedule_steps
from megatron.training.initialize import ExtraArgsProvider, destroy_megatron, initialize_megatron
from megatron.training.profiling import TrainingOperations
from megatron.training.save_directory import claim_save_directory
from megatron.training.schedules import ForwardStepFunc
from megatron.training.train_state import TrainState
from megatron.training.train_step import train_step
from megatron.training.training_log import TrainingLog, fp8_startup_line
from megatron.training.training_loop import TrainingHistory, train
from megatron.training.utils import (
    LoaderIterator,
    accumulation_memory_note,
    get_device,
    logger,
    print_rank_0,
    unit_memory_note,
)

ModelProvider = Callable[..., torch.nn.Module]

__all__ = [  # with the loop's and the iteration's names, which moved to their own modules
    "ModelProvider",
    "TrainingHistory",
    "build_train_valid_test_data_iterators",
    "get_model",
    "get_optimizer_param_scheduler",
    "pretrain",
    "setup_model_and_optimizer",
    "train",
    "train_step",
]


def pretrain(
    train_valid_test_dataset_provider: DatasetProvider,
    model_provider: ModelProvider,
    model_type: ModelType,
    forward_step_func: ForwardStepFunc,
    extra_args_provider: ExtraArgsProvider | None = None,
    args_defaults: dict[str, Any] | None = None,
    argv: list[str] | None = None,
) -> TrainingHistory:
    """Trains a model as the command-line flags describe (Megatron-LM's `pretrain`).

    Args:
        train_valid_test_dataset_provider: takes the number of samples each split needs,
            [train, valid, test], and returns the three datasets (None for a split not needed).
        model_provider: `model_provider(pre_process=True, post_process=True)` builds the
            unwrapped model on the current default device (`meta` with
            `--init-model-with-meta-device`), reading its shape from `get_args()`; with
            pipeline stages, this stage's (`pre_process`: the first, `post_process`: the last).
        model_type: `ModelType.encoder_or_decoder`.
        forward_step_func: `(data_iterator, model) -> (output_tensor, loss_func)`; see the
            module docstring.
        extra_args_provider: adds a script's own flags to the parser.
        args_defaults: a script's defaults for flags (dest name -> value).
        argv: the flags; None reads `sys.argv[1:]`.

    Returns:
        The per-iteration losses, gradient norms and learning rates and the evaluations.

    Raises:
        ValueError: a flag, a dataset, the checkpoint or the `--save` directory (these two:
            `CheckpointError`) does not fit the run; the message names the fix.
        RuntimeError: with `--check-for-nan-in-loss-and-grad` (the default), a loss or the
            global gradient norm is not finite; or the `parallel_state` groups exist already.
    """
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "pretrain() creates and destroys its own parallel_state groups, but they exist "
            "already; call parallel_state.destroy_model_parallel() first."
        )
    owns_default_group = not dist.is_initialized()
    start_time = time.time()  # --exit-duration-in-mins counts from here, as Megatron-LM's
    data_iterators: tuple[LoaderIterator | None, ...] = ()
    save_directory = contextlib.ExitStack()  # holds --save's lock until the end
    try:
        args = initialize_megatron(extra_args_provider, args_defaults, argv=argv)
        with reported_as_flag_errors(CheckpointError):
            save_directory.enter_context(claim_save_directory(args))
        model, optimizer, scheduler = setup_model_and_optimizer(model_provider, model_type, args)
        train_state = TrainState()
        if args.load is not None:
            with reported_as_flag_errors(CheckpointError):
                train_state = load_checkpoint(model, optimizer, scheduler, args)
        data_iterators = build_train_valid_test_data_iterators(
            train_valid_test_dataset_provider, args, train_state
        )
        train_iterator, valid_iterator, test_iterator = data_iterators
        log = TrainingLog(args, model[0].config, get_device(), train_state)
        with contextlib.closing(log), TrainingOperations(args) as operations:
            with ExitConditions(args, start_time) as exits:
                history = train(
                    forward_step_func,
                    model,
                    optimizer,
                    scheduler,
                    train_iterator,
                    valid_iterator,
                    args,
                    log,
                    operations,
                    exits,
                )
            last_iteration = train_state.iteration
            evaluate = functools.partial(
                evaluate_and_print_results,
                forward_step_func,
                model=model,
                args=args,
                log=log,
                when="the end of training",
                iteration=last_iteration,
            )
            if valid_iterator is not None:
                # As Megatron-LM, on the validation batches after the periodic ones; when the
                # last iteration was evaluated already, its point stays TensorBoard's only one at
                # that step (upstream writes a second, different value there).
                history.final_validation_losses = evaluate(
                    valid_iterator,
                    split="validation",
                    write_to_tensorboard=last_iteration not in history.validation_losses,
                )
            if test_iterator is not None:
                history.test_losses = evaluate(test_iterator, split="test")
    except BaseException:
        try:
            _teardown(data_iterators, owns_default_group, save_directory)
        except Exception:  # logged: the error being raised must not be replaced
            logger.exception("pretrain(): tearing down after an error failed too:")
        raise
    _teardown(data_iterators, owns_default_group, save_directory)
    return history


def _teardown(
    data_iterators: tuple[LoaderIterator | None, ...],
    owns_default_group: bool,
    save_directory: contextlib.ExitStack,
) -> None:
    """Releases `--save`, stops the data loaders' workers, destroys `initialize_megatron()`'s.
    Each step runs though an earlier one raised (as nested `with` blocks do: an error is raised
    after them all, chained to the earlier ones): a later `pretrain()` in this process needs
    the process group destroyed."""
    with contextlib.ExitStack() as steps:  # runs its callbacks last in, first out
        steps.callback(destroy_megatron, destroy_default_group=owns_default_group)
        for iterator in reversed(data_iterators):
            if iterator is not None:
                steps.callback(iterator.close)
        steps.callback(save_directory.close)


def get_model(
    model_provider: ModelProvider, model_type: ModelType, args: argparse.Namespace
) -> list[_BaseDataParallel]:
    """Builds this rank's model chunks and wraps each with the data-parallel engine the flags
    select (Megatron-LM's `get_model`).

    Args:
        model_provider: `model_provider(pre_process=..., post_process=...)` builds the
            unwrapped model (this pipeline stage's: the embedding on the first, the output
            layer on the last) on the current default device; with virtual pipeline stages it
            is called once per chunk with `vp_stage=` the chunk's index as well.
        model_type: must be `ModelType.encoder_or_decoder`.
        args: validated arguments (engine, sharding strategy, meta-device initialisation).

    Returns:
        The chunks, in virtual-stage order (one without virtual stages), each wrapped by
        `FullyShardedDataParallel` or `DistributedDataParallel`.

    Raises:
        ValueError: `model_type` is not `ModelType.encoder_or_decoder`.
    """
    if model_type is not ModelType.encoder_or_decoder:
        raise ValueError(
            f"model_type={model_type!r}: only ModelType.encoder_or_decoder (decoder-only GPT "
            "models) is supported."
        )
    # On meta, no rank holds the whole model: Megatron-FSDP materialises each rank's shards.
    device = torch.device("meta") if args.init_model_with_meta_device else get_device()
    virtual = args.virtual_pipeline_model_parallel_size
    with device:
        if virtual is None:
            modules = [
                model_provider(
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                )
            ]
        else:
            modules = [
                model_provider(
                    pre_process=parallel_state.is_pipeline_first_stage(
                        ignore_virtual=False, vp_stage=stage
                    ),
                    post_process=parallel_state.is_pipeline_last_stage(
                        ignore_virtual=False, vp_stage=stage, vp_size=virtual
                    ),
                    vp_stage=stage,
                )
                for stage in range(virtual)
            ]
    # The last stage's copy of tied embeddings starts as the first stage's.
    broadcast_tied_embeddings(modules, parallel_state.get_embedding_group())
    num_parameters = sum(_num_parameters(module) for module in modules)
    # As Megatron-LM: with tensor parallelism, rank 0 holds (and reports) its share only.
    where = f" on tensor-parallel rank 0 of {args.tensor_model_parallel_size}"
    print_rank_0(
        f"> number of parameters{where if args.tensor_model_parallel_size > 1 else ''}: "
        f"{num_parameters:,} ({_short_count(num_parameters)})"
    )

    ddp_config = get_megatron_ddp_config(args)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    wrapper = data_parallel_class(ddp_config)
    model = [
        wrapper(module.config, ddp_config, module, pg_collection=pg_collection)
        for module in modules
    ]
    for chunk in model:
        if isinstance(chunk, DistributedDataParallel):
            # Equal seeds give equal weights already; this guards against a provider that draws
            # random numbers differently on some rank (Megatron-LM broadcasts too).
            chunk.broadcast_params()
    engine = (
        f"Megatron-FSDP ({args.data_parallel_sharding_strategy}"
        f"{accumulation_memory_note(model[0], args)}{unit_memory_note(model[0], args)})"
        if args.use_megatron_fsdp
        else "the DDP engine"
    )
    chunks = f" for each of {len(model)} model chunks" if len(model) > 1 else ""
    print_rank_0(
        f"> training with {engine}{chunks}: global batch {args.global_batch_size} = "
        f"{args.num_microbatches} microbatch(es) x micro batch {args.micro_batch_size} x "
        f"data-parallel size {args.data_parallel_size}"
    )
    fp8_line = fp8_startup_line(modules[0].config, get_device())
    if fp8_line is not None:
        print_rank_0(fp8_line)
    return model


def get_optimizer_param_scheduler(
    optimizer: MegatronOptimizer, args: argparse.Namespace
) -> OptimizerParamScheduler:
    """The learning-rate and weight-decay schedule the flags describe, counted in samples as
    Megatron-LM's (`train_step` steps it by each iteration's global batch)."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_style=args.weight_decay_incr_style,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        **lr_schedule_steps(args),
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def setup_model_and_optimizer(
    model_provider: ModelProvider, model_type: ModelType, args: argparse.Namespace
) -> tuple[list[_BaseDataParallel], MegatronOptimizer, OptimizerParamScheduler]:
    """Builds the wrapped model chunks (`get_model`), then one optimizer over them all and the
    learning-rate schedule.

    The optimizer is built after wrapping, over what the engine steps; with a full-iteration
    CUDA graph, with kernels a graph can capture (`get_megatron_optimizer(capturable=True)`).
    """
    model = get_model(model_provider, model_type, args)
    optimizer = get_megatron_optimizer(
        get_megatron_optimizer_config(args), model, capturable=full_iteration_cuda_graph(args)
    )
    scheduler = get_optimizer_param_scheduler(optimizer, args)
    return model, optimizer, scheduler


def _short_count(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"


def _num_parameters(module: torch.nn.Module) -> int:
    # Megatron-FSDP's DTensor parameters report their global shape, so this is the full count.
    return sum(param.numel() for param in module.parameters())
