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
of 16, a constexpr by its value and type, a float or a bool by its type.

Where that cannot be vouched for, every launch goes through `kernel[grid]`: a Triton release
outside those whose launcher this was checked against (`_CHECKED_RELEASES`), ROCm (whose Triton
also specialises pointers on their buffers' sizes), launch or pre-run hooks set (profilers such
as Proton), Triton's debug or instrumentation modes, an argument of another type or out of
Triton's integer range, a launch option passed per call, `torch.compile` tracing. Unlike
`kernel[grid]`, a kept launch does not check that the globals the kernel read when it compiled
are unchanged: kernels launched this way read constants only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
except ImportError:  # CPU-only PyTorch builds
    triton = None

_CHECKED_RELEASES = ((3, 4), (3, 6))
"""The first and last Triton releases (major, minor) whose compiled kernels launch as
`kernel.run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *args)`, the arguments being all of the kernel's, constexprs included
(3.3 and earlier pass the non-constexpr ones only, and keep no `triton.knobs`)."""

_INT32 = range(-(2**31), 2**31)
_INT64 = range(-(2**63), 2**63)
_UINT64 = range(2**63, 2**64)


class _Unkeyed(Exception):
    """An argument whose specialisation is not derived here: Triton's path launches."""


def specialisation(arg: Any) -> Any:
    """What Triton compiles a kernel argument's value into (the module docstring).

    Raises:
        _Unkeyed: an argument of another type, or an integer beyond Triton's 64 bits.
    """
    kind = type(arg)
    if kind is int:
        if arg in _INT32:
            width = 32
        elif arg in _INT64:
            width = 64
        elif arg in _UINT64:
            width = 65  # unsigned
        else:  # Triton refuses it
            raise _Unkeyed
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
    if triton is None or torch.version.hip is not None:
        return False
    try:
        release = tuple(int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return _CHECKED_RELEASES[0] <= release <= _CHECKED_RELEASES[1]


def _instrumented() -> bool:
    """Whether Triton's launch hooks would call anything (Triton 3.4 on keeps chains of them,
    empty by default), or its debug or instrumentation modes are on (both in its kernels'
    cache keys)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return True
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return bool(runtime.debug or knobs.compilation.instrumentation_mode)


def launches_on(tensor: torch.Tensor) -> bool:
    """Whether this project's Triton kernels run for `tensor`: Triton is importable, `tensor`
    lies on the current CUDA device (where Triton launches), and `torch.compile` is not tracing
    (it fuses the PyTorch ops the kernels stand for by itself). Each kernel adds its own checks
    of shapes and dtypes."""
    return launches_on_device(tensor.device)


def launches_on_device(device: torch.device) -> bool:
    """`launches_on` for tensors on `device` (`cuda` without an index: the current device)."""
    return (
        triton is not None
        and device.type == "cuda"
        and device.index in (None, torch.cuda.current_device())
        and not torch.compiler.is_compiling()
    )


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
        """`_key` -> (launcher, function, packed metadata)."""

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
            or len(constexprs) != len(self._constexpr_names)
            or _instrumented()
            or torch.compiler.is_compiling()
        ):
            self._kernel[grid](*args, **constexprs, **self._options)
            return
        device = torch.cuda.current_device()
        try:
            key, constants = self._key(device, args, constexprs)
            launch = self._launches.get(key)
        except (KeyError, TypeError, _Unkeyed):  # a missing or unhashable constexpr too
            self._kernel[grid](*args, **constexprs, **self._options)
            return
        if launch is None:
            compiled = self._kernel[grid](*args, **constexprs, **self._options)
            if hasattr(compiled, "result"):  # compiled asynchronously
                compiled = compiled.result()
            if compiled is not None:  # None: a cache hook took the launch
                # `run` loads the kernel's module on its first use.
                self._launches[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = launch
        x, y, z = (*grid, 1, 1)[:3]
        run(x, y, z, self._stream(device), function, metadata, None, None, None, *args, *constants)

    def _key(
        self, device: int, args: tuple[Any, ...], constexprs: dict[str, Any]
    ) -> tuple[tuple, tuple[Any, ...]]:
        """The kept launches' key of these arguments on `device`, and the constexprs' values in
        the kernel's order.

        Raises:
            KeyError: a constexpr is missing.
            _Unkeyed: an argument whose specialisation is not derived here.
        """
        constants = tuple(constexprs[name] for name in self._constexpr_names)
        # Their types too: Triton compiles `True`, `1` and `1.0` into different kernels.
        types = tuple(map(type, constants))
        return (device, constants, types, tuple(map(specialisation, args))), constants
