"""Test-session setup: the `gpu` marker and the multi-rank worker pools."""

import pytest
import torch

from tests.unit_tests.distributed_harness import shutdown_pools


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
