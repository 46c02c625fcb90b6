"""`TritonLaunch` (`megatron.core.fusions.triton_launch`): the first launch of each
specialisation goes through Triton's `kernel[grid]`, later ones through the compiled kernel's
launcher with the same arguments; anything it cannot key goes through Triton every time.

On CPU a stand-in for Triton's JIT function records which path each launch took; on a GPU the
real FP8 cast kernel shows that the compiled kernel kept for each key is the one Triton itself
picks for those arguments, and that both paths give the reference quantiser's bytes."""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from megatron.core.fusions import triton_launch
from megatron.core.fusions.triton_launch import TritonLaunch, specialisation


def test_integers_are_keyed_by_width_one_and_divisibility_by_16():
    assert specialisation(1) == (32, True, False)
    assert specialisation(16) == (32, False, True)
    assert specialisation(17) == (32, False, False)
    assert specialisation(-(2**31)) == (32, False, True)
    assert specialisation(2**31) == (64, False, True)
    assert specialisation(2**63) == (65, False, True)
    assert specialisation(2**64 - 1) == (65, False, False)
    assert specialisation(True) is bool and specialisation(0.5) is float
    assert specialisation(None) is type(None)


def test_tensors_are_keyed_by_dtype_and_16_byte_alignment():
    whole = torch.zeros(64, dtype=torch.bfloat16)
    assert specialisation(whole) == (torch.bfloat16, True)
    assert specialisation(whole[1:]) == (torch.bfloat16, False)  # 2 bytes past the start
    assert specialisation(whole[8:]) == (torch.bfloat16, True)
    assert specialisation(whole.view(torch.int16)) == (torch.int16, True)


def test_other_arguments_are_not_keyed():
    with pytest.raises(triton_launch._Unkeyed):
        specialisation("text")
    for refused in (2**64, -(2**63) - 1):  # beyond Triton's integers
        with pytest.raises(triton_launch._Unkeyed):
            specialisation(refused)
    with pytest.raises(triton_launch._Unkeyed):
        specialisation(torch.float32)


class _Kernel:
    """Triton's JIT function as `TritonLaunch` uses it: its parameters, its pre-run hooks and
    `kernel[grid](...)`, which returns a compiled kernel whose launcher records its calls."""

    def __init__(self, names: list[str], constexprs: set[str]) -> None:
        self.params = [SimpleNamespace(name=n, is_constexpr=n in constexprs) for n in names]
        self.pre_run_hooks: list = []
        self.through_triton: list[tuple] = []
        self.direct: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.through_triton.append((grid, args, kwargs))
            return SimpleNamespace(run=self._run, function="function", packed_metadata="meta")

        return launch

    def _run(self, *arguments):
        self.direct.append(arguments)


def _triton(
    version: str = "3.6.0", hooks: list | None = None, debug: bool = False, mode: str = ""
) -> SimpleNamespace:
    runtime = SimpleNamespace(
        launch_enter_hook=SimpleNamespace(calls=hooks or []),
        launch_exit_hook=SimpleNamespace(calls=[]),
        debug=debug,
    )
    knobs = SimpleNamespace(runtime=runtime, compilation=SimpleNamespace(instrumentation_mode=mode))
    return SimpleNamespace(__version__=version, knobs=knobs)


@pytest.fixture
def on_a_gpu():
    """A CUDA device 0 whose current stream is 1234, on any machine."""
    with (
        mock.patch.object(torch.cuda, "current_device", return_value=0),
        mock.patch.object(triton_launch, "_current_stream", return_value=lambda device: 1234),
    ):
        yield


def _launcher(kernel: _Kernel, **triton_kwargs) -> TritonLaunch:
    with mock.patch.object(triton_launch, "triton", _triton(**triton_kwargs)):
        return TritonLaunch(kernel, num_warps=8)


@pytest.mark.usefixtures("on_a_gpu")
def test_each_specialisation_compiles_through_triton_then_launches_directly():
    kernel = _Kernel(["x", "n", "scale", "BLOCK", "FLAG"], {"BLOCK", "FLAG"})
    launch = _launcher(kernel)
    x = torch.zeros(64)
    with mock.patch.object(triton_launch, "triton", _triton()):
        launch((4, 2), x, 48, 0.5, BLOCK=64, FLAG=True)
        launch((5,), x, 32, 0.25, BLOCK=64, FLAG=True)  # the same specialisation
        assert kernel.through_triton == [
            ((4, 2), (x, 48, 0.5), {"BLOCK": 64, "FLAG": True, "num_warps": 8})
        ]
        # The grid padded to three, the stream, the kernel, no launch metadata or hooks, then
        # every argument in the kernel's order.
        assert kernel.direct == [(5, 1, 1, 1234, "function", "meta", None, None, None, x, 32,
                                  0.25, 64, True)]  # fmt: skip
        # Each of these is another specialisation: Triton's path once each.
        launch((1,), x[1:], 48, 0.5, BLOCK=64, FLAG=True)  # unaligned
        launch((1,), x, 1, 0.5, BLOCK=64, FLAG=True)  # n == 1
        launch((1,), x, 47, 0.5, BLOCK=64, FLAG=True)  # not a multiple of 16
        launch((1,), x, 2**40, 0.5, BLOCK=64, FLAG=True)  # 64 bits
        launch((1,), x.double(), 48, 0.5, BLOCK=64, FLAG=True)  # another dtype
        launch((1,), x, 48, 0.5, BLOCK=128, FLAG=True)  # another constexpr
        launch((1,), x, 48, 0.5, BLOCK=64, FLAG=1)  # equal to True, of another type
        assert len(kernel.through_triton) == 8 and len(kernel.direct) == 1
        launch((1,), x, 1, 0.5, BLOCK=64, FLAG=True)
        assert len(kernel.through_triton) == 8 and len(kernel.direct) == 2


@pytest.mark.usefixtures("on_a_gpu")
def test_a_launch_a_cache_hook_took_is_not_kept():
    """Triton's `kernel[grid]` returns no compiled kernel where a cache hook took the launch:
    the next launch goes through Triton again."""

    class Hooked(_Kernel):
        def __getitem__(self, grid):
            launch = super().__getitem__(grid)
            return lambda *args, **kwargs: launch(*args, **kwargs) and None

    kernel = Hooked(["x", "BLOCK"], {"BLOCK"})
    launch = _launcher(kernel)
    with mock.patch.object(triton_launch, "triton", _triton()):
        for _ in range(2):
            launch((1,), torch.zeros(4), BLOCK=64)
    assert len(kernel.through_triton) == 2 and not kernel.direct and not launch._launches


@pytest.mark.usefixtures("on_a_gpu")
@pytest.mark.parametrize(
    "case",
    [
        "hooks",
        "debug",
        "instrumentation",
        "release 3.3",
        "release 3.7",
        "rocm",
        "pre-run hook",
        "unkeyed",
        "constexpr first",
        "option per call",
    ],
)
def test_what_cannot_be_vouched_for_always_goes_through_triton(case):
    names = ["BLOCK", "x", "n"] if case == "constexpr first" else ["x", "n", "BLOCK"]
    kernel = _Kernel(names, {"BLOCK"})
    version = {"release 3.3": "3.3.1", "release 3.7": "3.7.0"}.get(case, "3.6.0")
    with mock.patch.object(torch.version, "hip", "6.4" if case == "rocm" else None):
        launch = _launcher(kernel, version=version)
    if case == "pre-run hook":
        kernel.pre_run_hooks.append(print)
    n = "48" if case == "unkeyed" else 48
    args = (n, torch.zeros(4)) if case == "constexpr first" else (torch.zeros(4), n)
    options = {"num_stages": 2} if case == "option per call" else {}
    knobs = _triton(
        hooks=[print] if case == "hooks" else None,
        debug=case == "debug",
        mode="fpsan" if case == "instrumentation" else "",
    )
    with mock.patch.object(triton_launch, "triton", knobs):
        for _ in range(3):
            launch((1,), *args, BLOCK=64, **options)
    assert len(kernel.through_triton) == 3 and not kernel.direct


class _EnvKnob:
    """One of Triton's environment-backed knobs (`triton.knobs.env_bool` / `env_str`): what is
    set on the knobs object, else the environment variable, read at every access."""

    def __init__(self, variable: str, default: str) -> None:
        self.variable, self.default = variable, default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, knobs: object, owner: type) -> str:
        return knobs.__dict__.get(self.name, os.environ.get(self.variable, self.default))

    def __set__(self, knobs: object, value: str) -> None:
        knobs.__dict__[self.name] = value


class _RuntimeKnobs:
    debug = _EnvKnob("TRITON_DEBUG", "")

    def __init__(self) -> None:
        self.launch_enter_hook = SimpleNamespace(calls=[])
        self.launch_exit_hook = SimpleNamespace(calls=[])


class _CompilationKnobs:
    instrumentation_mode = _EnvKnob("TRITON_INSTRUMENTATION_MODE", "")


@pytest.mark.usefixtures("on_a_gpu")
@pytest.mark.parametrize(
    "mode", [None, "TRITON_DEBUG", "TRITON_INSTRUMENTATION_MODE", "debug", "instrumentation_mode"]
)
def test_debug_and_instrumentation_modes_are_read_where_set(mode, monkeypatch):
    """Triton's modes read from the environment or set on its knobs send every launch through
    Triton; with neither, launches are direct."""
    for variable in ("TRITON_DEBUG", "TRITON_INSTRUMENTATION_MODE"):
        monkeypatch.delenv(variable, raising=False)
    runtime, compilation = _RuntimeKnobs(), _CompilationKnobs()
    if mode is not None and mode.startswith("TRITON_"):
        monkeypatch.setenv(mode, "1")
    elif mode == "debug":
        runtime.debug = "1"
    elif mode == "instrumentation_mode":
        compilation.instrumentation_mode = "fpsan"
    knobs = SimpleNamespace(runtime=runtime, compilation=compilation)
    fake = SimpleNamespace(__version__="3.6.0", knobs=knobs)
    kernel = _Kernel(["x", "BLOCK"], {"BLOCK"})
    launch = _launcher(kernel)
    with mock.patch.object(triton_launch, "triton", fake):
        for _ in range(3):
            launch((1,), torch.zeros(4), BLOCK=64)
    assert len(kernel.direct) == (2 if mode is None else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("shape", [(1, 16), (16, 48), (17, 40)], ids=str)
@pytest.mark.parametrize("transpose", [False, True])
def test_the_kept_kernel_is_tritons_own_and_casts_alike(offset, shape, transpose):
    """Through `cast_to_fp8`: the first launch compiles (or finds) Triton's kernel, the second
    takes the kept one; both give the reference quantiser's bytes, and the kept kernel is the
    one Triton's own lookup gives for the same arguments."""
    from megatron.core.fp8 import kernels, quantize

    rows, cols = shape
    storage = torch.randn(rows * cols + offset, device="cuda", dtype=torch.bfloat16)
    x = storage[offset:].view(rows, cols)
    scale, dtype = torch.tensor(3.5, device="cuda"), torch.float8_e4m3fn
    expected = quantize._quantize_reference(x, dtype, scale, None, transpose)
    launch = kernels._launch_cast
    with mock.patch.object(kernels._cast_kernel, "run", wraps=kernels._cast_kernel.run) as run:
        results = [kernels.cast_to_fp8(x, dtype, scale, None, transpose=transpose)]
        through_triton = run.call_count
        results.append(kernels.cast_to_fp8(x, dtype, scale, None, transpose=transpose))
        assert run.call_count == through_triton <= 1  # the second launch is a direct one
        # Triton's own choice for these arguments, found (not launched) by its warm-up path.
        data, scale_inv, transposed = results[1]
        padded = -(-rows // 16) * 16
        args = (x, scale, scale_inv, data, transposed if transpose else scale_inv, scale_inv,
                rows, cols, padded, 448.0)  # fmt: skip
        constexprs = dict(
            SCALE_FROM_AMAX=False,
            RECORD_AMAX=False,
            ROWWISE=True,
            TRANSPOSE=transpose,
            E4M3=True,
            ROUNDING=0,
            BLOCK_ROWS=kernels._BLOCK_ROWS,
            BLOCK_COLS=kernels._BLOCK_COLS,
        )
        grid = (-(-padded // kernels._BLOCK_ROWS), -(-cols // kernels._BLOCK_COLS))
        tritons = kernels._cast_kernel.warmup(
            *args, grid=grid, num_warps=kernels._CAST_WARPS, **constexprs
        )
    key, _ = launch._key(torch.cuda.current_device(), args, constexprs)
    assert launch._launches[key][1] == tritons.function
    for data, scale_inv, transposed in results:
        assert torch.equal(data.view(torch.uint8), expected.data.view(torch.uint8))
        assert torch.equal(scale_inv, expected.scale_inv)
        if transpose:
            assert torch.equal(transposed.view(torch.uint8), expected.transposed.view(torch.uint8))
