"""`tools/plot_loss_curves.py` reads the losses a real `pretrain_gpt.py` run logs (its periodic
lines and validation boxes), and compares runs."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training.training import pretrain
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.tools.test_benchmark_fsdp import REPO
from tests.unit_tests.training.log_capture import capture_training_log

if str(REPO / "tools") not in sys.path:  # the tool is a script: import it by path
    sys.path.insert(0, str(REPO / "tools"))
import plot_loss_curves  # noqa: E402

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 2 --train-iters 6 --lr 1e-2 --mock-data "
    "--vocab-size 64 --num-workers 0 --log-interval 1 --eval-interval 3 --eval-iters 1"
).split()


def _logged_run(seed: int) -> tuple[list[str], list[float], dict[int, float]]:
    with capture_training_log() as messages:
        history = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            argv=[*FLAGS, "--seed", str(seed), "--distributed-backend", dist.get_backend()],
        )
    validation = {i: losses["lm loss"] for i, losses in history.validation_losses.items()}
    return messages, history.loss_curve(), validation


def _read(tmp_path, name: str, messages: list[str]) -> plot_loss_curves.Curves:
    path = tmp_path / f"{name}.log"
    path.write_text("\n".join(messages) + "\n")
    return plot_loss_curves.read_log(str(path))


def test_the_losses_a_run_logs_are_read_back(tmp_path):
    (first,) = run_distributed(_logged_run, 1, 1234)
    (second,) = run_distributed(_logged_run, 1, 4321)
    curves = _read(tmp_path, "a", first[0])
    assert sorted(curves.train) == list(range(1, 7))
    # The log prints 7 significant digits.
    for logged, exact in zip((curves.train[i] for i in range(1, 7)), first[1]):
        assert math.isclose(logged, exact, rel_tol=1e-6)
    assert curves.validation.keys() == first[2].keys() == {3, 6}
    for i, exact in first[2].items():
        assert math.isclose(curves.validation[i], exact, rel_tol=1e-6)
    other = _read(tmp_path, "b", second[0])
    table = plot_loss_curves.summary({"a": curves, "b": other}, tail=2)
    difference = 100 * (other.validation[6] - curves.validation[6]) / curves.validation[6]
    assert f"{other.validation[6]:.4f} ({difference:+.2f}%)" in table


def test_a_file_without_log_lines_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.log"
    path.write_text("nothing here\n")
    with pytest.raises(ValueError, match="empty.log has no `iteration N/ M"):
        plot_loss_curves.read_log(str(path))


def test_moving_average():
    assert plot_loss_curves.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_the_plot_is_written(tmp_path):
    curves = plot_loss_curves.Curves(train={1: 2.0, 2: 1.5}, validation={2: 1.6})
    out = tmp_path / "curves.png"
    plot_loss_curves.plot({"run": curves}, 2, "title", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
