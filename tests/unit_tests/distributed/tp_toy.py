"""A tiny tensor-parallel regression model for the engine and checkpoint tests of TP.

Each block has a normalisation-like scale (replicated over tp), a gated MLP whose first
projection is column-parallel with stride 2 (the canonical `[W; V]` split block-wise, as
Megatron's `linear_fc1` with a gated linear unit) and a plain MLP with a stride-1
column-parallel projection; both second projections are row-parallel (split along dim 1, bias
replicated). The tp all-reduces are done by hand (`_CopyToTensorParallel`,
`_ReduceFromTensorParallel`). Every rank draws the whole canonical weights from one seed and
keeps its part, so a model built at any TP size computes the same function with the same
weights, and the single-process reference needs no groups.

`build_toy_tp(tp_group)` is the one model builder the tests take; a real tensor-parallel GPT
builder of the same signature (returning per-sample losses of `(inputs, labels)`) can replace it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed.tensor_parallel_params import local_part
from megatron.core.tensor_parallel.layout import TensorParallelLayout

IN_FEATURES, HIDDEN, FFN, OUT_FEATURES = 6, 16, 8, 3
NUM_BLOCKS = 2
SEED = 1234


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the gradient summed over tp (what each rank's part contributed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.group is not None:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Partial sums all-reduced over tp; the gradient passes through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        if group is not None:
            x = x.clone()
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _draw(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * 0.3


class ColumnParallel(torch.nn.Module):
    """`y_t = x W_t^T + b_t`: this rank's output features (`stride` blocks, each split)."""

    def __init__(self, generator, out_features, in_features, stride, tp):
        super().__init__()
        self.tp, self.layout = tp, TensorParallelLayout(0, stride)
        weight, bias = _draw(generator, out_features, in_features), _draw(generator, out_features)
        self.weight = torch.nn.Parameter(local_part(weight, self.layout, tp).clone())
        self.bias = torch.nn.Parameter(local_part(bias, self.layout, tp).clone())

    def tensor_parallel_layouts(self) -> dict[str, TensorParallelLayout]:
        return {"weight": self.layout, "bias": self.layout}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.tp)
        return torch.nn.functional.linear(x, self.weight, self.bias)


class RowParallel(torch.nn.Module):
    """`y = sum_t x_t W_t^T + b`: input features split over tp, bias replicated."""

    def __init__(self, generator, out_features, in_features, tp):
        super().__init__()
        self.tp, self.layout = tp, TensorParallelLayout(1)
        weight, bias = _draw(generator, out_features, in_features), _draw(generator, out_features)
        self.weight = torch.nn.Parameter(local_part(weight, self.layout, tp).clone())
        self.bias = torch.nn.Parameter(bias)

    def tensor_parallel_layouts(self) -> dict[str, TensorParallelLayout]:
        return {"weight": self.layout}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.linear(x, self.weight)
        return _ReduceFromTensorParallel.apply(partial, self.tp) + self.bias


class ToyTPBlock(torch.nn.Module):
    """x + gated MLP(scale * x) + MLP(x)."""

    def __init__(self, generator: torch.Generator, tp: dist.ProcessGroup | None):
        super().__init__()
        self.scale = torch.nn.Parameter(1.0 + _draw(generator, HIDDEN))
        self.gated_fc1 = ColumnParallel(generator, 2 * FFN, HIDDEN, 2, tp)
        self.gated_fc2 = RowParallel(generator, HIDDEN, FFN, tp)
        self.fc1 = ColumnParallel(generator, FFN, HIDDEN, 1, tp)
        self.fc2 = RowParallel(generator, HIDDEN, FFN, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gated_fc1(x * self.scale).chunk(2, dim=-1)
        gated = self.gated_fc2(torch.nn.functional.silu(gate) * up)
        return x + gated + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


@torch.no_grad()
def _replicated_linear(generator, out_features, in_features) -> torch.nn.Linear:
    linear = torch.nn.Linear(in_features, out_features)
    linear.weight.copy_(_draw(generator, out_features, in_features))
    linear.bias.copy_(_draw(generator, out_features))
    return linear


class ToyTPModel(torch.nn.Module):
    """Input projection (replicated), `NUM_BLOCKS` blocks, output head; per-sample MSE."""

    def __init__(self, tp: dist.ProcessGroup | None):
        super().__init__()
        generator = torch.Generator().manual_seed(SEED)
        self.embed = _replicated_linear(generator, HIDDEN, IN_FEATURES)
        self.layers = torch.nn.ModuleList(ToyTPBlock(generator, tp) for _ in range(NUM_BLOCKS))
        self.head = _replicated_linear(generator, OUT_FEATURES, HIDDEN)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs)
        for layer in self.layers:
            x = layer(x)
        return (self.head(x) - labels).square().mean(dim=-1)


def build_toy_tp(tp: dist.ProcessGroup | None) -> torch.nn.Module:
    """The toy model split over `tp` (None: the whole model on one rank)."""
    return ToyTPModel(tp if tp is not None and tp.size() > 1 else None)


def make_batches(steps: int, samples: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of `samples` (inputs, labels)."""
    generator = torch.Generator().manual_seed(SEED + 1)
    return [
        (
            torch.randn(samples, IN_FEATURES, generator=generator),
            torch.randn(samples, OUT_FEATURES, generator=generator),
        )
        for _ in range(steps)
    ]
