"""The training loop (`train()`) and what it measured (`TrainingHistory`).

`train()` runs `_TrainingLoop`, whose parts are one iteration's step (`start_train_step`) and
bookkeeping (the `TrainState`, the history, the log), the exit decision, the periodic
evaluation and the periodic save, in that order on every rank (their collectives match).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator

from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.stage import Model, model_chunks
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.multi_token_prediction import get_mtp_loss_logging_helper
from megatron.training.checkpointing import save_checkpoint
from megatron.training.cuda_graphs import GraphedIteration
from megatron.training.dist_signal_handler import ExitConditions
from megatron.training.evaluation import evaluate_and_print_results
from megatron.training.flag_groups.cuda_graphs import full_iteration_cuda_graph
from megatron.training.flag_groups.training_schedule import batch_size_schedule
from megatron.training.loss_reduction import ReducedLosses
from megatron.training.optimizer_step import PendingStep, check_losses_finite
from megatron.training.profiling import TrainingOperations
from megatron.training.schedules import DataIterator, ForwardStepFunc
from megatron.training.train_state import TrainState
from megatron.training.train_step import compute_gradients, start_train_step
from megatron.training.training_log import TrainingLog
from megatron.training.utils import get_device, logger, print_rank_0, report_rank_0


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
) -> TrainingHistory:
    """Runs the training loop from iteration `log.train_state.iteration + 1` to `--train-iters`,
    or until `--exit-interval`, `--exit-duration-in-mins` or `--exit-signal-handler`'s signal.

    Logs every `--log-interval` iterations and at the last one, evaluates on the validation
    split every `--eval-interval`, and with `--save` checkpoints every `--save-interval` and
    when the loop ends. Advances the log's `TrainState` (the iteration, the consumed samples,
    the skipped and nan iteration counts and the FLOPs so far: the progress the log reports
    and a checkpoint saves); `args` are only read.

    Args:
        forward_step_func: `(data_iterator, model) -> (output_tensor, loss_func)`.
        model: the wrapped model, or the list of this rank's wrapped model chunks.
        optimizer: steps the model's main weights.
        scheduler: the learning-rate and weight-decay schedule.
        train_data_iterator: this rank's training micro-batches (None: none left).
        valid_data_iterator: this rank's validation micro-batches; None: no evaluation.
        args: validated arguments.
        log: reports the iterations and evaluations, and holds the progress the loop
            continues from (`TrainingLog(..., train_state)`: `load_checkpoint()`'s, or a
            fresh one).
        operations: the profiler and garbage collection, told where iterations start and end.
        exits: the signal and duration exits (None: neither).

    Returns:
        What the iterations measured (the end-of-training evaluations are left to the caller).
    """
    train_state = log.train_state
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

    losses: ReducedLosses
    auxiliary_losses: tuple[ReducedLosses, ...]  # MoE, multi-token prediction
    step: PendingStep  # the optimizer step, its outcome read when first needed
    step_loss_scale: float  # before the step: what an overflow is reported at
    loss_scale: float  # after it: the scale the next iteration uses
    global_batch_size: int
    consumed_samples: int  # up to and including this iteration
    params_norm: float | None  # after the step (--log-params-norm)


@dataclasses.dataclass(frozen=True)
class _Unrecorded:
    """An iteration done, and not yet in the history and the log (`_TrainingLoop.record`)."""

    iteration: int
    result: _IterationResult
    last: bool  # training stops after it
    seconds: float


@dataclasses.dataclass
class _TrainingLoop:
    """`train()`'s loop, in its parts: one iteration's step and bookkeeping (`step`,
    `record`), the exit decision (`exit_reason`), the periodic evaluation and the periodic
    save. The order within an iteration is the one every rank keeps (the parts' collectives
    must match): step, exit decision, record, evaluation, save, exit.

    An iteration's losses and its optimizer step's outcome (whether it updated, the gradient
    norm: `optimizer_step.py`) stay on the device until the next iteration (its optimizer step
    reads the outcome, its record the losses), which finds them computed: reading them at once
    would make the host wait for the step's GPU work instead of queueing the next iteration.
    They are read at once where they are needed now: the log's line, an evaluation, a save and
    the last iteration. The iterations go to the history, the log and the state's count of
    skipped steps in order, when they are read (so an iteration whose successor fails is not
    recorded); should the loop stop with an error, the step left unread is read before the
    error leaves it, so that the schedule has stepped for every iteration the state counts.

    An iteration's time runs from the end of the previous one's (its `record`) to the end of
    its own, evaluations and saves between them left out: wall-clock time, in which the GPU
    work the host did not wait for counts where the host waits for it.
    """

    forward_step_func: ForwardStepFunc
    model: Model
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    train_data_iterator: DataIterator | None
    valid_data_iterator: DataIterator | None
    args: argparse.Namespace
    log: TrainingLog
    operations: TrainingOperations
    exits: ExitConditions | None
    history: TrainingHistory
    graph: GraphedIteration | None

    _unrecorded: _Unrecorded | None = dataclasses.field(default=None, init=False)
    # The optimizer step of the last iteration the state counts, read or not (at most one step
    # is unread: taking a step reads the one before).
    _latest_step: PendingStep | None = dataclasses.field(default=None, init=False)
    _clock: float = dataclasses.field(default=0.0, init=False)  # where the iteration's time starts

    def __post_init__(self) -> None:
        self.batch_sizes = batch_size_schedule(self.args)

    @property
    def state(self) -> TrainState:
        """The progress the loop advances: the log's."""
        return self.log.train_state

    def run(self) -> None:
        """Trains from the iteration after `state.iteration` until `--train-iters` or an exit."""
        args = self.args
        self._clock = time.perf_counter()
        try:
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
        except BaseException:
            self._settle_after_error()
            raise

    def step(self, iteration: int) -> _IterationResult:
        """Trains iteration `iteration` (`start_train_step`), reports its auxiliary losses, and
        advances the state past it."""
        args, optimizer = self.args, self.optimizer
        global_batch_size = self.batch_sizes.global_batch_size(self.state.consumed_train_samples)
        samples_per_microbatch = args.micro_batch_size * args.data_parallel_size
        num_microbatches = global_batch_size // samples_per_microbatch
        step_loss_scale = optimizer.get_loss_scale()
        losses, step = start_train_step(
            self.forward_step_func,
            self.train_data_iterator,
            self.model,
            optimizer,
            self.scheduler,
            args,
            previous=self._latest_step,
            num_microbatches=num_microbatches,
            graph=self.graph,
        )
        # Every step, on every rank (it all-reduces and clears the step's metrics).
        auxiliary_losses = (
            self.log.report_moe_metrics(iteration, num_microbatches),
            self.log.report_mtp_metrics(num_microbatches),
        )
        self.state.record_iteration(
            iteration,
            global_batch_size,
            # FLOPs are linear in the batch: each iteration counts at its own global batch.
            self.log.flops_per_sample * global_batch_size,
        )
        self._latest_step = step
        return _IterationResult(
            losses=losses,
            auxiliary_losses=auxiliary_losses,
            step=step,
            step_loss_scale=step_loss_scale,
            # After the step: the scale the next iteration uses (Megatron-LM logs the same).
            loss_scale=optimizer.get_loss_scale(),
            global_batch_size=global_batch_size,
            consumed_samples=self.state.consumed_train_samples,
            params_norm=optimizer.get_params_norm() if args.log_params_norm else None,
        )

    def exit_reason(self, iteration: int) -> str | None:
        """Why training stops after `iteration` (None: it goes on, up to `--train-iters`)."""
        stop_reason = None if self.exits is None else self.exits.reason()
        if self.args.exit_interval is not None and iteration % self.args.exit_interval == 0:
            stop_reason = "--exit-interval"
        return stop_reason

    def record(self, iteration: int, result: _IterationResult, last: bool) -> None:
        """Ends the iteration's time; adds the iteration before it to the history and the log,
        and this one too where its losses are needed now (`last`: training stops after it); see
        the class."""
        self._record_unrecorded()
        parts = (result.losses, *result.auxiliary_losses)
        if self.log.logs_line(iteration, last):
            for part in parts:
                part.read()
            result.step.outcome()
        now = time.perf_counter()
        self._unrecorded = _Unrecorded(iteration, result, last, now - self._clock)
        self._clock = now
        # Read already: just now, or nothing was left on the device (a CUDA graph's iteration;
        # pipeline stages' losses with a step read at once).
        if all(part.is_read for part in parts) and result.step.is_read:
            self._record_unrecorded()

    def _settle_after_error(self) -> None:
        """Reads the optimizer step of the last iteration the state counts, if it was left
        unread, so that the schedule has stepped for every such iteration when the loop's error
        reaches a caller that catches it and saves (the state's count of skipped iterations
        still grows only as iterations are recorded). An error of this read (the device's, or
        the check of a skipped step) is logged: the loop's own is the one raised."""
        if self._latest_step is None:
            return
        try:
            self._latest_step.outcome()  # returns at once where it was read already
        except Exception:
            logger.exception("train(): reading the last optimizer step after an error raised:")

    @contextlib.contextmanager
    def _untimed(self) -> Iterator[None]:
        """Leaves what runs inside out of the iterations' time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._clock += time.perf_counter() - start

    def _record_unrecorded(self) -> None:
        """Adds the iteration not yet recorded (if any) to the history and the log, once its
        losses are read."""
        if self._unrecorded is None:
            return
        done, self._unrecorded = self._unrecorded, None
        iteration, result = done.iteration, done.result
        outcome = result.step.outcome()
        losses = result.losses.read()
        if self.args.check_for_nan_in_loss_and_grad:
            check_losses_finite(losses)
        auxiliary_losses = {
            key: value for part in result.auxiliary_losses for key, value in part.read().items()
        }
        history = self.history
        skipped = not outcome.update_successful
        if skipped:
            self.state.record_skipped_step(losses)
            history.skipped_iterations.append(iteration)
            why = (
                f"the gradients overflowed at loss scale {result.step_loss_scale:g}"
                if outcome.grad_norm is None
                else f"the gradient norm is {outcome.grad_norm}"
            )
            print_rank_0(
                f"iteration {iteration}: skipped the optimizer step, {why} (losses "
                f"{losses}); weights and learning rate are unchanged.",
                logging.WARNING,
            )
        history.losses.append({**losses, **auxiliary_losses})
        history.grad_norms.append(outcome.grad_norm)
        history.loss_scales.append(result.loss_scale)
        history.learning_rates.append(outcome.learning_rate)
        self.log.record_iteration(
            iteration,
            losses,
            skipped,
            outcome.grad_norm,
            outcome.learning_rate,
            done.seconds,
            last=done.last,
            loss_scale=result.loss_scale,
            num_zeros_in_grad=outcome.num_zeros_in_grad,
            params_norm=result.params_norm,
            auxiliary_losses=auxiliary_losses,
            global_batch_size=result.global_batch_size,
            consumed_samples=result.consumed_samples,
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
        # Evaluating waits for the GPU anyway: the iteration is read first, so that a skipped
        # step's error (--check-for-nan-in-loss-and-grad) comes before the evaluation's.
        self._record_unrecorded()
        if self.graph is not None:
            self.graph.before_eager_use()
        with self._untimed(), self.operations.evaluation():
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
            # A non-finite loss (--check-for-nan-in-loss-and-grad) raises before the save.
            self._record_unrecorded()
            with self._untimed():
                save_checkpoint(self.state, self.model, self.optimizer, self.scheduler, args)
