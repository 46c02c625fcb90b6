"""Errors that every rank finds alike once the process group exists (`reported_as_flag_errors`)
end a job as a bad flag does: rank 0 prints the message once, every rank exits with code 2, no
traceback; a rank that alone found one prints it after the grace; outside a script's entry
point they propagate unchanged."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch.distributed as dist

from megatron.training import flag_errors
from megatron.training.checkpoint_layout import CheckpointError
from megatron.training.flag_errors import report_flag_errors, reported_as_flag_errors
from tests.unit_tests.distributed_harness import run_distributed

MESSAGE = "--save ckpt is in use by another job (host h, pid 7, started t)"


def _exit_of(raises: bool, grace_s: float | None = None) -> tuple[int | None, str]:
    """(exit code, stderr) of a script's entry point on this rank, whose step raises the
    error if `raises` (None: no exit); `grace_s` replaces `FLAG_ERROR_GRACE_S`."""
    grace = flag_errors.FLAG_ERROR_GRACE_S
    if grace_s is not None:
        flag_errors.FLAG_ERROR_GRACE_S = grace_s
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            with report_flag_errors(), reported_as_flag_errors(CheckpointError):
                if raises:
                    raise CheckpointError(MESSAGE)
    except SystemExit as exit_info:
        return exit_info.code, stderr.getvalue()
    finally:
        flag_errors.FLAG_ERROR_GRACE_S = grace
    return None, stderr.getvalue()


def test_an_error_of_every_rank_is_printed_once_by_rank_0():
    assert run_distributed(_exit_of, 2, True) == [(2, f"error: {MESSAGE}\n"), (2, "")]


def _raised_by_rank_1_alone() -> tuple[int | None, str]:
    return _exit_of(dist.get_rank() == 1, grace_s=0.5)


def test_an_error_rank_0_did_not_find_is_printed_after_the_grace_by_the_rank_that_did():
    """Rank 0 never comes to the barrier: rank 1 waits the grace only, and says why it ends."""
    results = run_distributed(_raised_by_rank_1_alone, 2, reuse_pool=False)
    assert results == [(None, ""), (2, f"error (rank 1): {MESSAGE}\n")]


def test_outside_an_entry_point_the_error_propagates_unchanged(capsys):
    with (
        pytest.raises(CheckpointError, match="is in use"),
        reported_as_flag_errors(CheckpointError),
    ):
        raise CheckpointError(MESSAGE)
    assert capsys.readouterr().err == ""
