"""Small helpers shared across the library: writing files so that a crash never leaves a partial
one where a reader looks, the tensor-in, tensor-out collectives under either torch's name, whether
a CUDA graph is being captured, and autograd functions applied (and differentiated once) without
the Python wrappers that cost host time per layer and step."""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import Callable
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def cuda_graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph. False before CUDA is initialised
    (nothing can capture then; a CUDA build of torch without a GPU raises on the query itself).
    Asked per layer and pass: `torch.cuda.is_available()` would read the environment each
    time."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def direct_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """`function.apply` without the Python wrapper of `torch.autograd.Function.apply`.

    For autograd functions applied per layer and step: the wrapper's checks (default arguments
    of `setup_context`, functorch's transforms and the dead wrappers they leave) cost host time
    on every call, so this calls torch's C implementation. Under an active `torch.func`
    transform, or while `torch.compile` traces the call (Dynamo traces `apply`, not the C
    function), `function.apply` itself runs. A tensor left over from a finished `torch.func`
    transform is not unwrapped: pass it through `apply` instead.

    Args:
        function: defines `forward(ctx, ...)` and `backward`, no `setup_context`.

    Returns:
        A function taking `function.apply`'s positional arguments.

    Raises:
        TypeError: `function` defines `setup_context`, whose default arguments only the wrapper
            binds.
    """
    if function.setup_context is not torch.autograd.Function.setup_context:
        raise TypeError(f"{function.__name__} defines setup_context: use its apply().")
    apply_in_c = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
    transforms_active = torch._C._are_functorch_transforms_active
    is_compiling = torch.compiler.is_compiling

    def apply(*args: Any) -> Any:
        if transforms_active() or is_compiling():
            return function.apply(*args)
        return apply_in_c(*args)

    return apply


def once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.autograd.function.once_differentiable`, its wrapper entered only where needed.

    Torch's wrapper runs `backward` under `no_grad` and makes its outputs raise if
    differentiated again; autograd runs a backward with grad mode off unless
    `create_graph=True`, so only then is the wrapper entered, and otherwise its cost in host
    time per layer and step is saved.

    Args:
        backward: an autograd function's `backward(ctx, *grads)`.

    Returns:
        `backward`, differentiable once.
    """
    wrapped = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def dispatch(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            return wrapped(ctx, *grads)
        return backward(ctx, *grads)

    return dispatch


def with_zero_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` followed by `rows` rows of zeros (`x` itself for none)."""
    return torch.cat([x, x.new_zeros(rows, *x.shape[1:])]) if rows else x


def outside_compiled_graphs(function: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compiler.disable(function)`, made at the first call instead of at import.

    `torch.compiler.disable` imports `torch._dynamo`, about a second of host time: made at
    import, it would be paid by every process that imports Megatron, command-line tools and
    error exits too. Made at the first call, in eager mode or while a compiler traces the
    caller (a graph break either way), `function` runs outside compiled graphs as with the
    decorator.

    Args:
        function: what compiled callers must run eagerly.

    Returns:
        `function`, never traced into a compiled graph.
    """
    disabled: Callable[..., Any] | None = None

    @functools.wraps(function)
    def outside_graph(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(function)
        return disabled(*args, **kwargs)

    return outside_graph


class FreshContext:
    """A context manager that enters a new context made by `factory` each time it is entered,
    so that it can be entered again, and nested: what `torch.utils.checkpoint`'s `context_fn`
    must return for its recomputation context, entered once per backward that recomputes
    (a generator-based context can be entered once only)."""

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager]):
        self._factory = factory
        self._entered: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> Any:
        context = self._factory()
        self._entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self._entered.pop().__exit__(*exc_info)


def write_atomically(
    path: str, write: Callable[[BinaryIO], object], *, durable: bool = False
) -> None:
    """Writes `path` through `write(stream)` into a temporary file beside it, renamed to `path`
    when complete (and removed if `write` fails): readers see the old file or the whole new one.

    Args:
        path: the file to (re)place.
        write: writes the content into a binary stream.
        durable: also fsync the file and its directory, so that a crash right after cannot undo
            the write (for files that commit a state, such as a checkpoint's).
    """
    temporary = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(temporary, "wb") as stream:
            write(stream)
            if durable:
                stream.flush()
                os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    if durable:
        fsync_directory(os.path.dirname(path))


def fsync_directory(path: str) -> None:
    """Makes the renames inside directory `path` durable (a crash right after keeps them)."""
    descriptor = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
