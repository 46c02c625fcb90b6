"""`pretrain_gpt` with multi-token prediction (`--mtp-num-layers 2`) on 2 gloo ranks: each depth's
loss is logged and recorded; Megatron-FSDP ZeRO-3 (whose units include the depths, and whose
embedding and output layer units run once per depth) trains as the DDP engine, also with
`--calculate-per-token-loss` and when built on the meta device; training resumed from a
checkpoint is bitwise the uninterrupted run; in FP8, ZeRO-3 gathering the depths' weights as
FP8 trains as gathering them in bf16; a checkpoint without the depths is refused by name."""

from __future__ import annotations

import pytest
import torch

from megatron.training.training import TrainingHistory
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    ZERO3,
    assert_histories_equal,
    main,
    main_error,
    resumed_part,
)
from tests.unit_tests.training.log_capture import capture_training_log

MTP = "--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3 --log-interval 3".split()
KEYS = ["lm loss", "mtp_1 loss", "mtp_2 loss"]


def _main_logging(flags: list[str]) -> tuple[TrainingHistory, list[str]]:
    with capture_training_log() as messages:
        history = main(flags)
    return history, [m for m in messages if m.startswith("iteration ")]


@pytest.fixture(scope="module")
def runs():
    """flags -> (rank 0's history, rank 0's iteration lines), each run once when first asked."""
    cache: dict[tuple[str, ...], tuple[TrainingHistory, list[str]]] = {}

    def get(*extra: str) -> tuple[TrainingHistory, list[str]]:
        if extra not in cache:
            (history, lines), (other, _) = run_distributed(_main_logging, 2, [*RUN, *MTP, *extra])
            assert other.losses == history.losses  # reported the same on every rank
            cache[extra] = history, lines
        return cache[extra]

    return get


def test_each_depths_loss_is_logged_and_recorded(runs):
    history, lines = runs(*ZERO3)
    assert all(sorted(losses) == KEYS for losses in history.losses)
    for losses in history.losses:
        # Depths predicting further ahead learn from their own, different, losses.
        assert len({losses[key] for key in KEYS}) == 3
        # Near ln(128) (the padded vocabulary) for an untrained model: real losses, not zeros.
        assert all(4.0 < value < 5.5 for value in losses.values()), losses
    # The first iteration's line, then the interval's (iterations 1-3) and the last (4-6).
    assert len(lines) == 3
    for line, iterations in zip(lines[1:], ([0, 1, 2], [3, 4, 5])):
        for key in KEYS:
            mean = sum(history.losses[i][key] for i in iterations) / 3
            assert f"| {key}: {mean:.6E} |" in line


@pytest.mark.parametrize("per_token", [False, True])
def test_zero3_trains_as_ddp(runs, per_token):
    extra = ("--calculate-per-token-loss",) if per_token else ()
    ddp, _ = runs(*extra)
    zero3, _ = runs(*ZERO3, *extra)
    for expected, actual in zip(ddp.losses, zero3.losses):
        torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(zero3.grad_norms, ddp.grad_norms)
    torch.testing.assert_close(zero3.validation_losses, ddp.validation_losses)


def test_meta_device_build_trains_as_the_eager_one(runs):
    eager, _ = runs(*ZERO3)
    meta, _ = runs(*ZERO3, "--init-model-with-meta-device")
    assert_histories_equal(meta, eager)


def test_resumed_training_is_bitwise_the_uninterrupted_run(runs, tmp_path):
    straight, _ = runs(*ZERO3)
    root = str(tmp_path)
    first = run_distributed(main, 2, [*RUN, *MTP, *ZERO3, "--exit-interval", "3", "--save", root])[
        0
    ]
    assert first.losses == straight.losses[:3]
    second = run_distributed(main, 2, [*RUN, *MTP, *ZERO3, "--load", root, "--save", root])[0]
    assert second.start_iteration == 3
    assert_histories_equal(second, resumed_part(straight, 3))


FP8 = "--bf16 --fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max".split()


def test_fp8_depths_gathered_as_fp8_train_as_gathered_in_bf16(runs):
    """ZeRO-3 gathers the FP8 depths' weights as FP8 bytes with `--fp8-param-gather`, bit for
    bit as without it, and each depth's loss stays within 2% of the bf16 run's."""
    gathered_in_bf16, _ = runs(*ZERO3, *FP8)
    gathered_as_fp8, _ = runs(*ZERO3, *FP8, "--fp8-param-gather")
    assert_histories_equal(gathered_as_fp8, gathered_in_bf16)
    bf16, _ = runs(*ZERO3, "--bf16")
    for fp8_losses, bf16_losses in zip(gathered_in_bf16.losses, bf16.losses):
        for key in KEYS:
            assert abs(fp8_losses[key] - bf16_losses[key]) < 0.02 * bf16_losses[key], key


def test_a_checkpoint_without_the_depths_is_refused_by_name(tmp_path):
    root = str(tmp_path)
    run_distributed(main, 2, [*RUN, "--exit-interval", "1", "--save", root])
    for error in run_distributed(main_error, 2, [*RUN, *MTP, "--load", root]):
        assert error is not None and error[0] == "CheckpointError"
        assert "--mtp-num-layers None (here 2)" in error[1]


def test_the_depths_losses_reach_the_shared_weights_with_their_factor(runs):
    """Without dropout, the same first losses with the factor 0 and 0.3 (the depths change no
    weight the next-token loss uses before a step), but not the same gradients; the next-token
    loss differs once a step has updated the weights (the third: the warmup's first learning
    rate is 0) only because the depths' losses, weighted by the factor, train the shared
    embedding and decoder."""
    no_dropout = ("--hidden-dropout", "0", "--attention-dropout", "0")
    weighted, _ = runs(*no_dropout)
    unweighted, _ = runs(*no_dropout, "--mtp-loss-scaling-factor", "0")
    assert weighted.losses[0] == unweighted.losses[0]
    assert weighted.grad_norms[0] != unweighted.grad_norms[0]
    assert weighted.losses[1]["lm loss"] == unweighted.losses[1]["lm loss"]
    assert weighted.losses[2]["lm loss"] != unweighted.losses[2]["lm loss"]
