"""Errors of bad flags found once the process group exists (`reported_as_flag_errors`) end a job
as a bad flag does: rank 0 prints the message once, every rank that raised exits with code 2, no
traceback; a rank that alone found one prints it after the grace, without a collective that the
ranks which found nothing could mismatch; outside a script's entry point they propagate
unchanged."""

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
    """Rank 0 posts no message: rank 1 waits the grace only, and says why it ends."""
    results = run_distributed(_raised_by_rank_1_alone, 2, reuse_pool=False)
    assert results == [(None, ""), (2, f"error (rank 1): {MESSAGE}\n")]


def _rank_0_goes_on_to_its_next_collective() -> tuple[object, str | None]:
    """Rank 1 alone raises; rank 0 has gone on to a broadcast from rank 1, which rank 1 sends
    after its report (a job's other ranks would be ended by the launcher instead)."""
    if dist.get_rank() == 0:
        received: list[object] = [None]
        dist.broadcast_object_list(received, src=1)
        return received[0], None
    outcome = _exit_of(True, grace_s=0.5)
    dist.broadcast_object_list(["sent after the report"], src=1)
    return outcome


def test_a_lone_error_is_not_matched_with_the_other_ranks_next_collective():
    results = run_distributed(_rank_0_goes_on_to_its_next_collective, 2, reuse_pool=False)
    assert results == [("sent after the report", None), (2, f"error (rank 1): {MESSAGE}\n")]


def _rank_0_reports_another_error() -> tuple[int | None, str]:
    if dist.get_rank() == 0:
        with contextlib.redirect_stderr(io.StringIO()) as stderr:
            with pytest.raises(SystemExit):
                with report_flag_errors(), reported_as_flag_errors(CheckpointError):
                    raise CheckpointError("another problem")
        return 2, stderr.getvalue()
    return _exit_of(True, grace_s=30.0)


def test_a_rank_whose_error_differs_from_rank_0s_prints_its_own_at_once():
    results = run_distributed(_rank_0_reports_another_error, 2, timeout=20.0)
    assert results == [(2, "error: another problem\n"), (2, f"error (rank 1): {MESSAGE}\n")]


def test_outside_an_entry_point_the_error_propagates_unchanged(capsys):
    with (
        pytest.raises(CheckpointError, match="is in use"),
        reported_as_flag_errors(CheckpointError),
    ):
        raise CheckpointError(MESSAGE)
    assert capsys.readouterr().err == ""
