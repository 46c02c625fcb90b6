"""Fixtures of the training tests: CUDA made to look available (to reach the checks behind the
CUDA check on a CPU machine) or unavailable (to test that check on a GPU machine); a world of one
for `pretrain()` in the test's process."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state


@pytest.fixture
def cuda_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def cuda_unavailable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def world_of_one(monkeypatch):
    """`pretrain()` joins (and must leave) a default group of its own in this process."""
    if dist.is_initialized():
        pytest.skip("this process is in a process group already")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    yield
    if dist.is_initialized():  # the test failed: do not leak the group into later tests
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
