"""`pretrain_gpt.py` end to end, in-process on spawned ranks: Megatron-FSDP matches the DDP
engine for every sharding strategy, the number of data-parallel ranks does not change training,
the loss falls on mock data, the log line and evaluations are reported, and a non-finite loss or
gradient raises (the default) or skips one step without stopping training."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import math
import os
import statistics
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megatron.core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES
from megatron.core.distributed.fsdp import local_main_weights
from megatron.core.enums import ModelType
from megatron.core.optimizer import MegatronOptimizer
from megatron.training.training import TrainingHistory, pretrain
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.log_capture import capture_training_log

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --train-iters 4 --lr 1e-2 --mock-data --vocab-size 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --eval-iters 0 --log-interval 2 "
    "--clip-grad 0.3"
).split()
"""A tiny fp32 run; `--global-batch-size` sets 2 microbatches per rank in each test."""

ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def _pretrain(flags: list[str], forward_step_func=pretrain_gpt.forward_step) -> dict:
    """Runs pretrain_gpt on this rank; its history and (rank 0) log messages."""
    with capture_training_log() as messages:
        history = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            forward_step_func,
            argv=[*flags, "--distributed-backend", dist.get_backend()],
        )
    return dict(history=history, log=messages)


def steps_read_at_once() -> contextlib.AbstractContextManager:
    """Within it, the training loop reads each optimizer step's outcome as it takes the step
    (as for fp16's loss scaler and torch's unfused optimizers), not at the next iteration."""
    return mock.patch.object(
        MegatronOptimizer, "steps_without_host_sync", new=mock.PropertyMock(return_value=False)
    )


def _log_lines(log: list[str]) -> list[str]:
    """The periodic Megatron log lines among the log messages."""
    return [m for m in log if m.startswith("iteration ") and " | consumed samples: " in m]


def _losses_and_norms(flags: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-iteration losses and grad norms, as fp32 tensors (compared at fp32 tolerances)."""
    history: TrainingHistory = _pretrain(flags)["history"]
    return torch.tensor(history.loss_curve()), torch.tensor(history.grad_norms)


def _assert_fsdp_matches_ddp(
    world_size: int, fsdp_flags: list[str], model_flags: tuple[str, ...] = ()
) -> None:
    base = [*TINY, *model_flags, "--global-batch-size", str(4 * world_size)]  # 2 microbatches
    fsdp = run_distributed(_losses_and_norms, world_size, [*base, *fsdp_flags])
    ddp = run_distributed(_losses_and_norms, world_size, base)
    losses, grad_norms = ddp[0]
    assert losses[-1] < losses[0]
    assert (grad_norms > 0.3).all(), f"clipping never acted: {grad_norms}"
    for rank_result in [*fsdp, *ddp]:
        torch.testing.assert_close(rank_result, ddp[0])


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_fsdp_losses_match_ddp(strategy):
    fsdp_flags = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    _assert_fsdp_matches_ddp(2, fsdp_flags)


def test_fsdp_with_both_layers_in_one_unit_matches_ddp():
    # Each of TINY's layers holds 12,704 elements.
    _assert_fsdp_matches_ddp(2, [*ZERO3, "--suggested-communication-unit-size", "30000"])


def test_fsdp_on_meta_device_matches_ddp_on_4_ranks():
    _assert_fsdp_matches_ddp(4, [*ZERO3, "--init-model-with-meta-device"])


FP8 = "--bf16 --fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max".split()


def test_fp8_param_gather_from_the_meta_device_trains_as_without_it():
    """`--fp8-param-gather` with `--init-model-with-meta-device`: the FP8 weights are cast from
    the materialised shards at the first forward; losses and gradient norms are those of an
    eager FP8 run without it, bit for bit."""
    base = [*TINY, *ZERO3, *FP8, "--global-batch-size", "8"]
    gathered = run_distributed(
        _losses_and_norms, 2, [*base, "--fp8-param-gather", "--init-model-with-meta-device"]
    )
    plain = run_distributed(_losses_and_norms, 2, base)
    assert plain[0][0][-1] < plain[0][0][0]
    for rank_result in gathered:
        assert all(torch.equal(a, b) for a, b in zip(rank_result, plain[0]))


MOE = tuple(
    (
        "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 "
        "--moe-token-dispatcher-type alltoall --swiglu --disable-bias-linear "
        "--moe-shared-expert-intermediate-size 16 --moe-shared-expert-gate "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-aux-loss-coeff 1e-2"
    ).split()
)
"""An MoE model with every part that holds parameters or buffers: router, expert bias,
experts, shared experts and their gate."""


DEEPSEEK_V3_ROUTING = tuple(
    (
        "--moe-router-num-groups 2 --moe-router-group-topk 1 --moe-router-topk-scaling-factor 2.5 "
        "--moe-grouped-gemm"
    ).split()
)
"""The rest of DeepSeek-V3's MoE recipe: group-limited routing, scaled weights, grouped GEMMs."""


@pytest.mark.parametrize(
    "parallel",
    [
        (),
        (
            "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 1 "
            "--expert-tensor-parallel-size 2"
        ).split(),
    ],
    ids=["ep2", "tp2_etp2"],
)
def test_moe_fsdp_on_meta_device_matches_ddp(parallel):
    """Every MoE part built on the meta device and materialised by Megatron-FSDP (ZeRO-3) starts
    from the weights the DDP engine's eager build draws with the same seed, and trains as it
    does: with the experts split over EP 2, or each expert split over ETP 2 beside TP 2 (the
    shared experts split over tp, the router replicated)."""
    flags = (*MOE, *DEEPSEEK_V3_ROUTING, *parallel)
    _assert_fsdp_matches_ddp(2, [*ZERO3, "--init-model-with-meta-device"], flags)


@pytest.mark.parametrize("engine_flags", [ZERO3, []], ids=["fsdp_zero3", "ddp"])
def test_data_parallel_size_does_not_change_training(engine_flags, monkeypatch):
    """A global batch of 8: 4 microbatches of 2 on one rank, or 2 on each of 2 ranks (both on
    gloo CPU ranks: where one GPU would take the single rank, the runs would differ by device)."""
    monkeypatch.setenv("MEGATRON_TEST_BACKEND", "gloo")
    flags = [*TINY, "--global-batch-size", "8", *engine_flags]
    (one_rank,) = run_distributed(_losses_and_norms, 1, flags)
    two_ranks = run_distributed(_losses_and_norms, 2, flags)
    assert one_rank[0][-1] < one_rank[0][0]
    for rank_result in two_ranks:
        torch.testing.assert_close(rank_result, one_rank)


MOCK_RUN = [
    *(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 4 --global-batch-size 16 --train-iters 50 --lr 3e-3 "
        "--lr-warmup-iters 5 --lr-decay-style cosine --min-lr 3e-4 --mock-data --vocab-size 128 "
        "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --position-embedding-type rope "
        "--log-interval 10 --eval-interval 25 --eval-iters 2"
    ).split(),
    *ZERO3,
]


@pytest.fixture(scope="module")
def mock_run() -> dict:
    """50 iterations of a tiny GPT on mock data, 2 ranks, ZeRO-3, 2 microbatches."""
    results = run_distributed(_pretrain, 2, MOCK_RUN)
    curves = [result["history"].loss_curve() for result in results]
    assert curves[0] == curves[1], "the reported loss differs between ranks"
    assert results[1]["log"] == [], "only rank 0 logs"
    return results[0]


def test_loss_falls_on_mock_data(mock_run):
    losses = mock_run["history"].loss_curve()
    assert len(losses) == 50
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    assert last < 0.5 * first, (first, last)


def test_log_line_has_megatron_fields(mock_run):
    lines = _log_lines(mock_run["log"])
    # The first iteration, then every --log-interval 10 of 50 iterations.
    assert [line.split(" | ")[0] for line in lines] == [
        f"iteration {iteration:8d}/      50" for iteration in (1, 10, 20, 30, 40, 50)
    ]
    fields = lines[2].split(" | ")
    assert fields[0] == "iteration       20/      50"
    assert fields[1] == "consumed samples:          320"
    expected_prefixes = [
        "elapsed time per iteration (ms): ",
        "tokens/s/GPU: ",
        "learning rate: ",
        "global batch size:    16",
        "lm loss: ",
        "grad norm: ",
        "number of skipped iterations:   0",
        "number of nan iterations:   0",
        "40.0% done, ETA ",
    ]
    for prefix in expected_prefixes:
        assert any(f.startswith(prefix) for f in fields), (prefix, lines[2])
    # Averaged over iterations 11..20 (the interval), as the history has them.
    reported = float(next(f for f in fields if f.startswith("lm loss: ")).split(": ")[1])
    interval = mock_run["history"].loss_curve()[10:20]
    assert reported == pytest.approx(statistics.mean(interval), rel=1e-5)
    log = "\n".join(mock_run["log"])
    assert "> number of parameters: " in log and "------------------------ arguments" in log


def test_evaluation_runs_at_eval_interval(mock_run):
    history = mock_run["history"]
    assert sorted(history.validation_losses) == [25, 50]
    at_25, at_50 = (history.validation_losses[i]["lm loss"] for i in (25, 50))
    assert at_50 < at_25 < history.loss_curve()[0]
    assert history.final_validation_losses["lm loss"] < at_25
    assert history.test_losses["lm loss"] < at_25
    log = "\n".join(mock_run["log"])
    for heading in (
        "validation loss at iteration 25 | lm loss value: ",
        "validation loss at iteration 50 | lm loss value: ",
        "validation loss at the end of training | lm loss value: ",
        "test loss at the end of training | lm loss value: ",
    ):
        assert heading in log


INF_ITERATION = 3


class _InfGradient(torch.autograd.Function):
    """The identity, whose backward returns inf: a finite loss with an inf gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf"))


def _pretrain_with_non_finite(flags: list[str], where: str, read_at_once: bool = False) -> dict:
    """Trains with the loss (`where` = "loss") or only the gradient ("gradient") made inf in
    iteration INF_ITERATION; snapshots this rank's shards of the main weights at the start of
    every iteration. `read_at_once`: each optimizer step is read as it is taken (as fp16's and
    torch's unfused optimizers' steps are), not at the next iteration."""
    calls = itertools.count()
    snapshots = []

    def forward_step(data_iterator, model):
        call = next(calls)
        iteration, microbatch = divmod(call, 2)  # 2 microbatches; iterations from 0 here
        if microbatch == 0:
            snapshots.append([w.clone() for w in local_main_weights(model).values()])
        output_tensor, loss_func = pretrain_gpt.forward_step(data_iterator, model)
        if iteration + 1 == INF_ITERATION:
            if where == "loss":
                output_tensor = output_tensor * float("inf")
            else:
                output_tensor = _InfGradient.apply(output_tensor)
        return output_tensor, loss_func

    with steps_read_at_once() if read_at_once else contextlib.nullcontext():
        try:
            result = _pretrain(flags, forward_step)
        except RuntimeError as error:
            return dict(error=str(error), snapshots=snapshots)
    result["snapshots"] = snapshots
    return result


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_non_finite_loss_or_gradient_skips_the_step_and_training_continues(where):
    flags = [*TINY, "--global-batch-size", "8", "--train-iters", "5", "--log-interval", "5"]
    flags += ["--no-check-for-nan-in-loss-and-grad", *ZERO3]
    results = run_distributed(_pretrain_with_non_finite, 2, flags, where)
    k = INF_ITERATION
    for result in results:
        history, weights = result["history"], result["snapshots"]
        assert history.skipped_iterations == [k]
        assert len(history.losses) == 5
        assert math.isfinite(history.loss_curve()[k - 1]) == (where == "gradient")
        # Weights at the start of iteration k + 1 are those at the start of iteration k.
        for before, after in zip(weights[k - 1], weights[k]):
            torch.testing.assert_close(after, before, rtol=0, atol=0)
        # Training goes on: later steps change the weights, and the schedule resumes.
        assert any(not torch.equal(a, b) for a, b in zip(weights[k], weights[k + 1]))
        # Megatron-LM's convention: each iteration's rate after its schedule step (linear
        # decay over 5 iterations: 8e-3 after the first), unchanged by the skipped one.
        lrs = history.learning_rates
        assert lrs[0] == pytest.approx(1e-2 * (1 - 1 / 5))
        assert lrs[k - 1] == lrs[k - 2] and lrs[k] < lrs[k - 1]
    log = results[0]["log"]
    assert any(m.startswith(f"iteration {k}: skipped the optimizer step") for m in log)
    _, line = _log_lines(log)  # the first iteration's, then the interval's
    assert "number of skipped iterations:   1" in line
    assert f"number of nan iterations:   {int(where == 'loss')}" in line


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_non_finite_loss_or_gradient_raises_with_the_check_on(where):
    flags = [*TINY, "--global-batch-size", "8", "--train-iters", str(INF_ITERATION), *ZERO3]
    results = run_distributed(_pretrain_with_non_finite, 2, flags, where)
    for result in results:
        assert "--check-for-nan-in-loss-and-grad" in result["error"]
        assert "--no-check-for-nan-in-loss-and-grad" in result["error"]
        if where == "gradient":
            assert "The global gradient norm is " in result["error"]


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_steps_read_at_the_next_iteration_train_as_steps_read_at_once(where):
    """The loop reads an optimizer step's outcome (skipped or not, the gradient norm) at the
    next iteration, stepping the schedule then: the same losses, norms, learning rates, skipped
    iteration and weights, bitwise, as steps read as they are taken; with the check on, the
    skipped step raises once the next iteration's forward and backward are queued."""
    flags = [*TINY, "--global-batch-size", "8", "--train-iters", "5", "--log-interval", "5"]
    flags += [*ZERO3, "--lr-warmup-iters", "2"]
    unchecked = [*flags, "--no-check-for-nan-in-loss-and-grad"]
    later = run_distributed(_pretrain_with_non_finite, 2, unchecked, where)
    at_once = run_distributed(_pretrain_with_non_finite, 2, unchecked, where, True)
    for result, expected in zip(later, at_once):
        history, want = result["history"], expected["history"]
        assert history.skipped_iterations == want.skipped_iterations == [INF_ITERATION]
        assert history.learning_rates == want.learning_rates
        for key in ("losses", "grad_norms"):
            actual = torch.tensor([_first(v) for v in getattr(history, key)])
            wanted = torch.tensor([_first(v) for v in getattr(want, key)])
            torch.testing.assert_close(actual, wanted, rtol=0, atol=0, equal_nan=True)
        for weights, expected_weights in zip(result["snapshots"], expected["snapshots"]):
            for actual, wanted in zip(weights, expected_weights):
                torch.testing.assert_close(actual, wanted, rtol=0, atol=0)
    # With the check on: the iteration after the skipped one started before the error.
    later = run_distributed(_pretrain_with_non_finite, 2, flags, where)
    at_once = run_distributed(_pretrain_with_non_finite, 2, flags, where, True)
    for result, expected in zip(later, at_once):
        assert "--check-for-nan-in-loss-and-grad" in result["error"] == expected["error"]
        assert len(result["snapshots"]) == len(expected["snapshots"]) + 1 == INF_ITERATION + 1


def _first(value: float | dict[str, float]) -> float:
    return value["lm loss"] if isinstance(value, dict) else value


def _pretrain_reporting_inf(flags: list[str]) -> dict:
    """Trains with iteration INF_ITERATION's reported loss inf and its gradients finite (the
    step is taken); the error and the iterations that started."""
    calls = itertools.count()
    started = []

    def reporting_inf(loss_mask, output_tensor):
        loss, num_tokens, report = pretrain_gpt.loss_func(loss_mask, output_tensor)
        return loss, num_tokens, {"lm loss": report["lm loss"] * float("inf")}

    def forward_step(data_iterator, model):
        iteration = next(calls) // 2 + 1  # 2 microbatches
        if not started or started[-1] != iteration:
            started.append(iteration)
        output_tensor, loss_func = pretrain_gpt.forward_step(data_iterator, model)
        if iteration == INF_ITERATION:
            loss_func = functools.partial(reporting_inf, loss_func.args[0])
        return output_tensor, loss_func

    try:
        _pretrain(flags, forward_step)
    except RuntimeError as error:
        return dict(error=str(error), started=started)
    return dict(error=None, started=started)


@pytest.mark.parametrize("variant", ["plain", "save", "moe-tensorboard", "pipeline"])
def test_a_non_finite_loss_of_a_step_taken_raises_before_a_save(variant, tmp_path_factory):
    """The loop reads a step's losses at the next iteration unless it needs them at once: the
    check raises there on every rank (also where rank 0 alone writes TensorBoard scalars, an
    MoE model's per layer too, and where pipeline stages read the losses at once), or before a
    save of the iteration."""
    k = INF_ITERATION
    flags = [*TINY, "--global-batch-size", "8", "--train-iters", "5", "--log-interval", "5"]
    flags += ZERO3
    directory = str(tmp_path_factory.mktemp("save"))
    if variant == "save":
        flags += ["--save", directory, "--save-interval", str(k)]
    if variant in ("moe-tensorboard", "pipeline"):
        flags += ["--num-experts", "2", "--moe-per-layer-logging"]
        flags += ["--tensorboard-dir", str(tmp_path_factory.mktemp("tensorboard"))]
    if variant == "pipeline":  # its losses are read at once; the MoE losses are not
        flags = [flag for flag in flags if flag not in ZERO3]
        # One data-parallel rank: 2 microbatches of 2 make a global batch of 4.
        flags += ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    results = run_distributed(_pretrain_reporting_inf, 2, flags)
    for result in results:
        assert "The loss is not finite" in result["error"]
        assert result["started"] == list(range(1, k + 1 + (variant != "save")))
    assert os.listdir(directory) == []


def _iterations_and_log_lines(flags: list[str]) -> tuple[int, list[str]]:
    result = _pretrain(flags)
    lines = [line.split(" | ")[0] for line in _log_lines(result["log"])]
    return len(result["history"].losses), lines


def test_exit_interval_stops_training():
    flags = [*TINY, "--global-batch-size", "8", "--train-iters", "10", "--exit-interval", "3"]
    results = run_distributed(_iterations_and_log_lines, 2, flags)
    # The first iteration; --log-interval 2: a line at 2, and one for the partial interval at
    # the exit.
    lines = [f"iteration {iteration:8d}/      10" for iteration in (1, 2, 3)]
    assert results == [(3, lines), (3, [])]


def test_last_partial_log_interval_is_logged():
    flags = [*TINY, "--global-batch-size", "8", "--train-iters", "5", "--log-interval", "3"]
    (iterations, lines), _ = run_distributed(_iterations_and_log_lines, 2, flags)
    assert iterations == 5
    assert lines == [f"iteration {iteration:8d}/       5" for iteration in (1, 3, 5)]


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard package"
)
def test_tensorboard_scalars(tmp_path):
    flags = [*TINY, "--global-batch-size", "8", "--tensorboard-dir", str(tmp_path)]
    # iteration-time is a timer: written with --log-timers-to-tensorboard, as upstream.
    run_distributed(_pretrain, 2, [*flags, *ZERO3, "--log-timers-to-tensorboard"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "iteration-time"} <= tags
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4]
