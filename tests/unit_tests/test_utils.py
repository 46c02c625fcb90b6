"""The autograd and compiler helpers of `megatron.core.utils`: a function applied through
`direct_apply` and differentiated through `once_differentiable` behaves as torch's own `apply` and
decorator; `outside_compiled_graphs` runs its function outside compiled graphs, and importing
Megatron does not import `torch._dynamo`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.utils import direct_apply, once_differentiable, outside_compiled_graphs

REPO = Path(__file__).resolve().parents[2]


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.scale = scale
        return scale * x**3

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        return grad * 3 * ctx.scale * x**2, None


_cube = direct_apply(_Cube)


def _input() -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, 7, dtype=torch.float64, requires_grad=True)


def test_direct_apply_equals_apply():
    for apply in (_Cube.apply, _cube):
        x = _input()
        y = apply(x, 0.5)
        assert type(y.grad_fn).__name__ == "_CubeBackward"
        y.sum().backward()
        torch.testing.assert_close(y, 0.5 * x.detach() ** 3)
        torch.testing.assert_close(x.grad, 1.5 * x.detach() ** 2)


def test_direct_apply_defers_to_apply_under_functorch_transforms():
    """`torch.func` needs `setup_context`; the error is `apply`'s, not a silent C-level run."""
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: _cube(x, 0.5).sum())(_input())


def test_direct_apply_traces_under_torch_compile():
    """Dynamo traces `apply` (torch 2.11 cannot trace the C function): one graph, no break."""
    x = _input()
    y = torch.compile(lambda x: _cube(x, 0.5), backend="eager", fullgraph=True)(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, 1.5 * x.detach() ** 2)


def test_direct_apply_refuses_functions_with_setup_context():
    class WithContext(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

    with pytest.raises(TypeError, match="setup_context"):
        direct_apply(WithContext)


def test_once_differentiable_under_create_graph():
    """First derivatives with `create_graph=True` are torch's; differentiating again raises,
    as torch's decorator makes it (the undecorated backward would differentiate the power).
    The cube's incoming gradient is `x`, which requires grad: only then does torch's decorator
    mark the outputs."""
    x = _input()
    (grad,) = torch.autograd.grad((_cube(x, 0.5) * x).sum(), x, create_graph=True)
    torch.testing.assert_close(grad, 2 * x.detach() ** 3)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()


def test_outside_compiled_graphs_runs_its_function_eagerly_in_a_compiled_caller():
    ran_compiled = []

    @outside_compiled_graphs
    def record(x: torch.Tensor) -> torch.Tensor:
        ran_compiled.append(torch.compiler.is_compiling())
        return x * 2

    compiled = torch.compile(lambda x: record(x + 1) - 1, backend="eager")
    for _ in range(2):  # the disabled function is made at the first call, then reused
        torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert ran_compiled == [False, False]


def test_importing_megatron_imports_no_dynamo_and_asks_cuda_nothing():
    """Importing `torch._dynamo` costs about a second of every process's start (tools, error
    exits, spawned ranks). A process that has asked CUDA for its devices cannot use CUDA in a
    child it forks, so the import leaves that to the first use: counted as calls of
    `torch.cuda.is_available` and `device_count`, wrapped before Megatron is imported."""
    code = (
        "import sys, torch, torch.cuda\n"
        "asked = []\n"
        "for name in ('is_available', 'device_count'):\n"
        "    real = getattr(torch.cuda, name)\n"
        "    setattr(torch.cuda, name, lambda real=real, name=name: asked.append(name) or real())\n"
        "import pretrain_gpt, megatron.core.models.gpt, megatron.training\n"
        "print('torch._dynamo' in sys.modules, asked)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False []"
