"""What the training loop reports: Megatron-LM's periodic log line, the evaluation summaries,
and the TensorBoard / Weights & Biases scalars.

Every `--log-interval` iterations, and at the last one, rank 0 logs one line (wrapped here;
like the evaluations, at any `--logging-level`: `report_rank_0`) such as::

    iteration       20/     200 | consumed samples:          320 | elapsed time per iteration
    (ms): 115.3 | tokens/s/GPU: 4442.5 | learning rate: 1.990053E-03 | global batch size:    16
    | lm loss: 3.703642E+00 | loss scale: 1.0 | grad norm: 0.933 | number of skipped
    iterations:   0 | number of nan iterations:   0 | 10.0% done, ETA 0:00:21

Times cover training steps only, not evaluation. The loss is averaged over the interval's
non-skipped iterations (each already averaged over its microbatches and the data-parallel
ranks), the time over its iterations; tokens/s and TFLOP/s count the samples its iterations
trained, each at its own global batch size (smaller during a `--rampup-batch-size` ramp). The
global batch size (TensorBoard's `batch-size`: its iteration's), the loss scale (1.0 without
fp16 / `--loss-scale`), the grad norm (none when fp16's loss scaler skipped the step on an
overflow), and where `--log-num-zeros-in-grad` and `--log-params-norm` ask for them the
zero-gradient count and the parameters' norm are the last iteration's; the learning rate is the
one after its schedule step (Megatron-LM's convention: the next iteration's). On GPU the line
also has TFLOP/s per GPU (on CPU too with `--log-throughput`) and the peak memory allocated so
far. An MoE model's auxiliary losses (`report_moe_metrics`, every step) and a multi-token
prediction model's per-depth losses ("mtp_1 loss", ...: `report_mtp_metrics`) follow the
language-model loss, averaged like it (on the device until read, as the losses are). An FP8
run names its format and recipe after the global batch size (`fp8: hybrid delayed`), and says at
start-up which layers train in FP8 (`fp8_startup_line`); TFLOP/s count the same FLOPs as in bf16
(upstream's formula), so FP8's speed shows as more TFLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import os

import torch

from megatron.core.fp8.experts import describe_expert_gemms
from megatron.core.fp8.recipe import is_first_last_bf16_layer, recipe_from_config
from megatron.core.transformer.moe.moe_config import layer_pattern
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.router import tracked_metrics
from megatron.core.transformer.multi_token_prediction import get_mtp_loss_logging_helper
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flops import num_floating_point_operations
from megatron.training.loss_reduction import ReducedLosses
from megatron.training.train_state import TrainState, is_nan_iteration
from megatron.training.utils import is_rank_0, print_rank_0, report_rank_0


def fp8_startup_line(config: TransformerConfig, device: torch.device) -> str | None:
    """What an FP8 run trains in FP8, for the start-up log (None without FP8): "> FP8 (hybrid
    format, delayed scaling (...)) in the linear layers of 4 of 4 transformer layers [and of the 1
    multi-token prediction depth(s)]; ...", and for an MoE model how its experts' FP8 GEMMs run on
    `device` (where the grouped kernel is not used, this is where the log says so)."""
    recipe = recipe_from_config(config)
    if recipe is None:
        return None
    layers = config.num_layers
    in_fp8 = sum(not is_first_last_bf16_layer(config, n) for n in range(layers))
    depths = config.mtp_num_layers
    dtype = config.params_dtype
    line = (
        f"> FP8 ({recipe.describe()}) in the linear layers of {in_fp8} of {layers} transformer "
        f"layers{f' and of the {depths} multi-token prediction depth(s)' if depths else ''}; "
        "the embedding, the output layer, attention and norms in "
        f"{str(dtype).removeprefix('torch.')}"
    )
    if config.num_moe_experts is not None:
        grouped = config.moe_grouped_gemm
        graphed = config.cuda_graph_impl == "full_iteration"
        line += f"; {describe_expert_gemms(recipe, grouped, device, dtype, graphed)}"
    return line


class MetricWriter:
    """The TensorBoard and Weights & Biases runs the flags ask for (on rank 0; elsewhere, and
    without those flags, writing is a no-op)."""

    def __init__(self, args: argparse.Namespace):
        self.tensorboard = None
        self.wandb_run = None
        if not is_rank_0():
            return
        if args.tensorboard_dir is not None:
            # Optional dependency, imported only when asked for; as Megatron-LM, a run without
            # it goes on unplotted rather than failing.
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print_rank_0(
                    f"WARNING: --tensorboard-dir {args.tensorboard_dir}: the tensorboard package "
                    "is not installed (pip install tensorboard); no TensorBoard logs are written.",
                    logging.WARNING,
                )
            else:
                self.tensorboard = SummaryWriter(
                    log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size
                )
        if args.wandb_project is not None:
            import wandb

            # wandb stores plain values only (args hold dtypes, for one).
            config = {
                k: v if isinstance(v, (bool, int, float, str)) else str(v)
                for k, v in vars(args).items()
            }
            save_dir = args.wandb_save_dir
            if save_dir is None and args.save is not None:
                save_dir = os.path.join(args.save, "wandb")  # Megatron-LM's default
            self.wandb_run = wandb.init(
                dir=save_dir,
                project=args.wandb_project,
                entity=args.wandb_entity,
                name=args.wandb_exp_name,
                config=config,
            )

    @property
    def active(self) -> bool:
        """Whether anything is written (rank 0 with TensorBoard or wandb)."""
        return self.tensorboard is not None or self.wandb_run is not None

    def add_scalars(
        self, scalars: dict[str, float], iteration: int, samples: int | None = None
    ) -> None:
        """Writes each named value at step `iteration`; given `samples` (the consumed training
        samples), also to TensorBoard as "<name> vs samples" at that step, as Megatron-LM."""
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, iteration)
                if samples is not None:
                    self.tensorboard.add_scalar(f"{name} vs samples", value, samples)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=iteration)

    def close(self) -> None:
        """Flushes and closes the runs."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


@dataclasses.dataclass(frozen=True)
class _StepValues:
    """One iteration's values that the log reports as they are (the last of an interval)."""

    grad_norm: float | None
    learning_rate: float
    loss_scale: float
    global_batch_size: int
    num_zeros_in_grad: int | None
    params_norm: float | None
    consumed_samples: int


@dataclasses.dataclass
class _Interval:
    """What happened since the last log line."""

    iterations: int = 0
    seconds: float = 0.0
    samples: int = 0
    loss_sums: dict[str, float] = dataclasses.field(default_factory=dict)
    skipped: int = 0
    nan: int = 0


class TrainingLog:
    """Accumulates the training iterations between log lines and reports them.

    Args:
        args: validated arguments (batch sizes, intervals, logging flags).
        config: the model's config, for the FLOPs of an iteration.
        device: where the model computes (throughput and memory fields are GPU-only).
        train_state: the run's progress, which the loop advances before it records an
            iteration; the log reads its consumed training samples (`TrainState()` for a run
            from scratch).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        config: TransformerConfig,
        device: torch.device,
        train_state: TrainState,
    ):
        self.args = args
        self.train_state = train_state
        self.device = device
        self.writer = MetricWriter(args)
        # FLOPs are linear in the batch: a ramp's iterations are counted at their own size.
        self.flops_per_sample = num_floating_point_operations(
            config, args.padded_vocab_size, args.seq_length, 1
        )
        self.fp8 = recipe_from_config(config)
        self.interval = _Interval()
        # As Megatron-LM, the run's first iteration logs its line (its time shows the start's
        # one-off costs), leaving the interval's totals to the line that ends it.
        self._first_line_pending = True
        # Iteration -> its MoE layers' metrics, for TensorBoard (`--moe-per-layer-logging`).
        self._moe_layer_scalars: dict[int, ReducedLosses] = {}

    def record_iteration(
        self,
        iteration: int,
        losses: dict[str, float],
        skipped: bool,
        grad_norm: float | None,
        learning_rate: float,
        seconds: float,
        *,
        last: bool = False,
        loss_scale: float = 1.0,
        num_zeros_in_grad: int | None = None,
        params_norm: float | None = None,
        auxiliary_losses: dict[str, float] | None = None,
        global_batch_size: int | None = None,
        consumed_samples: int | None = None,
    ) -> None:
        """Adds one training iteration; logs the line when `iteration` ends an interval, or
        is the first of the run (resumed or not).

        Args:
            iteration: its number, from 1.
            losses: its reported losses (averaged over microbatches and ranks).
            skipped: whether its optimizer step was skipped.
            grad_norm: its global gradient norm (None: fp16's loss scaler skipped the step).
            learning_rate: the learning rate after its schedule step.
            seconds: how long it took.
            last: it is the last iteration of training: log the interval so far even when it
                is shorter than `--log-interval`.
            loss_scale: the loss scale after its step (1.0 without loss scaling).
            num_zeros_in_grad: its zero gradient elements (`--log-num-zeros-in-grad`).
            params_norm: the main weights' norm after its step (`--log-params-norm`).
            auxiliary_losses: its MoE auxiliary losses and multi-token prediction losses
                (`report_moe_metrics`, `report_mtp_metrics`): averaged in the line like
                `losses`, and written as scalars with them.
            global_batch_size: its global batch size, which a batch-size ramp
                (`--rampup-batch-size`) makes smaller than `--global-batch-size`; None: that.
            consumed_samples: the training samples consumed up to and including it; None: the
                train state's (the loop may record an iteration after the next one ran).
        """
        if global_batch_size is None:
            global_batch_size = self.args.global_batch_size
        if consumed_samples is None:
            consumed_samples = self.train_state.consumed_train_samples
        values = _StepValues(
            grad_norm,
            learning_rate,
            loss_scale,
            global_batch_size,
            num_zeros_in_grad,
            params_norm,
            consumed_samples,
        )
        interval = self.interval
        interval.iterations += 1
        interval.seconds += seconds
        interval.samples += global_batch_size
        if skipped:
            # Megatron-LM's rule: a skipped iteration's loss stays out of the average, and it
            # counts as a nan iteration when that loss is not finite.
            interval.skipped += 1
            interval.nan += is_nan_iteration(skipped, losses)
        else:
            for key, value in {**losses, **(auxiliary_losses or {})}.items():
                interval.loss_sums[key] = interval.loss_sums.get(key, 0.0) + value
        if iteration % self.args.tensorboard_log_interval == 0:
            self._write_iteration_scalars(iteration, losses, auxiliary_losses or {}, values)
        ends_interval = last or iteration % self.args.log_interval == 0
        if self.logs_line(iteration, last):
            report_rank_0(self._format_line(iteration, values))
        self._first_line_pending = False
        if ends_interval:
            if self.args.log_timers_to_tensorboard:
                seconds_per_iteration = interval.seconds / interval.iterations
                timers = {"iteration-time": seconds_per_iteration}
                if self.args.log_throughput:
                    timers["throughput"] = self._tflops_per_gpu(interval)
                self.writer.add_scalars(timers, iteration)
            self.interval = _Interval()

    def logs_line(self, iteration: int, last: bool = False) -> bool:
        """Whether recording `iteration` logs a line (`last`: training stops after it)."""
        return last or iteration % self.args.log_interval == 0 or self._first_line_pending

    def report_moe_metrics(self, iteration: int, num_microbatches: int) -> ReducedLosses:
        """The step's MoE auxiliary losses, averaged over microbatches, data-parallel ranks and
        MoE layers, the multi-token prediction depths' included (`MoEMetricsTracker.reduce`,
        which then clears them), on the device until read. Call it on every rank after every
        training step, and pass what it returns, read, to `record_iteration`, which writes
        them as scalars every `--tensorboard-log-interval` (with each layer's under
        `--moe-per-layer-logging`).

        Args:
            iteration: the step's number.
            num_microbatches: the step's microbatches (the recorded values are their sums).

        Returns:
            The losses under Megatron-LM's names ("load_balancing_loss",
            "seq_load_balancing_loss", "z_loss"); none for a dense model.
        """
        args = self.args
        if args.num_experts is None:
            return ReducedLosses(values={})
        pattern = layer_pattern(args.num_layers, args.num_experts, args.moe_layer_freq)
        # Each multi-token prediction depth has a layer like the decoder's last, numbered after
        # the decoder's (Megatron-LM counts them so).
        depths = args.mtp_num_layers or 0
        names = tracked_metrics(args.moe_router_load_balancing_type, args.moe_z_loss_coeff)
        num_layers = args.num_layers + depths
        rows = get_moe_metrics_tracker().reduce(
            names,
            num_layers,
            sum(pattern) + depths * pattern[-1],
            loss_scale=1 / num_microbatches,
            device=self.device,
        )
        if rows is None:
            return ReducedLosses(values={})
        if (
            args.moe_per_layer_logging
            and iteration % args.tensorboard_log_interval == 0
            and self.writer.active
        ):
            layout = [
                (f"moe/{name}_layer_{layer}", 1) for name in names for layer in range(num_layers)
            ]
            self._moe_layer_scalars[iteration] = ReducedLosses(rows[:, 1:].flatten(), layout)
        return ReducedLosses(rows[:, 0].contiguous(), [(name, 1) for name in names])

    def report_mtp_metrics(self, num_microbatches: int) -> ReducedLosses:
        """The step's multi-token prediction losses, one per depth, averaged over microbatches
        and data-parallel ranks (`MTPLossLoggingHelper.reduce`, which then clears them), on
        the device until read. Call it on every rank after every training step, and pass what
        it returns, read, to `record_iteration` (which writes them as scalars every
        `--tensorboard-log-interval`).

        Args:
            num_microbatches: the step's microbatches (the recorded values are their sums).

        Returns:
            The losses under Megatron-LM's names ("mtp_1 loss", "mtp_2 loss", ...); none
            without `--mtp-num-layers`.
        """
        depths = self.args.mtp_num_layers
        if depths is None:
            return ReducedLosses(values={})
        helper = get_mtp_loss_logging_helper()
        values = helper.reduce(depths, num_microbatches, device=self.device)
        return ReducedLosses(values, [(name, 1) for name in helper.names(depths)])

    def _write_iteration_scalars(
        self,
        iteration: int,
        losses: dict[str, float],
        auxiliary_losses: dict[str, float],
        values: _StepValues,
    ) -> None:
        """One iteration's TensorBoard / wandb scalars, under Megatron-LM's tag names."""
        layer_scalars = self._moe_layer_scalars.pop(iteration, None)
        if not self.writer.active:
            return  # most ranks: skip the memory statistics too
        args = self.args
        scalars = {
            "learning-rate": values.learning_rate,
            "batch-size": values.global_batch_size,
            **losses,
        }
        if args.log_loss_scale_to_tensorboard:
            scalars["loss-scale"] = values.loss_scale
        if args.log_world_size_to_tensorboard:
            scalars["world-size"] = args.world_size
        optional = {
            "grad-norm": values.grad_norm,
            "num-zeros": values.num_zeros_in_grad,
            "params-norm": values.params_norm,
        }
        scalars.update((tag, value) for tag, value in optional.items() if value is not None)
        self.writer.add_scalars(scalars, iteration, samples=values.consumed_samples)
        if auxiliary_losses:
            self.writer.add_scalars(auxiliary_losses, iteration)
        if layer_scalars is not None:
            self.writer.add_scalars(layer_scalars.read(), iteration)
        if args.log_memory_to_tensorboard and self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            memory = {
                "mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"],
            }
            self.writer.add_scalars(memory, iteration)

    def _tflops_per_gpu(self, interval: _Interval) -> float:
        """Model TFLOP/s per GPU over the iterations of `interval`."""
        flops = self.flops_per_sample * interval.samples
        return flops / interval.seconds / self.args.world_size / 1e12

    def _format_line(self, iteration: int, values: _StepValues) -> str:
        args, interval = self.args, self.interval
        seconds_per_iteration = interval.seconds / interval.iterations
        tokens = interval.samples * args.seq_length
        fields = [
            f"iteration {iteration:8d}/{args.train_iters:8d}",
            f"consumed samples: {values.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {seconds_per_iteration * 1000:.1f}",
            f"tokens/s/GPU: {tokens / interval.seconds / args.world_size:.1f}",
        ]
        if self.device.type == "cuda" or args.log_throughput:
            tflops = self._tflops_per_gpu(interval)
            fields.append(f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}")
        fields += [
            f"learning rate: {values.learning_rate:.6E}",
            f"global batch size: {values.global_batch_size:5d}",
        ]
        if self.fp8 is not None:
            fields.append(f"fp8: {self.fp8.format} {self.fp8.kind}")
        fields += [
            f"{k}: {v / (interval.iterations - interval.skipped):.6E}"
            for k, v in interval.loss_sums.items()
        ]
        # Megatron-LM's fields: the loss scale always, the others when the step has them.
        fields.append(f"loss scale: {values.loss_scale:.1f}")
        if values.grad_norm is not None:
            fields.append(f"grad norm: {values.grad_norm:.3f}")
        if values.num_zeros_in_grad is not None:
            fields.append(f"num zeros: {values.num_zeros_in_grad:.1f}")
        if values.params_norm is not None:
            fields.append(f"params norm: {values.params_norm:.3f}")
        fields += [
            f"number of skipped iterations: {interval.skipped:3d}",
            f"number of nan iterations: {interval.nan:3d}",
        ]
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            fields.append(f"peak memory (GiB): {peak:.2f}")
        remaining = args.train_iters - iteration
        eta = datetime.timedelta(seconds=round(remaining * seconds_per_iteration))
        fields.append(f"{100 * iteration / args.train_iters:.1f}% done, ETA {eta}")
        return " | ".join(fields)

    def log_evaluation(
        self,
        split: str,
        when: str,
        iteration: int,
        losses: dict[str, float],
        write_to_tensorboard: bool = True,
    ) -> None:
        """Logs an evaluation's losses and perplexities in Megatron-LM's box.

        Args:
            split: "validation" or "test".
            when: e.g. "iteration 20" or "the end of training".
            iteration: the training iteration the scalars are written at.
            losses: the evaluation's averaged losses.
            write_to_tensorboard: also write the scalars (TensorBoard and wandb); False logs the
                box only.
        """
        # Megatron-LM caps the exponent at 20 too: exp overflows for a diverged loss.
        perplexities = {key: math.exp(min(20.0, value)) for key, value in losses.items()}
        fields = [f" {split} loss at {when}"]
        for key, value in losses.items():
            fields.append(f"{key} value: {value:.6E} | {key} PPL: {perplexities[key]:.6E}")
        line = " | ".join(fields)
        rule = "-" * (len(line) + 1)
        report_rank_0(f"{rule}\n{line}\n{rule}")
        if not write_to_tensorboard:
            return
        samples = self.train_state.consumed_train_samples
        self.writer.add_scalars(
            {f"{key} {split}": v for key, v in losses.items()}, iteration, samples=samples
        )
        if self.args.log_validation_ppl_to_tensorboard:
            self.writer.add_scalars(
                {f"{key} {split} ppl": v for key, v in perplexities.items()},
                iteration,
                samples=samples,
            )

    def close(self) -> None:
        """Closes the TensorBoard / wandb runs."""
        self.writer.close()
