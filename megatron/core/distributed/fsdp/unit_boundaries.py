"""Where a Megatron-FSDP unit's backward begins and ends, told by autograd.

A unit's hooks (`fsdp_module.py`) route its inputs that need a gradient through `_PostBackward`,
an identity whose backward runs once the unit's backward has reached them, and hook every output
that needs a gradient with a `PreBackwardHook`, whose first call in a backward starts the unit's
backward. `BackwardEnd` counts the routings of one forward: one for a unit of one module, one per
module that routed any for a unit of several (`GroupForward`), whose inputs made by its earlier
modules are not routed (the backward reaches them before the inputs of the modules that made
them). Where a module runs without autograd or without an input that needs a gradient, no routed
input can tell when its backward is over: the end of the whole backward then reduces the unit, as
it does a unit fed token ids.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_is_leaf, tree_unflatten

from megatron.core.utils import direct_apply


class BackwardPasses(Protocol):
    """What the boundaries tell a unit's context (`FsdpContext` is one)."""

    def pre_backward(self, unit: Any, /) -> None:
        """The unit's backward begins."""

    def post_backward(self, unit: Any, /) -> None:
        """The unit's backward is complete."""


class BoundedUnit(Protocol):
    """What the boundaries need of a unit (`fsdp_module.FsdpUnit` is one). A protocol rather
    than the class, so this module does not import `fsdp_module`, which imports it."""

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The unit's modules."""

    @property
    def context(self) -> BackwardPasses | None:
        """The context of the unit's root (set before any forward)."""


class GroupForward:
    """One forward of a unit of several modules, from the first of them to run until all have.

    Attributes:
        end: counts the inputs routed through `_PostBackward`, which the unit's backward must
            reach before it is complete.
        pending: the ids of the unit's modules that have yet to run.
        produced: the outputs of the unit's modules so far (that need a gradient), held until
            the forward ends.
        hook: announces the unit's backward, registered on every module's outputs.
        with_autograd: whether some module ran with autograd (not an inference forward).
    """

    __slots__ = ("end", "pending", "produced", "hook", "with_autograd")

    def __init__(self, unit: BoundedUnit):
        self.end = BackwardEnd(unit)
        self.pending = {id(module) for module in unit.modules}
        self.produced: list[torch.Tensor] = []
        self.hook = PreBackwardHook(unit)
        self.with_autograd = False

    def produced_inside(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is an output of one of the unit's modules in this forward."""
        return any(tensor is output for output in self.produced)


class PreBackwardHook:
    """A gradient hook on every output of one forward of a unit: the first to fire in a
    backward runs the unit's pre-backward (FSDP2's per-tensor hooks; cheaper than
    `register_multi_grad_hook`). One per forward, so a unit run twice is prepared twice."""

    __slots__ = ("_unit", "_task")

    def __init__(self, unit: BoundedUnit):
        self._unit = weakref.ref(unit)
        self._task: int | None = None

    def __call__(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return
        self._task = task
        unit = self._unit()
        if unit is not None:
            unit.context.pre_backward(unit)


# Leaf types told apart without pytree's per-item type checks (a layer's usual inputs).
_PLAIN_LEAVES = (torch.Tensor, type(None))


def _flatten(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """`tree`'s leaves and the function that rebuilds it from new ones. A tensor or a plain
    tuple/list of leaves (a layer's usual inputs and outputs) skips pytree's cost, paid on
    every unit's forward."""
    if isinstance(tree, torch.Tensor):
        return [tree], lambda leaves: leaves[0]
    if type(tree) in (tuple, list) and all(
        type(item) in _PLAIN_LEAVES or tree_is_leaf(item) for item in tree
    ):
        return list(tree), type(tree)
    flat, spec = tree_flatten(tree)
    return flat, lambda leaves: tree_unflatten(leaves, spec)


def announce_backward(output: Any, hook: PreBackwardHook) -> list[torch.Tensor]:
    """Registers `hook` on every tensor of `output` that needs a gradient; returns them."""
    flat, _ = _flatten(output)
    tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    for tensor in tensors:
        tensor.register_hook(hook)
    return tensors


class BackwardEnd:
    """The end of one forward's backward of a unit: reached once the gradients of every input
    routed through `_PostBackward` in that forward exist (one routing per module that routed
    any: one for a unit of one module). Counted per backward pass (graph task), so each
    backward through the same forward (`retain_graph=True`) reaches it.

    Attributes:
        routed: how many `_PostBackward`s the forward routed inputs through.
        unreachable: a module of the unit ran whose backward's end no routed input tells (run
            without autograd, or with no input that needs a gradient); the end of the whole
            backward then reduces the unit.
    """

    __slots__ = ("_unit", "routed", "unreachable", "_task", "_arrived")

    def __init__(self, unit: BoundedUnit):
        self._unit = weakref.ref(unit)
        self.routed = 0
        self.unreachable = False
        self._task: int | None = None
        self._arrived = 0

    @property
    def reachable(self) -> bool:
        """Whether the unit's backward ends here (else at the end of the whole backward)."""
        return self.routed > 0 and not self.unreachable

    def arrive(self) -> None:
        """One routing's inputs have their gradients; the last runs the unit's post-backward."""
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            self._arrived = 0
        self._arrived += 1
        if self._arrived == self.routed and self.reachable and (unit := self._unit()) is not None:
            unit.context.post_backward(unit)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward has reached
    them (their gradients exist; parameter gradients are accumulated first, as autograd runs
    AccumulateGrad nodes ahead of others). Reducing there, not when each parameter's gradient
    arrives, keeps the order of collectives the same on every rank even where data leaves
    some parameters unused on some ranks."""

    @staticmethod
    def forward(ctx, end: BackwardEnd, *tensors: torch.Tensor):
        ctx.end = end
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.end.arrive()
        return (None, *grads)


_apply_post_backward = direct_apply(_PostBackward)


def route_inputs(
    end: BackwardEnd,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    skip: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[tuple[tuple[Any, ...], dict[str, Any]], bool]:
    """Routes the inputs that need a gradient (but those `skip` names) through one
    `_PostBackward` counted by `end`. Routes nothing where there is none (the root, fed token
    ids): the end-of-backward callback reduces such units.

    Returns:
        The new (args, kwargs), and whether any input needs a gradient (skipped ones too).
    """
    flat, rebuild = _flatten(args) if not kwargs else _flatten((args, kwargs))
    needing = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    positions = needing if skip is None else [i for i in needing if not skip(flat[i])]
    if not positions:
        return (args, kwargs), bool(needing)
    end.routed += 1
    outputs = _apply_post_backward(end, *(flat[i] for i in positions))
    for i, tensor in zip(positions, outputs):
        flat[i] = tensor
    return ((rebuild(flat), kwargs) if not kwargs else rebuild(flat)), True
