"""Test-session setup: the `gpu` marker, the multi-rank worker pools, the intra-op threads of
parallel test processes (pytest-xdist's `-n`), and a check that the tests leave nothing behind
in the repository."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.unit_tests.distributed_harness import set_ranks_on_gpus, shutdown_pools

ROOT = Path(__file__).resolve().parents[1]

_UNTRACKED_BEFORE = pytest.StashKey[frozenset]()


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    if not _is_xdist_worker(config):
        return
    # Each test process of `pytest -n N` gets its share of the cores: intra-op threads of
    # several processes on the same cores only wait for one another (OpenMP's threads spin).
    # The environment variable reaches the programs the tests start.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // config.workerinput["workercount"])
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before the test's fixtures, which may start ranks too.
    set_ranks_on_gpus(item.get_closest_marker("gpu") is not None)


def _git(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", *command], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def _untracked() -> frozenset[str] | None:
    """What git neither tracks nor ignores in the repository: untracked files, and empty
    top-level folders (which git does not list, such as one a script creates with `mkdir -p`).
    None outside a git checkout."""
    try:
        status = _git("status", "--porcelain", "--untracked-files=all", "-z")
    except (OSError, subprocess.SubprocessError):
        return None
    if status.returncode != 0:
        return None
    files = {entry[3:] for entry in status.stdout.split("\0") if entry.startswith("?? ")}
    empty = {
        name
        for name in os.listdir(ROOT)
        if (ROOT / name).is_dir() and not any((ROOT / name).iterdir())
    }
    # `git check-ignore` names those of them that are ignored.
    ignored = set(_git("check-ignore", *empty).stdout.split()) if empty else set()
    return frozenset(files | (empty - ignored))


def pytest_sessionstart(session):
    if _is_xdist_worker(session.config):
        return  # the controlling process checks once, after every worker has ended
    untracked = _untracked()
    if untracked is not None:
        session.stash[_UNTRACKED_BEFORE] = untracked


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
    if _is_xdist_worker(session.config):
        return
    before = session.stash.get(_UNTRACKED_BEFORE, None)
    after = None if before is None else _untracked()
    if after is None or not after - before:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = (
        "The tests left new untracked files or folders in the repository (write to tmp_path, "
        f"not the working directory): {', '.join(sorted(after - before))}"
    )
    if reporter is not None:
        reporter.write_line("")  # ends the progress line
        reporter.write_line(f"ERROR: {message}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
