"""Fixtures of the flag tests: CUDA made to look available (to reach the checks behind the CUDA
check on a CPU machine) or unavailable (to test that check on a GPU machine)."""

import pytest
import torch


@pytest.fixture
def cuda_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def cuda_unavailable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
