"""The schedule and batch flags: sample-based training, warmup fraction, batch-size schedules,
per-token loss, and the duration / signal exits (decoupled rates: `test_decoupled_lr.py`).

Sample-based schedules are checked against their iteration-based equivalents, batch schedules
against hand-written references of Megatron-LM's formulas, per-token loss
against a plain single-process computation, and the exits through `pretrain` on 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import pretrain_gpt
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import BatchSizeSchedule, rampup_schedule
from megatron.training import dist_signal_handler
from megatron.training.arguments import get_megatron_optimizer_config, parse_args, validate_args
from megatron.training.dist_signal_handler import ExitConditions
from megatron.training.evaluation import evaluate
from megatron.training.training import get_optimizer_param_scheduler, pretrain
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    build_tiny_gpt,
    make_token_batches,
    tiny_gpt_config,
    wrap_for_engine,
)
from tests.unit_tests.training.log_capture import capture_training_log
from tests.unit_tests.training.schedule_checks import (
    BASE,
    TINY,
    ParamGroups,
    masked_sgd_train_step,
    validated,
)

# ---------------------------------------------------------------- parser: defaults, meaning


@pytest.mark.parametrize(
    "dest, default",
    [
        ("train_samples", None),
        ("rampup_batch_size", None),
        ("step_batch_size_schedule", None),
        ("exit_duration_in_mins", None),
        ("exit_signal_handler", False),
        ("exit_signal", signal.SIGTERM),
        ("calculate_per_token_loss", False),
        ("lr_decay_samples", None),
        ("lr_wsd_decay_samples", None),
        ("lr_warmup_fraction", None),
        ("lr_warmup_samples", 0),
        ("lr_warmup_init", 0.0),
        ("decoupled_lr", None),
        ("decoupled_min_lr", None),
    ],
)
def test_upstream_defaults(dest, default):
    assert getattr(parse_args(args=BASE), dest) == default


@pytest.mark.parametrize(
    "flags, dest, value",
    [
        ("--train-samples 64", "train_samples", 64),
        ("--rampup-batch-size 4 4 16", "rampup_batch_size", [4, 4, 16]),
        ("--step-batch-size-schedule 0:4,1K:8", "step_batch_size_schedule", "0:4,1K:8"),
        ("--exit-duration-in-mins 30", "exit_duration_in_mins", 30),
        ("--exit-signal-handler", "exit_signal_handler", True),
        ("--exit-signal SIGUSR1", "exit_signal", signal.SIGUSR1),
        ("--calculate-per-token-loss", "calculate_per_token_loss", True),
        ("--lr-decay-samples 48", "lr_decay_samples", 48),
        ("--lr-wsd-decay-samples 8", "lr_wsd_decay_samples", 8),
        ("--lr-warmup-fraction 0.1", "lr_warmup_fraction", 0.1),
        ("--lr-warmup-samples 8", "lr_warmup_samples", 8),
        ("--decoupled-lr 0.5", "decoupled_lr", 0.5),
        ("--decoupled-min-lr 0.25", "decoupled_min_lr", 0.25),
    ],
)
def test_flags_parse_to_upstreams_dest(flags, dest, value):
    assert getattr(parse_args(args=[*BASE, *flags.split()]), dest) == value


def test_exit_signal_must_be_a_signal_name():
    with pytest.raises(SystemExit):
        parse_args(args=[*BASE, "--exit-signal", "NOT_A_SIGNAL"])


@pytest.mark.parametrize("name", ["SIGKILL", "SIGSTOP"])
def test_exit_signal_must_be_one_a_process_can_catch(name, capsys):
    """Before: accepted, then an OSError naming no flag once training was about to start."""
    with pytest.raises(SystemExit):
        parse_args(args=[*BASE, "--exit-signal", name])
    assert f"--exit-signal: {name} cannot be caught by a process" in capsys.readouterr().err


def test_train_samples_derives_the_iterations():
    args = validated("--train-samples", "70", "--global-batch-size", "8")
    assert (args.train_iters, args.lr_decay_samples, args.lr_decay_iters) == (8, 70, None)
    assert validate_args(args, world_size=2).train_iters == 8  # idempotent


def test_decoupled_lr_reaches_the_optimizer_config():
    args = validated("--train-iters", "4", "--decoupled-lr", "0.5", "--decoupled-min-lr", "0.1")
    config = get_megatron_optimizer_config(args)
    assert (config.decoupled_lr, config.decoupled_min_lr) == (0.5, 0.1)


def test_step_schedule_sets_the_global_batch_size():
    args = validated("--train-iters", "4", "--step-batch-size-schedule", "0:4 320:8 640:16")
    # Thresholds are tokens (--seq-length 16): 320 tokens = 20 samples.
    assert args.global_batch_size == 16 and args.num_microbatches == 4


@pytest.mark.parametrize(
    "flags, message",
    [
        ("", "--train-iters is required"),
        ("--train-iters 4 --train-samples 64", "--train-iters 4 and --train-samples 64"),
        ("--train-samples 64 --lr-decay-iters 4", "--lr-decay-iters counts iters, .* samples"),
        ("--train-samples 64 --lr-warmup-iters 1", "--lr-warmup-iters counts iters"),
        ("--train-iters 4 --lr-decay-samples 64", "--lr-decay-samples counts samples"),
        ("--train-iters 4 --lr-warmup-samples 8", "--lr-warmup-samples counts samples"),
        ("--train-iters 4 --lr-warmup-fraction 0.5 --lr-warmup-iters 1", "--lr-warmup-fraction"),
        ("--train-samples 64 --lr-warmup-fraction 0.5 --lr-warmup-samples 4", "and --lr-warm"),
        ("--train-iters 4 --lr-warmup-fraction 1.0", r"--lr-warmup-fraction 1.0 must be in"),
        ("--train-samples 64 --lr-warmup-samples 64", r"--lr-warmup-samples 64 must be in \[0"),
        ("--train-samples 64 --lr-decay-style WSD", "WSD needs --lr-wsd-decay-samples"),
        ("--train-samples 2", "--train-samples 2 is less than one global batch"),
        ("--train-iters 4 --decoupled-min-lr 0.1", "--decoupled-min-lr needs --decoupled-lr"),
        ("--train-iters 4 --decoupled-lr 0.1 --decoupled-min-lr 0.2", "--decoupled-min-lr 0.2"),
        (
            "--train-iters 4 --rampup-batch-size 4 4 16 --step-batch-size-schedule 0:4",
            "--step-batch-size-schedule and --rampup-batch-size",
        ),
        (
            "--train-iters 4 --step-batch-size-schedule 0:4,32:8 --global-batch-size 4",
            "--global-batch-size 4 is set too",
        ),
        ("--train-iters 4 --step-batch-size-schedule 16:4", "must start at threshold 0"),
        ("--train-iters 4 --step-batch-size-schedule 0:6", "global batch of 6, not divisible"),
        (
            "--train-iters 4 --rampup-batch-size 4 3 16 --global-batch-size 12",
            "multiple of the increment",
        ),
        ("--train-iters 4 --exit-duration-in-mins 0", "--exit-duration-in-mins must be >= 1"),
    ],
)
def test_bad_combinations_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        validated(*flags.split())


# ------------------------------------------- sample-based schedules = iteration-based ones


def _lr_and_wd_curve(flags: str, iterations: int, batch: int = 8) -> list[tuple[float, float]]:
    args = validated(*flags.split(), "--global-batch-size", str(batch))
    groups = ParamGroups({"wd_mult": 1.0})
    scheduler = get_optimizer_param_scheduler(groups, args)
    curve = []
    for _ in range(iterations):
        scheduler.step(batch)
        curve.append((groups.param_groups[0]["lr"], groups.param_groups[0]["weight_decay"]))
    return curve


COMMON = "--min-lr 1e-3 --lr-warmup-init 1e-4 --weight-decay-incr-style linear "
COMMON += "--start-weight-decay 0.01 --end-weight-decay 0.1"


@pytest.mark.parametrize(
    "style, by_iterations, by_samples",
    [
        (
            "linear",
            "--train-iters 12 --lr-warmup-iters 3",
            "--train-samples 96 --lr-warmup-samples 24",
        ),
        (
            "cosine",
            "--train-iters 12 --lr-decay-iters 10",
            "--train-samples 96 --lr-decay-samples 80",
        ),
        (
            "inverse-square-root",
            "--train-iters 12 --lr-warmup-iters 2",
            "--train-samples 96 --lr-warmup-samples 16",
        ),
        (
            "WSD",
            "--train-iters 12 --lr-wsd-decay-iters 4 --lr-warmup-iters 1",
            "--train-samples 96 --lr-wsd-decay-samples 32 --lr-warmup-samples 8",
        ),
        (
            "cosine",
            "--train-iters 12 --lr-warmup-fraction 0.25",
            "--train-samples 96 --lr-warmup-fraction 0.25",
        ),
        (
            "linear",
            "--train-iters 12 --lr-warmup-fraction 0.25",
            "--train-iters 12 --lr-warmup-iters 3",
        ),
    ],
)
def test_sample_based_schedule_equals_iteration_based(style, by_iterations, by_samples):
    flags = f"{COMMON} --lr-decay-style {style}"
    iterations = _lr_and_wd_curve(f"{flags} {by_iterations}", 14)
    samples = _lr_and_wd_curve(f"{flags} {by_samples}", 14)
    # Flat lists: pytest.approx compares no nested containers (a TypeError from 9.2 on).
    assert [v for pair in iterations for v in pair] == pytest.approx(
        [v for pair in samples for v in pair], rel=1e-12
    )
    assert len(set(iterations)) > 5  # the curve moves


def test_linear_schedule_matches_megatrons_formula():
    """Upstream: warmup init + (max - init) x step / warmup, then a linear decay to min_lr."""
    curve = _lr_and_wd_curve("--train-samples 96 --lr-warmup-samples 24 --min-lr 1e-3", 14)
    lr, min_lr, init = 1e-2, 1e-3, 0.0
    for index, (got, _) in enumerate(curve):
        step = 8 * (index + 1)
        if step <= 24:
            expected = init + (lr - init) * step / 24
        elif step > 96:
            expected = min_lr
        else:
            expected = min_lr + (1 - (step - 24) / (96 - 24)) * (lr - min_lr)
        assert got == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ batch-size schedules


def _upstream_rampup(start: int, increment: int, samples: int, final: int, consumed: int) -> int:
    """Megatron-LM's former RampupBatchsizeNumMicroBatches.update(), written out."""
    steps = (final - start) // increment
    per_increment = samples / steps
    if consumed > samples:
        return final
    return start + int(consumed / per_increment) * increment


@pytest.mark.parametrize("rampup", [(16, 8, 300000, 1024), (4, 4, 16, 12), (2, 2, 7, 10)])
def test_rampup_schedule_matches_megatrons_formula(rampup):
    schedule = rampup_schedule(*rampup)
    for consumed in [*range(0, 3 * rampup[2] // 2 + 3), *range(0, rampup[2] + 5000, 997)]:
        assert schedule.global_batch_size(consumed) == _upstream_rampup(*rampup, consumed)


def test_step_schedule_parses_tokens_and_suffixes():
    schedule = BatchSizeSchedule.parse("0:16 2.4B:320, 4.8B:624", seq_length=2048)
    assert schedule.steps == ((0, 16), (2_400_000_000 // 2048, 320), (4_800_000_000 // 2048, 624))
    assert BatchSizeSchedule.parse("0:4 1K:8", seq_length=None).steps == ((0, 4), (1000, 8))


def test_iterations_for_samples_follow_the_schedule():
    schedule = rampup_schedule(4, 4, 16, 12)  # (0, 4), (8, 8), (16, 12)
    consumed, iterations = 0, 0
    while consumed < 48:
        consumed += schedule.global_batch_size(consumed)
        iterations += 1
    assert schedule.iterations_for(48) == iterations == 6
    assert schedule.samples_after(0, 6) == consumed == 52


@pytest.mark.parametrize("iterations", [0, 1, 2, 3, 4, 6, 50])
def test_sizes_within_are_the_sizes_the_iterations_use(iterations):
    # Thresholds the iterations pass over (9 and 10 fall inside one batch of 8) included.
    # A step to the same size (16: 12) is no new size.
    schedule = BatchSizeSchedule(((0, 4), (6, 8), (9, 2), (10, 12), (16, 12)))
    walked, consumed = [], 0
    for _ in range(iterations):
        size = schedule.global_batch_size(consumed)
        if not walked or walked[-1][1] != size:
            walked.append((consumed, size))
        consumed += size
    assert schedule.sizes_within(iterations) == walked


_forward_calls: list[int] = []


def _counting_forward_step(data_iterator, model):
    _forward_calls.append(1)
    return pretrain_gpt.forward_step(data_iterator, model)


def _pretrain(flags: list[str], forward_step_func=pretrain_gpt.forward_step) -> dict:
    _forward_calls.clear()
    history = pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        ModelType.encoder_or_decoder,
        forward_step_func,
        argv=flags,
    )
    return dict(
        losses=history.loss_curve(),
        learning_rates=history.learning_rates,
        iterations=len(history.losses),
        forward_calls=len(_forward_calls),
    )


def _pretrain_logging(flags: list[str], forward_step_func=pretrain_gpt.forward_step) -> dict:
    """`_pretrain`, with the log lines of the iterations (rank 0's; none elsewhere)."""
    with capture_training_log() as messages:
        result = _pretrain(flags, forward_step_func)
    return {**result, "lines": [m for m in messages if m.startswith("iteration ")]}


def test_rampup_batch_size_trains_the_scheduled_batches():
    flags = [*TINY, "--rampup-batch-size", "4", "4", "16", "--global-batch-size", "12"]
    flags += ["--train-samples", "48", "--log-interval", "1"]
    results = run_distributed(_pretrain_logging, 2, flags, _counting_forward_step)
    batches = [4, 4, 8, 12, 12, 12]  # _upstream_rampup(4, 4, 16, 12, consumed) per iteration
    consumed = [sum(batches[: i + 1]) for i in range(len(batches))]
    # The log reports each iteration's batch (its tokens/s too: test_training_log.py).
    lines = results[0].pop("lines")
    assert [line.split("global batch size:")[1].split("|")[0].strip() for line in lines] == [
        str(batch) for batch in batches
    ]
    assert results[1].pop("lines") == []
    for result in results:
        assert result["iterations"] == 6
        # Each rank runs batch / (micro batch 2 x 2 ranks) microbatches per iteration.
        assert result["forward_calls"] == sum(batch // 4 for batch in batches)
        # The linear decay over --train-samples advances by each iteration's batch.
        expected = [max(0.0, 1e-2 * (1 - c / 48)) for c in consumed]
        assert result["learning_rates"] == pytest.approx(expected, rel=1e-6)
    assert results[0] == results[1]


_microbatch_tokens: list[torch.Tensor] = []


def _recording_forward_step(data_iterator, model):
    """`pretrain_gpt.forward_step`, keeping each micro-batch's tokens."""
    batch = next(data_iterator)
    _microbatch_tokens.append(batch["tokens"].clone())
    return pretrain_gpt.forward_step(iter([batch]), model)


def _pretrain_recording(flags: list[str]) -> dict:
    _microbatch_tokens.clear()
    result = _pretrain_logging(flags, _recording_forward_step)
    return {**result, "tokens": list(_microbatch_tokens)}


def test_step_batch_size_schedule_trains_the_scheduled_batches_on_the_next_samples():
    """`--step-batch-size-schedule "0:4 128:8"` at --seq-length 16: 4 samples an iteration until
    128 tokens (8 samples) were consumed, then 8 (upstream's thresholds are tokens). The sampler
    hands out the same samples in the same order as a run at a constant batch of 4 over the
    same --train-samples: none is skipped or repeated when the batch grows."""
    common = [*TINY, "--train-samples", "24", "--log-interval", "1", "--lr-decay-style", "linear"]
    scheduled = run_distributed(
        _pretrain_recording, 2, [*common, "--step-batch-size-schedule", "0:4 128:8"]
    )
    constant = run_distributed(_pretrain_recording, 2, [*common, "--global-batch-size", "4"])
    batches = [4, 4, 8, 8]  # consumed 0, 4, 8 (= 128 tokens // 16), 16
    lines = scheduled[0]["lines"]
    assert [line.split("global batch size:")[1].split("|")[0].strip() for line in lines] == [
        str(batch) for batch in batches
    ]
    consumed = [int(line.split("consumed samples:")[1].split("|")[0]) for line in lines]
    assert consumed == [4, 8, 16, 24]
    for rank, (result, reference) in enumerate(zip(scheduled, constant)):
        assert result["iterations"] == 4 and reference["iterations"] == 6
        # micro batch 2 x 2 ranks: batch / 4 micro-batches a rank per iteration.
        assert len(result["tokens"]) == sum(batch // 4 for batch in batches)
        assert len(reference["tokens"]) == 6
        for step, (tokens, expected) in enumerate(zip(result["tokens"], reference["tokens"])):
            assert torch.equal(tokens, expected), f"rank {rank}, micro-batch {step}"
    # The ranks read different samples (data parallelism), and the samples differ.
    assert not torch.equal(scheduled[0]["tokens"][0], scheduled[1]["tokens"][0])
    assert not torch.equal(scheduled[0]["tokens"][0], scheduled[0]["tokens"][1])


def test_sample_based_training_equals_iteration_based_training():
    common = [*TINY, "--global-batch-size", "8", "--lr-decay-style", "cosine"]
    by_iterations = run_distributed(
        _pretrain, 2, [*common, "--train-iters", "4", "--lr-warmup-iters", "1"]
    )
    by_samples = run_distributed(
        _pretrain, 2, [*common, "--train-samples", "32", "--lr-warmup-samples", "8"]
    )
    by_fraction = run_distributed(
        _pretrain, 2, [*common, "--train-iters", "4", "--lr-warmup-fraction", "0.25"]
    )
    assert by_iterations[0]["iterations"] == 4
    torch.testing.assert_close(by_samples, by_iterations)
    torch.testing.assert_close(by_fraction, by_iterations)


# ----------------------------------------------------------------------- per-token loss


def _per_token_step(
    engine: str, num_microbatches: int, per_token: bool, first_masked: bool
) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel()
    tokens, labels = make_token_batches(1, 8, seed=3)[0]
    # Uneven token counts per micro-batch and rank; optionally none in the first micro-batch.
    mask = (tokens % 3 != 0).float()
    micro_batches = world * num_microbatches
    if first_masked:
        mask[: len(tokens) // micro_batches] = 0.0
    # The engines sum the gradients (not average them) under the config's flag, as upstream's.
    model = build_tiny_gpt(tiny_gpt_config(calculate_per_token_loss=per_token))
    reference = build_tiny_gpt()
    wrapped = wrap_for_engine(model, engine)
    losses, skipped = masked_sgd_train_step(
        wrapped,
        (tokens, labels, mask),
        num_microbatches=num_microbatches,
        dp_rank=rank,
        dp_size=world,
        per_token=per_token,
    )
    # The plain computation, in one process: the reported loss is the global batch's per
    # token; the gradient is its gradient with `per_token`, else that of the mean over the
    # micro-batches of each one's loss per token (a micro-batch without tokens adds 0).
    per_token_losses = reference(tokens, labels=labels).float() * mask
    reported = per_token_losses.sum() / mask.sum()
    if per_token:
        loss = reported
    else:
        pieces = zip(per_token_losses.chunk(micro_batches), mask.chunk(micro_batches))
        loss = sum(part.sum() / count.sum().clamp(min=1) for part, count in pieces)
        loss = loss / micro_batches
    loss.backward()
    expected = {name: p.detach() - p.grad for name, p in reference.named_parameters()}
    got = {name: _full(value) for name, value in wrapped.state_dict().items()}
    return dict(
        skipped=skipped,
        loss=losses["lm loss"],
        expected_loss=reported.item(),
        got=got,
        expected=expected,
    )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A Megatron-FSDP weight (a DTensor of this rank's shard) as the whole tensor."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


@pytest.mark.parametrize(
    "engine, num_microbatches, per_token, first_masked",
    [
        ("ddp", 1, True, False),
        ("ddp", 2, True, False),
        ("optim_grads_params", 1, True, False),
        ("optim_grads_params", 2, True, False),
        ("optim_grads_params", 2, True, True),
        ("optim_grads_params", 2, False, False),
        ("optim_grads_params", 2, False, True),
        ("ddp", 1, False, True),
    ],
)
def test_per_token_loss_equals_a_plain_computation(
    engine, num_microbatches, per_token, first_masked
):
    """One SGD step (lr 1) on either engine (DDP; Megatron-FSDP, ZeRO-3) moves the weights by
    the gradient of the global batch's mean over its unmasked tokens (`--calculate-per-token-
    loss`), or else of the mean of the micro-batches' means, computed in one process; a
    micro-batch whose tokens are all masked adds nothing (before: a nan loss). The reported
    loss is the global batch's per token either way, as Megatron-LM's (before: the mean of the
    micro-batch means without the flag)."""
    for result in run_distributed(
        _per_token_step, 2, engine, num_microbatches, per_token, first_masked
    ):
        assert not result["skipped"]
        assert result["loss"] == pytest.approx(result["expected_loss"], rel=1e-5)
        torch.testing.assert_close(result["got"], result["expected"])


def _evaluation_losses() -> dict[str, float]:
    """`evaluate` over 2 batches of one micro-batch per rank, each reporting a `[sum, count]`
    pair (`lm loss`) and a plain value (`other`)."""
    parallel_state.initialize_model_parallel()
    # (loss sum, token count, plain value) of each batch on this rank.
    reports = {0: [(6.0, 2.0, 1.0), (1.0, 1.0, 2.0)], 1: [(3.0, 3.0, 3.0), (20.0, 9.0, 6.0)]}

    def forward_step(data_iterator, model):
        total, count, value = next(data_iterator)

        def loss_func(output):
            report = {"lm loss": torch.tensor([total, count]), "other": torch.tensor(value)}
            return torch.tensor(total), torch.tensor(count), report

        return None, loss_func

    args = argparse.Namespace(
        eval_iters=2,
        num_microbatches=1,
        micro_batch_size=1,
        seq_length=1,
        empty_unused_memory_level=0,
    )
    return evaluate(forward_step, iter(reports[dist.get_rank()]), torch.nn.Linear(1, 1), args)


def test_evaluation_pools_the_token_counts_of_its_batches():
    """Megatron-LM's rule: the validation loss is the sum of every batch's loss sums over the
    sum of their token counts, 30 / 15 (before: the mean of each batch's per-token loss, (9 / 5
    + 21 / 10) / 2 = 1.95); a plain value is averaged, (2 + 4) / 2."""
    for losses in run_distributed(_evaluation_losses, 2):
        assert losses == pytest.approx({"lm loss": 2.0, "other": 3.0})


# ---------------------------------------------------------------------------- the exits


def _duration_reason(old_on_rank: int | None) -> str | None:
    args = argparse.Namespace(
        exit_duration_in_mins=1, exit_signal_handler=False, exit_signal=signal.SIGTERM
    )
    started = time.time() - (120 if dist.get_rank() == old_on_rank else 0)
    with ExitConditions(args, started) as exits:
        return exits.reason()


def test_exit_duration_stops_every_rank_when_one_is_past_it():
    assert run_distributed(_duration_reason, 2, None) == [None, None]
    reasons = run_distributed(_duration_reason, 2, 1)
    assert all("--exit-duration-in-mins" in reason for reason in reasons)


def _signal_reason(signalled_rank: int | None) -> str | None:
    args = argparse.Namespace(
        exit_duration_in_mins=None, exit_signal_handler=True, exit_signal=signal.SIGUSR1
    )
    with ExitConditions(args, time.time()) as exits:
        if dist.get_rank() == signalled_rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        return exits.reason()


def test_exit_signal_stops_every_rank_when_one_received_it():
    assert run_distributed(_signal_reason, 2, None) == [None, None]
    reasons = run_distributed(_signal_reason, 2, 0)
    assert all("SIGUSR1 (--exit-signal-handler)" in reason for reason in reasons)


@pytest.mark.parametrize("duration, signal_handler, collectives", [(None, False, 0), (1, True, 1)])
def test_exits_take_one_all_reduce_per_iteration_and_none_without_flags(
    monkeypatch, duration, signal_handler, collectives
):
    """Both exits share one all-reduce per `reason()`; neither flag: no collective at all."""
    calls = []
    recorder = types.SimpleNamespace(
        is_initialized=lambda: True,
        all_reduce=lambda tensor, op: calls.append(op),
        ReduceOp=dist.ReduceOp,
    )
    monkeypatch.setattr(dist_signal_handler, "dist", recorder)
    args = argparse.Namespace(
        exit_duration_in_mins=duration,
        exit_signal_handler=signal_handler,
        exit_signal=signal.SIGUSR1,
    )
    with ExitConditions(args, time.time()) as exits:
        assert exits.reason() is None
    assert len(calls) == collectives
    assert all(op == dist.ReduceOp.MAX for op in calls)


def _sigterm_at_call(call: int, data_iterator, model):
    _forward_calls.append(1)
    if dist.get_rank() == 1 and len(_forward_calls) == call:
        os.kill(os.getpid(), signal.SIGTERM)
    return pretrain_gpt.forward_step(data_iterator, model)


def _pretrain_with_the_exit_clock_ahead(seconds: float, flags: list[str]) -> dict:
    """`_pretrain` with the clock the exit conditions read `seconds` ahead of the one the run's
    start was taken from: the first iteration seems to last that long (no real wait)."""
    ahead = types.SimpleNamespace(time=lambda: time.time() + seconds)
    real = dist_signal_handler.time
    dist_signal_handler.time = ahead
    try:
        return _pretrain(flags)
    finally:
        dist_signal_handler.time = real


def _saved_iteration(root: Path) -> int:
    return int((root / "latest_checkpointed_iteration.txt").read_text())


def test_exit_signal_handler_saves_and_stops_every_rank(tmp_path):
    """SIGTERM on rank 1 during iteration 2: both ranks save iteration 2 and stop."""
    flags = [*TINY, "--global-batch-size", "4", "--train-iters", "6", "--exit-signal-handler"]
    flags += ["--save", str(tmp_path)]
    results = run_distributed(
        _pretrain, 2, flags, functools.partial(_sigterm_at_call, 2), reuse_pool=False
    )
    assert [result["iterations"] for result in results] == [2, 2]
    assert _saved_iteration(tmp_path) == 2


def test_exit_duration_saves_and_stops_every_rank(tmp_path):
    """The first iteration outlasts --exit-duration-in-mins 1: both ranks save it and stop."""
    flags = [*TINY, "--global-batch-size", "4", "--train-iters", "6"]
    flags += ["--exit-duration-in-mins", "1", "--save", str(tmp_path)]
    results = run_distributed(_pretrain_with_the_exit_clock_ahead, 2, 61.0, flags)
    assert [result["iterations"] for result in results] == [1, 1]
    assert _saved_iteration(tmp_path) == 1
