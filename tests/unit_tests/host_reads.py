"""`no_host_reads()`: a check, with real tensors on any device, that code reads no tensor's
values on the host, shared by the tests of what a CUDA graph can capture."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import CodeType

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READ_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.unique_dim.default,
    torch.ops.aten.equal.default,  # returns a Python bool
    torch.ops.aten.bincount.default,  # sized by the largest value
    torch.ops.aten.histc.default,  # its range from the values where not given
}
_HOST_READ_METHODS = {"tolist", "item", "numpy"}
"""Tensor methods that read a CPU tensor's memory without any aten op."""
_INDEXING_OPS = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}
"""Read the host where an index is a boolean mask (its True count sizes the result)."""


def _masked(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices or ()
    )


def _fail(read: str, allowed: frozenset[CodeType]) -> None:
    """Raises for `read`, unless a function of `allowed` is on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in allowed:
            return
        frame = frame.f_back
    raise AssertionError(f"a host read: {read}")


class _FailOnHostReads(TorchDispatchMode):
    def __init__(self, allowed: frozenset[CodeType]):
        super().__init__()
        self._allowed = allowed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sized_by_values = func is torch.ops.aten.repeat_interleave.Tensor
        if (
            func in _HOST_READ_OPS
            or (sized_by_values and kwargs.get("output_size") is None)
            or (func in _INDEXING_OPS and _masked(args))
        ):
            _fail(str(func), self._allowed)
        return func(*args, **kwargs)


class _FailOnHostCopies(TorchFunctionMode):
    def __init__(self, allowed: frozenset[CodeType]):
        super().__init__()
        self._allowed = allowed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _HOST_READ_METHODS:
            _fail(f"Tensor.{func.__name__}", self._allowed)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads(allowed: tuple[Callable, ...] = ()) -> Iterator[None]:
    """Fails with an AssertionError ("a host read: ...") on any read of a tensor's values by
    the host in the body (as `FakeTensorMode` does, but with real tensors, so that collectives
    run): `.item()`, `.tolist()`, `.numpy()`, `torch.equal`, and the ops whose output is sized
    by values (boolean-mask indexing among them). On CPU a copy to the host (`.cpu()`) is no
    read, host and device memory being one: only a GPU run sees those.

    Args:
        allowed: functions whose reads (their own and their callees') pass: reads that are
            meant, and cost no wait for the device where it matters.
    """
    codes = frozenset(function.__code__ for function in allowed)
    with _FailOnHostCopies(codes), _FailOnHostReads(codes):
        yield
