"""`pretrain_gpt.py` with context parallelism on 2 CPU ranks: a run at CP 2 (Megatron-FSDP
ZeRO-3, ring attention) trains as the same run at CP 1 (DP 2, DDP engine); stopped after
iteration 3 and resumed at CP 2 it is bitwise the uninterrupted run; its checkpoint loads at
CP 1 (the DDP engine), whose own checkpoint after iteration 5 loads back at CP 2 (a2a this
time), each resumed run training as the uninterrupted one. Checkpoints hold whole tensors, so
the context-parallel size (which changes no parameter) is free to change between runs."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    ZERO3,
    assert_histories_equal,
    main,
    read_tracker_text,
    resumed_part,
)

# Ring attention has no attention dropout; hidden dropout would draw other masks for other
# splits of the sequence, so the runs at CP 1 and CP 2 are compared without it.
NO_DROPOUT = ("--attention-dropout", "0", "--hidden-dropout", "0")
CP2 = (*NO_DROPOUT, *ZERO3, "--context-parallel-size", "2", "--position-embedding-type", "rope")
CP1 = (*NO_DROPOUT, "--position-embedding-type", "rope")


FP32 = dict(rtol=1.3e-6, atol=1e-5)
"""torch.testing's float32 tolerances: the histories hold fp32 results as Python floats, which
it would compare at float64's."""


def _assert_trains_as(actual, expected, until: int | None = None) -> None:
    """The same run computed with another split of the work: equal up to fp32 rounding (up to
    iteration `until` when `actual` stopped there, without the end-of-training evaluations)."""
    if until is not None:
        kept = until - expected.start_iteration
        expected = dataclasses.replace(
            expected,
            losses=expected.losses[:kept],
            grad_norms=expected.grad_norms[:kept],
            learning_rates=expected.learning_rates[:kept],
            validation_losses={i: v for i, v in expected.validation_losses.items() if i <= until},
            final_validation_losses=actual.final_validation_losses,
            test_losses=actual.test_losses,
        )
    for name in ("losses", "grad_norms", "validation_losses", "final_validation_losses"):
        torch.testing.assert_close(getattr(actual, name), getattr(expected, name), **FP32)
    torch.testing.assert_close(actual.test_losses, expected.test_losses, **FP32)
    assert actual.learning_rates == expected.learning_rates


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The uninterrupted runs at CP 2 and CP 1, and a --save directory of the CP 2 run
    stopped after iteration 3."""
    root = str(tmp_path_factory.mktemp("cp2-first-half"))
    first = run_distributed(
        main, 2, [*RUN, *CP2, "--exit-interval", "3", "--save", root, "--save-interval", "3"]
    )[0]
    assert len(first.losses) == 3
    return dict(
        cp2=run_distributed(main, 2, [*RUN, *CP2])[0],
        cp1=run_distributed(main, 2, [*RUN, *CP1])[0],
        root=root,
    )


def test_cp2_trains_as_cp1(runs):
    assert runs["cp2"].losses[-1]["lm loss"] < runs["cp2"].losses[0]["lm loss"]
    _assert_trains_as(runs["cp2"], runs["cp1"])


def test_cp2_resume_is_bitwise_the_uninterrupted_run(runs, tmp_path):
    resume_root = str(tmp_path / "resume")
    shutil.copytree(runs["root"], resume_root)
    resumed = run_distributed(main, 2, [*RUN, *CP2, "--load", resume_root, "--save", resume_root])
    assert resumed[0].start_iteration == 3
    assert_histories_equal(resumed[0], resumed_part(runs["cp2"], 3))
    assert_histories_equal(resumed[1], resumed[0])
    assert read_tracker_text(resume_root) == "6\n"


def test_checkpoints_load_across_context_parallel_sizes(runs, tmp_path):
    at_cp1 = str(tmp_path / "cp1")
    shutil.copytree(runs["root"], at_cp1)
    resumed = run_distributed(
        main,
        2,
        [*RUN, *CP1, "--load", at_cp1, "--save", at_cp1, "--exit-interval", "5"],
    )[0]
    assert resumed.start_iteration == 3
    _assert_trains_as(resumed, resumed_part(runs["cp2"], 3), until=5)
    assert read_tracker_text(at_cp1) == "5\n"

    back = [*RUN, *CP2, "--cp-comm-type", "a2a", "--load", at_cp1, "--save", at_cp1]
    finished = run_distributed(main, 2, back)[0]
    assert finished.start_iteration == 5
    _assert_trains_as(finished, resumed_part(runs["cp2"], 5))
    assert read_tracker_text(at_cp1) == "6\n"
