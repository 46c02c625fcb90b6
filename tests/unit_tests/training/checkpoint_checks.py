"""What the checkpoint tests compare: whole tensors (DTensors gathered), exact equality of
nested state, and a checkpoint's tensors read without the code that wrote them."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor`, gathered whole if it is a DTensor."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Recursive exact equality: tensors bitwise, with the same dtype and shape."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (
            f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def read_whole_checkpoint(path: str, scratch: str) -> dict[str, Any]:
    """A checkpoint's tensors, whole, read in this process (DCP's own converter)."""
    os.makedirs(scratch, exist_ok=True)
    output = os.path.join(scratch, "whole.pt")
    dcp_to_torch_save(path, output)
    whole = torch.load(output, weights_only=False)
    os.remove(output)
    return whole
