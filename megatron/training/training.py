"""The pretraining loop: `pretrain()`, Megatron-LM's entry point, and the steps it is made of.

`pretrain()` initialises the job (`initialize_megatron`), builds the model through the
script's `model_provider` and wraps it with Megatron-FSDP (`--use-megatron-fsdp`) or the DDP
engine, builds the optimizer and learning-rate schedule, the data iterators from the script's
dataset provider, then trains for `--train-iters` iterations, evaluating every
`--eval-interval`, and once more (validation and test) at the end.

One iteration (`train_step`) on either engine::

    model.zero_grad_buffer(); optimizer.zero_grad()
    model.start_param_sync()           # Megatron-FSDP: gather the first unit early
    MoEAuxLossAutoScaler.set_loss_scale(loss scale x cp / num_microbatches)  # MoE and MTP
    for each of the num_microbatches = global batch / (micro batch x data-parallel size):
        with microbatch(...) / no_sync():  # reductions run once, after the last one
            forward, loss / num_microbatches, backward
    model.finish_grad_sync()
    update_expert_bias(...)            # --moe-router-enable-expert-bias
    optimizer.step()                   # global grad norm; skip if not finite; clip; step
    scheduler.step(global batch)       # in samples, only after a real update, as Megatron-LM's
    # with --check-for-nan-in-loss-and-grad (the default): raise on a non-finite loss or norm
    get_moe_metrics_tracker().report(...)  # every step: the MoE losses of the log, cleared
    get_mtp_loss_logging_helper().report(...)  # likewise the multi-token prediction losses

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
import dataclasses
import functools
import logging
import math
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
from megatron.core.pipeline_parallel.stage import Model, model_chunks
from megatron.core.pipeline_parallel.tied_embeddings import (
    allreduce_tied_embedding_grads,
    broadcast_tied_embeddings,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, update_expert_bias
from megatron.core.transformer.multi_token_prediction import get_mtp_loss_logging_helper
from megatron.training.arguments import get_megatron_ddp_config, get_megatron_optimizer_config
from megatron.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megatron.training.cuda_graphs import GraphedIteration
from megatron.training.data_iterators import DatasetProvider, build_train_valid_test_data_iterators
from megatron.training.dist_signal_handler import ExitConditions
from megatron.training.evaluation import evaluate_and_print_results
from megatron.training.flag_errors import reported_as_flag_errors
from megatron.training.flag_groups.cuda_graphs import full_iteration_cuda_graph
from megatron.training.flag_groups.optimization import lr_schedule_steps
from megatron.training.flag_groups.training_schedule import batch_size_schedule
from megatron.training.flops import num_floating_point_operations
from megatron.training.initialize import ExtraArgsProvider, destroy_megatron, initialize_megatron
from megatron.training.loss_reduction import average_loss_dicts, divide_gradients_by_tokens
from megatron.training.profiling import TrainingOperations, empty_unused_memory
from megatron.training.save_directory import claim_save_directory
from megatron.training.schedules import DataIterator, ForwardStepFunc, forward_backward
from megatron.training.train_state import TrainState
from megatron.training.training_log import TrainingLog, fp8_startup_line
from megatron.training.utils import (
    LoaderIterator,
    accumulation_memory_note,
    get_device,
    logger,
    print_rank_0,
    report_rank_0,
    unit_memory_note,
)

ModelProvider = Callable[..., torch.nn.Module]


@dataclasses.dataclass
class TrainingHistory:
    """What `pretrain()` measured, the same on every rank (values are averaged over ranks).

    Attributes:
        start_iteration: the iteration training resumed after (0 without a checkpoint).
        losses: per iteration (index i is iteration start_iteration + i + 1), the reported
            losses averaged over the microbatches and the data-parallel ranks (skipped
            iterations included); with MoE layers also their auxiliary losses
            ("load_balancing_loss", "z_loss", ...: the mean over the MoE layers), with
            multi-token prediction each depth's loss ("mtp_1 loss", ...).
        grad_norms: per iteration, the global gradient norm before clipping (None where
            fp16's loss scaler skipped the step on an overflow).
        loss_scales: per iteration, the loss scale after its step (1.0 without loss scaling).
        learning_rates: per iteration, the learning rate after its schedule step, i.e. the
            next iteration's (Megatron-LM logs this one).
        skipped_iterations: iterations whose optimizer step was skipped (non-finite gradients).
        validation_losses: iteration -> the losses of the evaluation run after it.
        final_validation_losses: the evaluation at the end of training (None: no validation).
        test_losses: the test-split evaluation at the end of training (None: no test split).
    """

    start_iteration: int = 0
    losses: list[dict[str, float]] = dataclasses.field(default_factory=list)
    grad_norms: list[float | None] = dataclasses.field(default_factory=list)
    loss_scales: list[float] = dataclasses.field(default_factory=list)
    learning_rates: list[float] = dataclasses.field(default_factory=list)
    skipped_iterations: list[int] = dataclasses.field(default_factory=list)
    validation_losses: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    final_validation_losses: dict[str, float] | None = None
    test_losses: dict[str, float] | None = None

    def loss_curve(self, key: str = "lm loss") -> list[float]:
        """One reported loss per iteration."""
        return [losses[key] for losses in self.losses]


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
                    train_state=train_state,
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


def train_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: DataIterator,
    model: Model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
    num_microbatches: int | None = None,
    graph: GraphedIteration | None = None,
) -> tuple[dict[str, float], bool, float | None, int | None]:
    """One iteration: every microbatch's forward and backward, then the optimizer step.

    Args:
        forward_step_func: `(data_iterator, model) -> (output_tensor, loss_func)`.
        data_iterator: this rank's training micro-batches.
        model: the wrapped model, or the list of this rank's wrapped model chunks.
        optimizer: steps the model's main weights.
        scheduler: stepped after a successful update.
        args: validated arguments (`num_microbatches`, `check_for_nan_in_loss_and_grad`,
            `calculate_per_token_loss`).
        num_microbatches: this iteration's (a batch-size schedule's); None: `args`'.
        graph: with a full-iteration CUDA graph, runs the iteration's device work (the same
            computation, the optimizer stepping on the device: `megatron.training.cuda_graphs`).

    Returns:
        (losses, skipped, grad_norm, num_zeros_in_grad): the averaged reported losses, whether
        the optimizer step was skipped (a gradient norm that is not finite, or an fp16
        overflow), that norm (None when the loss scaler skipped the step before taking it),
        and the number of zero gradient elements (None without `--log-num-zeros-in-grad`).

    Raises:
        RuntimeError: a loss or the global gradient norm is not finite and
            `--check-for-nan-in-loss-and-grad` is on. Both are the same on every rank (reduced
            over the data-parallel group), so every rank raises.
    """
    if num_microbatches is None:
        num_microbatches = args.num_microbatches
    if graph is not None:
        losses, update_successful, grad_norm, num_zeros_in_grad = graph(data_iterator)
    else:
        loss_dicts = compute_gradients(
            forward_step_func, model, optimizer, args, data_iterator, num_microbatches
        )
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
        empty_unused_memory(args, level=2)
        losses = average_loss_dicts(loss_dicts)
    if update_successful:
        # In samples, as Megatron-LM's schedule (get_optimizer_param_scheduler).
        scheduler.step(num_microbatches * args.micro_batch_size * args.data_parallel_size)
    # Checked after the step (which synchronises anyway) to add no wait of its own; a
    # non-finite loss or norm means the step was skipped.
    if args.check_for_nan_in_loss_and_grad:
        skip = "or pass --no-check-for-nan-in-loss-and-grad to skip such steps and continue."
        if not all(map(math.isfinite, losses.values())):
            raise RuntimeError(
                f"The loss is not finite ({losses}; --check-for-nan-in-loss-and-grad). Lower "
                f"--lr or check the data; {skip}"
            )
        # None: fp16's loss scaler skipped the step (an overflow is its signal, not an error).
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise RuntimeError(
                f"The global gradient norm is {grad_norm} though the loss is finite ({losses}; "
                f"--check-for-nan-in-loss-and-grad). Lower --lr or check the model; {skip}"
            )
    return losses, not update_successful, grad_norm, num_zeros_in_grad


def compute_gradients(
    forward_step_func: ForwardStepFunc,
    model: Model,
    optimizer: MegatronOptimizer,
    args: argparse.Namespace,
    data_iterator: DataIterator,
    num_microbatches: int,
) -> list[dict[str, torch.Tensor]]:
    """Every microbatch's forward and backward through this rank's model chunks, then the
    reduced gradients, ready for the optimizer step (a full-iteration CUDA graph captures this
    too). Returns each microbatch's reported losses (this rank's)."""
    chunks = model_chunks(model)
    config = chunks[0].config
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for chunk in chunks:
        chunk.start_param_sync()
    if config.num_moe_experts is not None or config.mtp_num_layers is not None:
        _set_auxiliary_loss_scale(optimizer, num_microbatches, args)
    loss_dicts, num_tokens = forward_backward(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        scale_loss=optimizer.scale_loss,
        calculate_per_token_loss=args.calculate_per_token_loss,
        cp_group=parallel_state.get_context_parallel_group(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
    )
    empty_unused_memory(args, level=1)
    for chunk in chunks:
        chunk.finish_grad_sync()
    # The two stages' copies of tied embeddings take the sum of their gradients.
    allreduce_tied_embedding_grads(chunks, parallel_state.get_embedding_group())
    if args.calculate_per_token_loss:
        divide_gradients_by_tokens(chunks, num_tokens)
    if config.moe_router_enable_expert_bias:
        # Megatron-core's place: once the gradients are final, before the step; every step
        # counts, skipped or not. The counts are summed over dp x cp here and over tp by the
        # routers' own group (under sequence parallelism each tp rank routes its own part of
        # the sequence): upstream's tp x dp x cp.
        update_expert_bias(
            chunks, parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
    return loss_dicts


def _set_auxiliary_loss_scale(
    optimizer: MegatronOptimizer, num_microbatches: int, args: argparse.Namespace
) -> None:
    """Gives the MoE auxiliary losses and the multi-token prediction losses the gradient scale
    of the main loss: the loss scale, divided by the microbatches and multiplied by the
    context-parallel size unless the loss is summed over tokens (as Megatron-core's schedule;
    each cp rank backpropagates its share of those losses, and the engines average over the cp
    ranks, as for the main loss). Their backward bypasses the loss, so it cannot inherit the
    scale. `MTPLossAutoScaler` shares `MoEAuxLossAutoScaler`'s scale."""
    scale = optimizer.scale_loss(torch.ones((), device=get_device()))
    if not args.calculate_per_token_loss:
        scale = scale * args.context_parallel_size / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale)


def train(
    forward_step_func: ForwardStepFunc,
    model: Model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    train_data_iterator: DataIterator | None,
    valid_data_iterator: DataIterator | None,
    args: argparse.Namespace,
    log: TrainingLog,
    operations: TrainingOperations,
    exits: ExitConditions | None = None,
    *,
    train_state: TrainState | None = None,
) -> TrainingHistory:
    """Runs the training loop from iteration `train_state.iteration + 1` to `--train-iters`, or
    until `--exit-interval`, `--exit-duration-in-mins` or `--exit-signal-handler`'s signal.

    Logs every `--log-interval` iterations and at the last one, evaluates on the validation
    split every `--eval-interval`, and with `--save` checkpoints every `--save-interval` and
    when the loop ends. Advances `train_state` (the iteration, the consumed samples, the
    skipped and nan iteration counts and the FLOPs so far); `args` are only read.

    Args:
        forward_step_func: `(data_iterator, model) -> (output_tensor, loss_func)`.
        model: the wrapped model, or the list of this rank's wrapped model chunks.
        optimizer: steps the model's main weights.
        scheduler: the learning-rate and weight-decay schedule.
        train_data_iterator: this rank's training micro-batches (None: none left).
        valid_data_iterator: this rank's validation micro-batches; None: no evaluation.
        args: validated arguments.
        log: reports the iterations and evaluations; it reads the consumed samples from
            `log.train_state`, so it must be built with `train_state`.
        operations: the profiler and garbage collection, told where iterations start and end.
        exits: the signal and duration exits (None: neither).
        train_state: the progress to continue from (`load_checkpoint()`'s); None: the log's
            (a fresh one unless the log was built with another).

    Returns:
        What the iterations measured (the end-of-training evaluations are left to the caller).

    Raises:
        ValueError: `log` reports another `TrainState` than `train_state`.
    """
    if train_state is None:
        train_state = log.train_state
    if log.train_state is not train_state:
        raise ValueError(
            "train(): the log reads another TrainState than the one the loop advances, so its "
            "consumed samples would not move; build TrainingLog(..., train_state=train_state)."
        )
    history = TrainingHistory(start_iteration=train_state.iteration)
    if train_state.iteration >= args.train_iters:
        print_rank_0(
            f"> the checkpoint is of iteration {train_state.iteration}, --train-iters is "
            f"{args.train_iters}: nothing to train"
        )
        return history
    chunks = model_chunks(model)
    for chunk in chunks:
        chunk.train()
    # The trackers are process-wide: what was recorded before this loop (another model in the
    # process, a forward outside training) is not this run's first iteration's.
    get_moe_metrics_tracker().clear()
    get_mtp_loss_logging_helper().clear()
    print_rank_0("> training ...")
    graph = None
    if full_iteration_cuda_graph(args):
        # Without pipeline stages (the flags refuse graphs with them): one chunk.
        graph = GraphedIteration(
            functools.partial(compute_gradients, forward_step_func, model, optimizer, args),
            chunks[0],
            optimizer,
            args,
            get_device(),
        )
    try:
        loop = _TrainingLoop(
            forward_step_func,
            model,
            optimizer,
            scheduler,
            train_data_iterator,
            valid_data_iterator,
            args,
            log,
            operations,
            exits,
            train_state,
            history,
            graph,
        )
        loop.run()
        if graph is not None:
            graph.before_eager_use()  # the end-of-training evaluations follow
    finally:
        if graph is not None:
            # Also on an error: a live graph holds the NCCL communicators it captured, and
            # destroying the process groups would wait for it.
            graph.close()
    return history


@dataclasses.dataclass(frozen=True)
class _IterationResult:
    """What one training iteration measured (`_TrainingLoop.step`)."""

    losses: dict[str, float]
    auxiliary_losses: dict[str, float]
    skipped: bool
    grad_norm: float | None
    num_zeros_in_grad: int | None
    step_loss_scale: float  # before the step: what an overflow is reported at
    loss_scale: float  # after it: the scale the next iteration uses
    learning_rate: float
    global_batch_size: int
    seconds: float


class _TrainingLoop:
    """`train()`'s loop, in its parts: one iteration's step and bookkeeping (`step`,
    `record`), the exit decision (`exit_reason`), the periodic evaluation and the periodic
    save. The order within an iteration is the one every rank keeps (the parts' collectives
    must match): step, exit decision, record, evaluation, save, exit."""

    def __init__(
        self,
        forward_step_func: ForwardStepFunc,
        model: Model,
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        train_data_iterator: DataIterator | None,
        valid_data_iterator: DataIterator | None,
        args: argparse.Namespace,
        log: TrainingLog,
        operations: TrainingOperations,
        exits: ExitConditions | None,
        state: TrainState,
        history: TrainingHistory,
        graph: GraphedIteration | None,
    ):
        self.forward_step_func = forward_step_func
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_data_iterator = train_data_iterator
        self.valid_data_iterator = valid_data_iterator
        self.args = args
        self.log = log
        self.operations = operations
        self.exits = exits
        self.state = state
        self.history = history
        self.graph = graph
        self.batch_sizes = batch_size_schedule(args)
        # FLOPs are linear in the batch: each iteration counts at its own global batch size.
        self.flops_per_sample = num_floating_point_operations(
            model_chunks(model)[0].config, args.padded_vocab_size, args.seq_length, 1
        )

    def run(self) -> None:
        """Trains from the iteration after `state.iteration` until `--train-iters` or an exit."""
        args = self.args
        for iteration in range(self.state.iteration + 1, args.train_iters + 1):
            self.operations.before_iteration(iteration)
            result = self.step(iteration)
            stop_reason = self.exit_reason(iteration)
            last = stop_reason is not None or iteration == args.train_iters
            self.record(iteration, result, last)
            self.operations.after_iteration(iteration, last=last)
            self.evaluate_periodically(iteration)
            self.save_periodically(iteration, exiting=stop_reason is not None)
            if stop_reason is not None:
                report_rank_0(f"> exiting at iteration {iteration} ({stop_reason})")
                break

    def step(self, iteration: int) -> _IterationResult:
        """Trains iteration `iteration` (`train_step`), reports its auxiliary losses, and
        advances the state past it."""
        args, optimizer = self.args, self.optimizer
        start = time.perf_counter()
        global_batch_size = self.batch_sizes.global_batch_size(self.state.consumed_train_samples)
        samples_per_microbatch = args.micro_batch_size * args.data_parallel_size
        num_microbatches = global_batch_size // samples_per_microbatch
        step_loss_scale = optimizer.get_loss_scale()
        losses, skipped, grad_norm, num_zeros_in_grad = train_step(
            self.forward_step_func,
            self.train_data_iterator,
            self.model,
            optimizer,
            self.scheduler,
            args,
            num_microbatches=num_microbatches,
            graph=self.graph,
        )
        seconds = time.perf_counter() - start
        # Every step, on every rank (it all-reduces and clears the step's metrics).
        auxiliary_losses = {
            **self.log.report_moe_metrics(iteration, num_microbatches),
            **self.log.report_mtp_metrics(iteration, num_microbatches),
        }
        self.state.record_iteration(
            iteration,
            global_batch_size,
            self.flops_per_sample * global_batch_size,
            skipped,
            losses,
        )
        return _IterationResult(
            losses=losses,
            auxiliary_losses=auxiliary_losses,
            skipped=skipped,
            grad_norm=grad_norm,
            num_zeros_in_grad=num_zeros_in_grad,
            step_loss_scale=step_loss_scale,
            # After the step: the scale the next iteration uses (Megatron-LM logs the same).
            loss_scale=optimizer.get_loss_scale(),
            # Megatron-LM's convention: the rate after this step's schedule update (the next
            # one's).
            learning_rate=optimizer.param_groups[0]["lr"],
            global_batch_size=global_batch_size,
            seconds=seconds,
        )

    def exit_reason(self, iteration: int) -> str | None:
        """Why training stops after `iteration` (None: it goes on, up to `--train-iters`)."""
        stop_reason = None if self.exits is None else self.exits.reason()
        if self.args.exit_interval is not None and iteration % self.args.exit_interval == 0:
            stop_reason = "--exit-interval"
        return stop_reason

    def record(self, iteration: int, result: _IterationResult, last: bool) -> None:
        """Adds the iteration to the history and the log (`last`: training stops after it)."""
        history = self.history
        if result.skipped:
            history.skipped_iterations.append(iteration)
            why = (
                f"the gradients overflowed at loss scale {result.step_loss_scale:g}"
                if result.grad_norm is None
                else f"the gradient norm is {result.grad_norm}"
            )
            print_rank_0(
                f"iteration {iteration}: skipped the optimizer step, {why} (losses "
                f"{result.losses}); weights and learning rate are unchanged.",
                logging.WARNING,
            )
        history.losses.append({**result.losses, **result.auxiliary_losses})
        history.grad_norms.append(result.grad_norm)
        history.loss_scales.append(result.loss_scale)
        history.learning_rates.append(result.learning_rate)
        self.log.record_iteration(
            iteration,
            result.losses,
            result.skipped,
            result.grad_norm,
            result.learning_rate,
            result.seconds,
            last=last,
            loss_scale=result.loss_scale,
            num_zeros_in_grad=result.num_zeros_in_grad,
            params_norm=self.optimizer.get_params_norm() if self.args.log_params_norm else None,
            auxiliary_losses=result.auxiliary_losses,
            global_batch_size=result.global_batch_size,
        )

    def evaluate_periodically(self, iteration: int) -> None:
        """Evaluates on the validation split every `--eval-interval` iterations."""
        args = self.args
        if (
            self.valid_data_iterator is None
            or args.eval_interval is None
            or iteration % args.eval_interval != 0
        ):
            return
        if self.graph is not None:
            self.graph.before_eager_use()
        with self.operations.evaluation():
            self.history.validation_losses[iteration] = evaluate_and_print_results(
                self.forward_step_func,
                self.valid_data_iterator,
                self.model,
                args,
                self.log,
                split="validation",
                when=f"iteration {iteration}",
                iteration=iteration,
            )
        self.state.record_evaluation(args.eval_iters * args.global_batch_size)

    def save_periodically(self, iteration: int, exiting: bool) -> None:
        """With `--save`, checkpoints every `--save-interval` iterations and when training
        stops (`exiting`, or at `--train-iters`)."""
        args = self.args
        if args.save is not None and (
            exiting
            or iteration == args.train_iters
            or (args.save_interval is not None and iteration % args.save_interval == 0)
        ):
            save_checkpoint(self.state, self.model, self.optimizer, self.scheduler, args)


def _short_count(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"


def _num_parameters(module: torch.nn.Module) -> int:
    # Megatron-FSDP's DTensor parameters report their global shape, so this is the full count.
    return sum(param.numel() for param in module.parameters())
