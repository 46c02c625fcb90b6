"""`TritonLaunch`: a Triton kernel's launches for the price of its compiled launcher.

`kernel[grid](*args)` spends 15-20 us of host time before the kernel starts on an H100 or H200
host: it binds the arguments, derives each one's specialisation through several Python calls,
looks the compiled kernel up, checks the kernel's globals and builds its launch metadata. For the
small kernels this project launches several times per layer and step (FP8 casts, the rotary
kernel) that is as much as their GPU time, and where steps are bound by the host it is the step's
time.

A `TritonLaunch` keeps, per device and specialisation, the compiled kernel that Triton's own path
made (the first launch of each specialisation goes through `kernel[grid]`), and launches it
through that kernel's launcher with nothing else on the way. The specialisation is derived here
as Triton derives it: a tensor by its dtype and whether its address is a multiple of 16 bytes, an
integer by its width (32 or 64 bits, signed or not), whether it is 1 and whether it is a multiple
of 16, a constexpr by its value, a float or a bool by its type.

Where that cannot be vouched for, every launch goes through `kernel[grid]`: a Triton release
outside those whose launcher this was checked against (`_CHECKED_RELEASES`), launch or pre-run
hooks set (profilers such as Proton), an argument of another type, `torch.compile` tracing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
except ImportError:  # CPU-only PyTorch builds
    triton = None

_CHECKED_RELEASES = ((3, 2), (3, 6))
"""The first and last Triton releases (major, minor) whose compiled kernels launch as
`kernel.run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *args)`, the arguments being all of the kernel's, constexprs included."""

_INT32 = range(-(2**31), 2**31)
_INT64 = range(-(2**63), 2**63)


class _Unkeyed(Exception):
    """An argument whose specialisation is not derived here: Triton's path launches."""


def specialisation(arg: Any) -> Any:
    """What Triton compiles a kernel argument's value into (the module docstring).

    Raises:
        _Unkeyed: an argument of another type.
    """
    kind = type(arg)
    if kind is int:
        width = 32 if arg in _INT32 else 64 if arg in _INT64 else 65
        return (width, arg == 1, arg % 16 == 0)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is float or kind is bool or arg is None:
        return kind
    raise _Unkeyed


def _current_stream() -> Callable[[int], int]:
    """The raw CUDA stream of a device, through torch's C binding where it has one (Triton's
    own driver reads it there too)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


def _release_checked() -> bool:
    if triton is None:
        return False
    try:
        release = tuple(int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return _CHECKED_RELEASES[0] <= release <= _CHECKED_RELEASES[1]


def _hooks_set() -> bool:
    """Whether Triton's launch hooks would call anything (Triton 3.4 on keeps chains of them,
    empty by default; earlier releases a hook or None)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return True
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class TritonLaunch:
    """Launches of one Triton JIT kernel with fixed launch options (module docstring).

    Args:
        kernel: the `triton.jit` function; its constexpr parameters come after the others.
        options: Triton's launch options (`num_warps`, `num_stages`), the same for every launch.
    """

    def __init__(self, kernel: Any, **options: Any) -> None:
        self._kernel = kernel
        self._options = options
        flags = [param.is_constexpr for param in kernel.params]
        self._constexpr_names = tuple(p.name for p in kernel.params if p.is_constexpr)
        self._arity = flags.count(False)
        # Launched positionally: the constexprs must be the last parameters.
        self._direct = _release_checked() and flags == sorted(flags)
        self._stream = _current_stream()
        self._launches: dict[tuple, tuple[Any, Any, Any]] = {}
        """(device, constexprs, specialisations) -> (launcher, function, packed metadata)."""

    def __call__(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        """`kernel[grid](*args, **constexprs, **options)`.

        Args:
            grid: one to three program counts.
            args: the kernel's non-constexpr arguments, in order.
            constexprs: its constexpr arguments, by name.
        """
        if (
            not self._direct
            or len(args) != self._arity
            or self._kernel.pre_run_hooks
            or _hooks_set()
            or torch.compiler.is_compiling()
        ):
            self._kernel[grid](*args, **constexprs, **self._options)
            return
        device = torch.cuda.current_device()
        try:
            constants = tuple(constexprs[name] for name in self._constexpr_names)
            key = (device, constants, tuple(map(specialisation, args)))
        except (KeyError, _Unkeyed):
            self._kernel[grid](*args, **constexprs, **self._options)
            return
        launch = self._launches.get(key)
        if launch is None:
            compiled = self._kernel[grid](*args, **constexprs, **self._options)
            if hasattr(compiled, "result"):  # compiled asynchronously
                compiled = compiled.result()
            # `run` loads the kernel's module on its first use.
            self._launches[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = launch
        x, y, z = (*grid, 1, 1)[:3]
        run(x, y, z, self._stream(device), function, metadata, None, None, None, *args, *constants)
