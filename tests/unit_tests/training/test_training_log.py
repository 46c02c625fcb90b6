"""`TrainingLog`: the interval's averages in the log line, skipped and nan iterations, the
optional fields, and the scalars handed to Weights & Biases."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from megatron.core.fp8 import expert_gemm_kernels
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.multi_token_prediction import get_mtp_loss_logging_helper
from megatron.training.arguments import (
    core_transformer_config_from_args,
    parse_args,
    validate_args,
)
from megatron.training.flops import num_floating_point_operations
from megatron.training.train_state import TrainState
from megatron.training.training_log import TrainingLog, fp8_startup_line
from tests.unit_tests.training.log_capture import capture_training_log

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 1e-2 --mock-data "
    "--vocab-size 64 --distributed-backend gloo --log-interval 2"
).split()


class _FakeWandbRun:
    def __init__(self, **init_kwargs):
        self.init_kwargs = init_kwargs
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, scalars: dict, step: int) -> None:
        self.logged.append((dict(scalars), step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def messages():
    """What the training loop logs, at INFO and above."""
    with capture_training_log() as captured:
        yield captured


def _training_log(*flags: str) -> TrainingLog:
    args = validate_args(parse_args(args=[*FLAGS, *flags]), world_size=2)
    config = core_transformer_config_from_args(args)
    return TrainingLog(args, config, torch.device("cpu"), TrainState())


def test_line_averages_the_interval_and_counts_skipped_and_nan_iterations(messages):
    log = _training_log()
    log.record_iteration(1, {"lm loss": 4.0}, False, 1.5, 1e-2, 0.1)
    log.train_state.consumed_train_samples = 16  # the loop's count: two global batches of 8
    log.record_iteration(2, {"lm loss": 2.0}, False, 0.5, 9e-3, 0.3)
    log.record_iteration(3, {"lm loss": float("inf")}, True, float("nan"), 8e-3, 0.2)
    log.record_iteration(4, {"lm loss": 1.0}, False, 0.25, 8e-3, 0.2)
    start, first, second = messages
    # The run's first iteration logs its own line (Megatron-LM's), without resetting the
    # interval, whose line still averages iterations 1 and 2.
    assert start.startswith("iteration        1/       4 |")
    assert "(ms): 100.0 |" in start and "| lm loss: 4.000000E+00 |" in start
    assert first == (
        "iteration        2/       4 | consumed samples:           16 | elapsed time per "
        "iteration (ms): 200.0 | tokens/s/GPU: 320.0 | learning rate: 9.000000E-03 | global "
        "batch size:     8 | lm loss: 3.000000E+00 | loss scale: 1.0 | grad norm: 0.500 | "
        "number of skipped "
        "iterations:   0 | number of nan iterations:   0 | 50.0% done, ETA 0:00:00"
    )
    assert "| lm loss: 1.000000E+00 |" in second  # the skipped iteration's inf left out
    assert "number of skipped iterations:   1 | number of nan iterations:   1" in second
    assert "TFLOP/s/GPU" not in second and "peak memory" not in second  # GPU only


def test_zero_count_and_params_norm_follow_the_grad_norm(messages):
    log = _training_log("--log-interval", "1")
    log.record_iteration(1, {"lm loss": 4.0}, False, 1.0, 1e-2, 0.5)
    log.record_iteration(
        2, {"lm loss": 4.0}, False, 1.0, 1e-2, 0.5, num_zeros_in_grad=12, params_norm=3.25
    )
    assert "num zeros" not in messages[0] and "params norm" not in messages[0]
    assert "| grad norm: 1.000 | num zeros: 12.0 | params norm: 3.250 |" in messages[1]


def test_log_throughput_adds_tflops_on_cpu(messages):
    log = _training_log("--log-throughput")
    log.record_iteration(1, {"lm loss": 4.0}, False, 1.0, 1e-2, 0.5)
    log.record_iteration(2, {"lm loss": 4.0}, False, 1.0, 1e-2, 0.5)
    config = core_transformer_config_from_args(log.args)
    flops = num_floating_point_operations(config, log.args.padded_vocab_size, 16, 8)
    tflops = flops / 0.5 / 2 / 1e12  # one global batch of 8 in 0.5 s, over 2 ranks
    assert f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}" in messages[0]


def test_a_batch_size_ramp_is_reported_at_each_iterations_batch(messages):
    """--rampup-batch-size: the line's tokens/s and the TFLOP/s count the interval's iterations
    at their own global batch sizes (4 then 8 samples of 16 tokens in 0.5 s each, over 2
    ranks), its global batch size is the last iteration's, and TensorBoard's each
    iteration's."""
    log = _training_log(
        *"--rampup-batch-size 4 4 16 --log-throughput --log-timers-to-tensorboard".split(),
        *"--tensorboard-log-interval 1".split(),
    )
    assert log.args.global_batch_size == 8  # the ramp's final size
    tensorboard = log.writer.tensorboard = _FakeTensorBoard()
    log.record_iteration(1, {"lm loss": 4.0}, False, 1.0, 1e-2, 0.5, global_batch_size=4)
    log.record_iteration(2, {"lm loss": 4.0}, False, 1.0, 1e-2, 0.5, global_batch_size=8)
    _, line = messages
    assert f"tokens/s/GPU: {(4 + 8) * 16 / 1.0 / 2:.1f} |" in line
    assert "| global batch size:     8 |" in line
    scalars = {(tag, step): value for tag, value, step in tensorboard.scalars}
    assert (scalars["batch-size", 1], scalars["batch-size", 2]) == (4, 8)
    config = core_transformer_config_from_args(log.args)
    flops = num_floating_point_operations(config, log.args.padded_vocab_size, 16, 4 + 8)
    assert scalars["throughput", 2] == pytest.approx(flops / 1.0 / 2 / 1e12)


def test_evaluation_box_and_wandb_scalars(messages, monkeypatch):
    runs = []

    def init(**kwargs) -> _FakeWandbRun:
        runs.append(_FakeWandbRun(**kwargs))
        return runs[-1]

    fake_wandb = types.ModuleType("wandb")
    fake_wandb.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    log = _training_log("--wandb-project", "proj", "--wandb-exp-name", "run")
    log.record_iteration(1, {"lm loss": 4.0}, False, 1.0, 1e-2, 0.5)
    log.log_evaluation("validation", "iteration 1", 1, {"lm loss": 2.0})
    log.close()
    assert (
        "validation loss at iteration 1 | lm loss value: 2.000000E+00 | lm loss PPL: "
        in (messages[1])
    )
    (run,) = runs
    assert run.init_kwargs["project"] == "proj" and run.init_kwargs["name"] == "run"
    assert run.logged == [
        # Megatron-LM's tags: loss scale 1.0 without loss scaling.
        (
            {
                "learning-rate": 1e-2,
                "batch-size": 8,
                "lm loss": 4.0,
                "loss-scale": 1.0,
                "grad-norm": 1.0,
            },
            1,
        ),
        ({"lm loss validation": 2.0}, 1),
    ]
    assert run.finished


def test_last_iteration_logs_the_partial_interval(messages):
    """--train-iters 5 --log-interval 3: lines at 3 and 5, the second over iterations 4-5."""
    log = _training_log("--train-iters", "5", "--log-interval", "3")
    for iteration, loss, seconds in [(1, 9.0, 0.1), (2, 6.0, 0.1), (3, 3.0, 0.1)]:
        log.record_iteration(iteration, {"lm loss": loss}, False, 1.0, 1e-2, seconds)
    log.record_iteration(4, {"lm loss": 2.0}, False, 1.0, 1e-2, 0.3)
    log.record_iteration(5, {"lm loss": 1.0}, False, 1.0, 1e-2, 0.5, last=True)
    _, first, second = messages
    assert first.startswith("iteration        3/       5 |")
    assert "elapsed time per iteration (ms): 100.0 |" in first and "lm loss: 6.0000" in first
    assert second.startswith("iteration        5/       5 |")
    assert "elapsed time per iteration (ms): 400.0 |" in second
    assert "| lm loss: 1.500000E+00 |" in second and "100.0% done" in second


class _FakeTensorBoard:
    def __init__(self):
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        pass


def test_moe_losses_join_the_line_and_are_written_every_tensorboard_interval(messages):
    """Two microbatches recorded per step on both MoE layers: the report is their mean; the
    tracker is cleared every step, and its scalars (per layer too) are written at step 2 only
    (--tensorboard-log-interval 2), each once."""
    destroy_moe_metrics_tracker()
    log = _training_log(
        *"--num-experts 4 --moe-z-loss-coeff 1e-3 --moe-per-layer-logging".split(),
        *"--tensorboard-log-interval 2".split(),
    )
    tensorboard = log.writer.tensorboard = _FakeTensorBoard()
    tracker = get_moe_metrics_tracker()
    per_step = {1: 2.0, 2: 3.0}  # each layer's value in every microbatch of the step
    for iteration, value in per_step.items():
        for layer in (1, 2):
            for _ in range(2):
                tracker.record("load_balancing_loss", torch.tensor(value), layer, 2)
        moe_losses = log.report_moe_metrics(iteration, num_microbatches=2).read()
        assert moe_losses == pytest.approx({"load_balancing_loss": value, "z_loss": 0.0})
        log.record_iteration(
            iteration, {"lm loss": 4.0}, False, 1.0, 1e-2, 0.1, auxiliary_losses=moe_losses
        )
    _, line = messages
    mean = sum(per_step.values()) / 2
    assert f"| lm loss: 4.000000E+00 | load_balancing_loss: {mean:.6E} | z_loss: 0.000" in line
    moe_names = ("load_balancing_loss", "z_loss", "moe/")
    moe_scalars = [s for s in tensorboard.scalars if s[0].startswith(moe_names)]
    expected = [("load_balancing_loss", 3.0, 2), ("z_loss", 0.0, 2)]
    # Each layer's value: its two microbatches' sum x 1/2, the same on both layers here.
    expected += [(f"moe/{name}_layer_{i}", v, 2) for name, v, _ in expected[:2] for i in (0, 1)]
    assert sorted(moe_scalars) == sorted(expected)
    destroy_moe_metrics_tracker()


def test_moe_layers_of_mtp_depths_count_in_the_mean_over_moe_layers():
    """With one depth after two MoE layers, its MoE layer records as layer 3 and the mean is
    over the three (Megatron-LM's count)."""
    destroy_moe_metrics_tracker()
    log = _training_log("--num-experts", "4", "--mtp-num-layers", "1")
    tracker = get_moe_metrics_tracker()
    for layer, value in ((1, 1.0), (2, 2.0), (3, 6.0)):
        tracker.record("load_balancing_loss", torch.tensor(value), layer, 3)
    assert log.report_moe_metrics(1, num_microbatches=1).read()["load_balancing_loss"] == 3.0
    destroy_moe_metrics_tracker()


def test_mtp_losses_join_the_line_and_are_written_every_tensorboard_interval(messages):
    """Two depths, two microbatches recorded per step: each depth's report is their mean,
    named as Megatron-LM's ("mtp_1 loss"); written as scalars at step 2 only."""
    helper = get_mtp_loss_logging_helper()
    helper.clear()
    log = _training_log("--mtp-num-layers", "2", "--tensorboard-log-interval", "2")
    tensorboard = log.writer.tensorboard = _FakeTensorBoard()
    per_step = {1: (2.0, 6.0), 2: (3.0, 5.0)}  # each depth's value in every microbatch
    for iteration, values in per_step.items():
        for depth, value in enumerate(values, start=1):
            for _ in range(2):
                helper.record(torch.tensor(value), depth, 2)
        mtp_losses = log.report_mtp_metrics(num_microbatches=2).read()
        assert mtp_losses == pytest.approx({"mtp_1 loss": values[0], "mtp_2 loss": values[1]})
        log.record_iteration(
            iteration, {"lm loss": 4.0}, False, 1.0, 1e-2, 0.1, auxiliary_losses=mtp_losses
        )
    _, line = messages
    assert "| lm loss: 4.000000E+00 | mtp_1 loss: 2.500000E+00 | mtp_2 loss: 5.500000E+00 |" in (
        line
    )
    mtp_scalars = [s for s in tensorboard.scalars if s[0].startswith("mtp_")]
    assert mtp_scalars == [("mtp_1 loss", 3.0, 2), ("mtp_2 loss", 5.0, 2)]
    assert _training_log().report_mtp_metrics(num_microbatches=1).read() == {}


def test_an_fp8_run_names_its_recipe_and_counts_bf16_flops(messages):
    """The line says the format and recipe; TFLOP/s count the same FLOPs as the bf16 run's."""
    fp8 = _training_log("--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "16")
    bf16 = _training_log("--bf16")
    assert fp8.flops_per_sample == bf16.flops_per_sample
    fp8.record_iteration(1, {"lm loss": 4.0}, False, 1.5, 1e-2, 0.1)
    bf16.record_iteration(1, {"lm loss": 4.0}, False, 1.5, 1e-2, 0.1)
    fp8_line, bf16_line = messages
    assert "| global batch size:     8 | fp8: hybrid delayed | lm loss:" in fp8_line
    assert "fp8" not in bf16_line
    cpu = torch.device("cpu")
    assert fp8_startup_line(core_transformer_config_from_args(fp8.args), cpu) == (
        "> FP8 (hybrid format, delayed scaling (amax history 16, most_recent, margin 0)) in the "
        "linear layers of 2 of 2 transformer layers; the embedding, the output layer, "
        "attention and norms in bfloat16"
    )
    assert fp8_startup_line(core_transformer_config_from_args(bf16.args), cpu) is None
    mtp = _training_log("--bf16", "--fp8-format", "e4m3", "--mtp-num-layers", "2")
    assert "linear layers of 2 of 2 transformer layers and of the 2 multi-token prediction " in (
        fp8_startup_line(core_transformer_config_from_args(mtp.args), cpu)
    )


def test_an_fp8_moe_run_says_where_the_grouped_kernel_is_not_used():
    """On CPU the experts of --moe-grouped-gemm run one FP8 GEMM per expert: the start-up line
    says so once."""
    moe = ("--num-experts", "4", "--moe-ffn-hidden-size", "32", "--bf16", "--fp8-format", "e4m3")
    cpu = torch.device("cpu")
    for grouped, ending in (
        ((), "the routed experts' FP8 GEMMs run one torch._scaled_mm per expert"),
        (
            ("--moe-grouped-gemm",),
            "the routed experts' FP8 GEMMs run one torch._scaled_mm per expert "
            "(no grouped FP8 GEMM for bfloat16 inputs on this cpu device)",
        ),
    ):
        log = _training_log(*moe, *grouped)
        line = fp8_startup_line(core_transformer_config_from_args(log.args), cpu)
        assert line.endswith(f"attention and norms in bfloat16; {ending}"), line


def test_a_graphed_fp8_moe_run_says_its_experts_run_grouped_at_any_size(monkeypatch):
    """Where the Triton grouped kernels run, a model trained in CUDA graphs runs them for experts
    of any size, and its start-up line says so instead of naming the large experts' GEMMs."""
    monkeypatch.setattr(expert_gemm_kernels, "kernels_available", lambda device: True)
    flags = ("--num-experts", "4", "--moe-ffn-hidden-size", "32", "--bf16", "--fp8-format")
    log = _training_log(*flags, "hybrid", "--moe-grouped-gemm")
    config = core_transformer_config_from_args(log.args)
    cuda = torch.device("cuda")
    gemm = "a Triton grouped GEMM"
    kernels = f"forward {gemm}, input gradient {gemm}, weight gradient {gemm}"
    eager = fp8_startup_line(config, cuda)
    assert eager.endswith(
        f"{kernels}; experts whose GEMMs average 40 GFLOP or more: one torch._scaled_mm per expert"
    ), eager
    graphed = fp8_startup_line(dataclasses.replace(config, cuda_graph_impl="full_iteration"), cuda)
    assert graphed.endswith(f"{kernels}, for experts of any size (CUDA graphs)"), graphed
