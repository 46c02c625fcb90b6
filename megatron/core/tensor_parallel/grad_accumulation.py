"""Gradient-accumulation fusion: a linear layer's weight gradient added by its GEMM straight into
the `main_grad` a data-parallel engine keeps for the weight (Megatron-LM's gradient-accumulation
fusion, which `--no-gradient-accumulation-fusion` turns off).

Without it, backward computes each weight gradient in the parameters' dtype (bf16) and the engine
then adds it into its fp32 `main_grad`: a rounding to bf16, a gradient-sized allocation, and an
elementwise kernel reading both and writing the sum. With it, the weight-gradient GEMM accumulates
into `main_grad` in its epilogue (`main_grad += dY^T X`, in fp32), and the layer hands autograd no
gradient for the weight.

An engine opts a parameter in with `register_main_grad(param, engine_method)` when the model's
config sets `gradient_accumulation_fusion`: the DDP engine for its `main_grad`s, Megatron-FSDP for
the buffer its sharded gradients are reduce-scattered from, or the whole gradient sums
`accumulate_unsharded_grads` keeps across a step's microbatches. The engine's method says where
the gradient goes (`FusionTarget`): added to a tensor, or written over one whose contents are not
yet a gradient (a buffer allocated for this backward, a `main_grad` whose `.grad` was dropped),
which spares zeroing it first. The parallel linears route through `linear()` and
`weight_grad()`, and the FP8 linears decide with `weight_grad_target()`; they fuse only while:

- the engine is alive: a deleted engine's parameters train as plain parameters again;
- the weight's `.grad` is None when its gradient is computed: a `.grad` kept from an earlier
  backward is accumulated into by autograd, as torch does, so the gradient is not split in two;
- the backward accumulates into the weight: `torch.autograd.grad(..., inputs)` with the weight
  among the inputs gets its gradient returned, one without it (or `backward(inputs=...)` without
  it) gets no weight gradient computed, and `main_grad` is left alone in both.

Autograd still runs the weight's `AccumulateGrad`, with no gradient from the fused layer, and the
parameter's post-accumulate-grad hooks fire as usual: the engine learns there that the gradient is
complete. Other uses of the weight in the same graph (a tied output layer's embedding lookup, a
penalty on the weight) reach `.grad` as usual and the engine adds them, so the sum is whole.
Tensor hooks on the weight (`register_hook`) see only those other contributions (or None). A
fused layer is differentiable once: the gradients a `create_graph=True` backward computes through
it raise if differentiated again.

In a layer compiled with `torch.compile` the decision moves into the backward (`linear`): the
compiled graph returns no weight gradient, and an operator of its backward sends the gradient
where the eager layer would, into `.grad` where nothing fuses. `torch.autograd.grad` asking for
such a weight's gradient raises (the graph cannot return it), and its tensor hooks see None even
where nothing fuses.

On CUDA the fp32 accumulation is one `addmm` with an fp32 output (`beta=0` to overwrite: the
target is not read); elsewhere the product is formed in the inputs' dtype and added or copied
(the unfused arithmetic, in one place). On CUDA the eager fusing layer's autograd node is also
C++ where its extension builds (`native_linear`): the same operators, with Python asked only
where each weight gradient goes; its Python function (`_LinearIntoMainGrad`) runs elsewhere.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

from megatron.core.tensor_parallel.native_linear import native_linear_into_main_grad
from megatron.core.utils import direct_apply, once_differentiable, outside_compiled_graphs

if TYPE_CHECKING:
    from megatron.core.fp8.linear import Fp8LinearSlots


class FusionTarget(NamedTuple):
    """Where a linear layer's weight gradient goes.

    Attributes:
        tensor: of the weight's shape, in fp32 or the weight's dtype, on its device.
        overwrite: the gradient replaces `tensor`'s contents, which are not read (they may be
            uninitialised); else it is added to them.
    """

    tensor: torch.Tensor
    overwrite: bool = False


_targets: dict[int, tuple[weakref.ref, weakref.WeakMethod, weakref.WeakMethod | None]] = {}
"""id(parameter) -> a weak reference to it, and weak references to the engine's methods: the
one that returns its `main_grad`, and the one asked at forward whether the backward may fuse
(None: always). Keyed by id, not by a `WeakIdKeyDictionary`, whose lookups build a Python
reference object each: every linear layer looks its weight up at forward and at backward. The
reference's callback removes the entry as the parameter dies, before its id can be reused."""


def register_main_grad(
    param: torch.nn.Parameter,
    main_grad_of: Callable[[torch.nn.Parameter], FusionTarget | None],
    may_fuse: Callable[[], bool] | None = None,
) -> None:
    """Sends `param`'s weight gradients into `main_grad_of(param)` while its engine lives.

    Where a linear layer (`linear`, `weight_grad`) computes them; the engine is the object
    the methods are bound to.

    Args:
        param: a trainable parameter.
        main_grad_of: a bound method (held weakly), called before each fused gradient; it
            returns where the gradient goes, or None where it has no place for it now
            (autograd gets the gradient).
        may_fuse: a bound method (held weakly) asked at each forward (in a layer compiled
            with `compile_layers`, at the backward); False where the backward cannot fuse, so
            that the layer runs plain `F.linear` and skips the host cost of the fusing autograd
            function. None: it always may.
    """
    key = id(param)

    def forget(ref: weakref.ref) -> None:
        entry = _targets.get(key)
        if entry is not None and entry[0] is ref:  # not a later registration's
            del _targets[key]

    ask = None if may_fuse is None else weakref.WeakMethod(may_fuse)
    _targets[key] = (weakref.ref(param, forget), weakref.WeakMethod(main_grad_of), ask)


def _target(
    weight: torch.Tensor,
) -> Callable[[torch.nn.Parameter], FusionTarget | None] | None:
    entry = _targets.get(id(weight))
    return None if entry is None else entry[1]()


def _may_fuse(weight: torch.Tensor) -> bool:
    entry = _targets.get(id(weight))
    if entry is None or entry[1]() is None:
        return False
    may_fuse = None if entry[2] is None else entry[2]()
    return may_fuse is None or may_fuse()


def linear(
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fp8: Fp8LinearSlots | None = None,
    *,
    fusion: bool = True,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(input_, weight, bias)`, its weight gradient fused into the weight's registered
    `main_grad` (module docstring) where there is one; its three GEMMs in FP8 where the layer
    has `fp8` settings (`megatron.core.fp8.linear`, which fuses the same way). Plus `residual`
    where given (a layer's residual connection): added in the GEMM by the C++ nodes, where it
    costs no kernel of its own, else `residual + output` after it.

    Under `torch.compile` a linear whose weight gradient may fuse is traced into the compiled
    graph with a backward operator of its own (`megatron::linear_into_main_grad_backward`),
    which decides at run time where the weight gradient goes, as the eager layer does; one that
    may not (`fusion` False) is traced as `F.linear`. `F.linear` itself runs under
    `torch.autocast` (which casts its operands) and `torch.func` transforms.

    Args:
        input_: [..., in].
        weight: [out, in].
        bias: [out], or None.
        fp8: the layer's FP8 settings; None: high precision.
        fusion: whether the weight gradient may fuse (the model config's
            `gradient_accumulation_fusion`); False: never, even where a `main_grad` is
            registered.
        residual: [..., out], or None.

    Returns:
        [..., out].
    """
    if fp8 is not None:
        # Outside any compiled graph: the FP8 weight cache and the scaling state are host state.
        if torch.compiler.is_compiling():
            return _plus(residual, _linear_outside_graph(input_, weight, bias, fp8))
        if residual is None:  # the settings' three-argument call (what an override may take)
            return fp8.linear(input_, weight, bias)
        return fp8.linear(input_, weight, bias, residual)
    if not (fusion and weight.requires_grad and torch.is_grad_enabled()):
        return _plus(residual, F.linear(input_, weight, bias))
    if torch.compiler.is_compiling():
        return _plus(residual, _traced_linear(input_, weight, bias))
    if (
        _may_fuse(weight)
        and not torch.is_autocast_enabled(input_.device.type)
        and not torch._C._are_functorch_transforms_active()
    ):
        native = native_linear_into_main_grad(input_)
        if native is not None:
            return native.linear_into_main_grad(input_, weight, bias, residual)
        return _plus(residual, _apply_into_main_grad(input_, weight, bias))
    return _plus(residual, F.linear(input_, weight, bias))


def _plus(residual: torch.Tensor | None, output: torch.Tensor) -> torch.Tensor:
    """`residual + output` (the order a layer's residual connection adds in), or `output`."""
    return output if residual is None else residual + output


def _traced_linear(
    input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`linear` as `torch.compile` traces it, where the weight gradient may fuse.

    Whether it fuses depends on state a compiled graph cannot guard (the engine's registry,
    `.grad`, the backward's inputs), so the backward's operator decides when it runs
    (`_linear_into_main_grad_backward`). It hands autograd no weight gradient either way, so it
    is used only where none is ever needed through the graph: a parameter's (a tensor computed
    from one is never registered). A linear whose input needs no gradient runs outside the
    graph, as eager code: the graph's backward would return nothing from it.
    """
    if not weight.is_leaf or torch.is_autocast_enabled(input_.device.type):
        return F.linear(input_, weight, bias)  # never fuses
    if not input_.requires_grad:
        return _linear_outside_graph(input_, weight, bias)
    return _TracedLinearIntoMainGrad.apply(input_, weight, bias)


# The same function, run by Python (a graph break).
_linear_outside_graph = outside_compiled_graphs(linear)


def weight_grad(
    grad_output: torch.Tensor,
    input_: torch.Tensor,
    weight: torch.Tensor,
    weight_node: torch.autograd.graph.Node,
) -> torch.Tensor | None:
    """The gradient of `weight` in `input_ @ weight.T = output`, or None where it went into the
    weight's registered `main_grad` instead, or where this backward does not want it.

    Returning None where it was fused is safe for the engine: autograd still runs the weight's
    `AccumulateGrad` (and its post-accumulate hook, which may launch a reduction of
    `main_grad`) after this node, on this device's stream (torch >= 2.6 queues a node by its
    device even when every gradient it receives is None).

    Args:
        grad_output: [..., out].
        input_: [..., in], the same leading shape.
        weight: [out, in], the parameter itself (not a tensor a checkpoint saved for it).
        weight_node: the autograd node the weight's gradient flows to (the backward's
            `ctx.next_functions[i][0]`): see `weight_grad_target`.

    Returns:
        [out, in] in the inputs' dtype, or None.
    """
    wanted, target = weight_grad_target(weight, weight_node)
    if not wanted:
        return None
    return weight_grad_into(target, grad_output, input_)


def weight_grad_target(
    weight: torch.Tensor, weight_node: torch.autograd.graph.Node
) -> tuple[bool, FusionTarget | None]:
    """Where this backward's gradient of `weight` goes: whether the backward wants it at all,
    and the target it is fused into (None: it is returned to autograd). Asks the engine for
    the target, so call it once per gradient; every linear layer's backward decides here,
    whatever precision its GEMM runs in.

    Fusion only where the engine will run the weight's node, i.e. where this backward
    accumulates into the weight (`.backward()`): `torch.autograd.grad` asking for the weight
    gets its gradient returned, as torch does, and a backward whose inputs leave the weight out
    wants none.

    Args:
        weight: [out, in], the parameter itself.
        weight_node: the autograd node the weight's gradient flows to.
    """
    main_grad_of = _fusing_main_grad_of(weight)
    if main_grad_of is None:
        return True, None
    return _target_given(main_grad_of, weight, _accumulates(weight_node))


def native_target(
    weight: torch.Tensor, accumulates: bool | None
) -> tuple[bool, FusionTarget | None]:
    """`weight_grad_target` for the C++ fusing linear (`native_linear`), whose backward finds
    whether it accumulates into the weight itself (`_accumulates`'s answer)."""
    main_grad_of = _fusing_main_grad_of(weight)
    if main_grad_of is None:
        return True, None
    return _target_given(main_grad_of, weight, accumulates)


def _target_given(
    main_grad_of: Callable[[torch.nn.Parameter], FusionTarget | None],
    weight: torch.Tensor,
    accumulates: bool | None,
) -> tuple[bool, FusionTarget | None]:
    if accumulates is False:  # e.g. `backward(inputs=...)` without the weight
        return False, None
    return True, main_grad_of(weight) if accumulates else None


def _fusing_main_grad_of(
    weight: torch.Tensor,
) -> Callable[[torch.nn.Parameter], FusionTarget | None] | None:
    """The engine's method that says where `weight`'s gradient fuses, where it may now: an
    engine registered it, and no `.grad` is kept (autograd accumulates into that)."""
    main_grad_of = _target(weight)
    return None if main_grad_of is None or weight.grad is not None else main_grad_of


def _accumulates(weight_node: torch.autograd.graph.Node) -> bool | None:
    """Whether the running backward accumulates into the weight whose node this is: True, False
    (a backward whose inputs leave it out), or None where `torch.autograd.grad` captures it
    (its gradient is returned, never accumulated)."""
    # `needs_input_grad` was fixed at forward time; whether this backward reaches the weight
    # is the engine's to say. It raises for a leaf that `torch.autograd.grad` captures.
    try:
        return torch._C._will_engine_execute_node(weight_node)
    except RuntimeError:
        return None


def weight_grad_into(
    target: FusionTarget | None, grad_output: torch.Tensor, input_: torch.Tensor
) -> torch.Tensor | None:
    """`grad_output^T @ input_` (flattened) fused into `target`, or returned where it is None
    (in the inputs' dtype)."""
    if target is not None:
        _fuse(target, grad_output, input_)
        return None
    return _flat(grad_output).t().matmul(_flat(input_))


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    # A 2-D tensor as it is: the backward flattens the output gradient once and hands it on to
    # `weight_grad` and `_fuse`, whose calls here then cost no reshape (a dispatched op, host
    # time per linear).
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, tensor.shape[-1])


def _fuse(target: FusionTarget, grad_output: torch.Tensor, input_: torch.Tensor) -> None:
    """`target.tensor (+)= grad_output^T @ input_` (flattened), in the target's dtype."""
    main_grad, beta = target.tensor, 0 if target.overwrite else 1
    grad_2d, input_2d = _flat(grad_output), _flat(input_)
    if main_grad.dtype == grad_2d.dtype:
        main_grad.addmm_(grad_2d.t(), input_2d, beta=beta)
    elif main_grad.is_cuda:
        torch.addmm(
            main_grad, grad_2d.t(), input_2d, beta=beta, out_dtype=main_grad.dtype, out=main_grad
        )
    elif target.overwrite:
        main_grad.copy_(grad_2d.t().matmul(input_2d))
    else:
        main_grad.add_(grad_2d.t().matmul(input_2d))


class _LinearIntoMainGrad(torch.autograd.Function):
    """`F.linear` whose backward computes the weight gradient with `weight_grad`."""

    @staticmethod
    def forward(
        ctx, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(input_, weight)
        # The parameter itself: a checkpoint's recomputation saves another tensor object.
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return F.linear(input_, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        input_, weight = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad
        grad_2d = _flat(grad_output)
        grad_input = grad_output.matmul(weight) if needs_input else None
        grad_weight = None
        if needs_weight:
            grad_weight = weight_grad(grad_2d, input_, ctx.weight, ctx.next_functions[1][0])
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias and needs_bias else None
        return grad_input, grad_weight, grad_bias


_apply_into_main_grad = direct_apply(_LinearIntoMainGrad)


class _TracedLinearIntoMainGrad(torch.autograd.Function):
    """`F.linear` whose backward is `megatron::linear_into_main_grad_backward`: the fusing
    linear as `torch.compile` traces it (`_traced_linear`). The forward is traced as `F.linear`;
    the backward's operator is opaque to the compiler, so that the weight gradient's destination
    is decided when it runs. It returns no weight gradient to autograd."""

    @staticmethod
    def forward(
        ctx, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(input_, weight)
        ctx.has_bias = bias is not None
        return F.linear(input_, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input_, weight = ctx.saved_tensors
        grad_input = torch.ops.megatron.linear_into_main_grad_backward(grad_output, input_, weight)
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = _flat(grad_output).sum(dim=0)
        return grad_input, None, grad_bias


def _linear_into_main_grad_backward(
    grad_output: torch.Tensor, input_: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """The input gradient of `_TracedLinearIntoMainGrad`; its weight gradient goes where
    `weight_grad_target` says, and where that is autograd (the compiled graph returns no weight
    gradient), into `weight.grad`, as autograd's accumulation would put it; the weight's tensor
    hooks (`register_hook`) see None from the graph, as they do where the gradient fuses. The
    engine's `may_fuse`, asked at forward in eager code, is asked here (its answer for the
    unit's latest forward).

    Raises:
        RuntimeError: `torch.autograd.grad` asks for the weight's gradient, which this
            operator cannot return.
    """
    grad_2d = _flat(grad_output)
    grad_input = grad_output.matmul(weight)
    weight_node = _accumulate_grad_node(weight)
    if weight_node is None:
        if _inductor_sample_run():  # sample tensors, not the layer's weight
            return grad_input
        raise RuntimeError(
            "megatron::linear_into_main_grad_backward ran outside the backward of the linear "
            "layer that uses the weight; it is called only by that layer's backward."
        )
    weight = weight_node.variable  # the parameter, where a checkpoint saved another tensor
    accumulates = _accumulates(weight_node)
    if accumulates is None:
        raise RuntimeError(
            f"torch.autograd.grad asked for the gradient of a weight of shape "
            f"{tuple(weight.shape)} whose linear layer runs in a layer compiled with "
            "compile_layers and gradient_accumulation_fusion, which accumulates that gradient "
            "and cannot return it: call backward() instead, or turn gradient-accumulation "
            "fusion off (--no-gradient-accumulation-fusion)."
        )
    if accumulates:
        main_grad_of = _fusing_main_grad_of(weight) if _may_fuse(weight) else None
        target = None if main_grad_of is None else main_grad_of(weight)
        grad_weight = weight_grad_into(target, grad_2d, input_)
        if grad_weight is not None:  # not fused: where autograd's accumulation puts it
            if weight.grad is None:
                weight.grad = grad_weight
            else:
                weight.grad.add_(grad_weight)
    return grad_input


def _inductor_sample_run() -> bool:
    """Whether inductor is running a graph it compiles, in its Python form on sample tensors,
    to learn what its C++ wrapper must launch (its two-pass route, which the layers' settings
    avoid but a user's inductor config may take): no weight gradient is to be sent from there.

    Returns:
        True while inductor's graph is set, which it is only while it compiles one, and only on
        the compiling thread. Looked up in `sys.modules`, as importing inductor costs seconds
        and a process that has not imported it compiles nothing.
    """
    virtualized = sys.modules.get("torch._inductor.virtualized")
    return virtualized is not None and not isinstance(virtualized.V.graph, virtualized.NullHandler)


_AccumulateGrad = torch._C._functions.AccumulateGrad

_accumulators_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A running compiled graph's backward node -> the accumulate-grad nodes among its inputs, for
the next fusing linear of the same graph (a layer's linears share one node; listing its inputs
builds a Python object per input). An entry lives as long as its graph."""


def _weight_accumulators(node: torch.autograd.graph.Node) -> list[torch.autograd.graph.Node]:
    accumulators = _accumulators_of.get(node)
    if accumulators is None:
        accumulators = _accumulators_of[node] = [
            next_node for next_node, _ in node.next_functions if type(next_node) is _AccumulateGrad
        ]
    return accumulators


def _accumulate_grad_node(weight: torch.Tensor) -> torch.autograd.graph.Node | None:
    """The node that accumulates into the parameter `weight` is (or, where a checkpoint's
    recomputation saved it, aliases whole), among the inputs of the running backward node (the
    compiled graph's); None outside such a backward. Found from there: an operator runs below
    autograd, where a view of `weight` has no node to lead to it."""
    running = torch._C._current_autograd_node()
    accumulators = [] if running is None else _weight_accumulators(running)
    for node in accumulators:
        if node.variable is weight:
            return node
    for node in accumulators:
        if node.variable.is_set_to(weight):
            return node
    return None


# A plain operator (not `torch.library.custom_op`, whose Python wrappers cost the host more
# than the GEMM launches it makes, at every call), for every backend. A fragment: other
# libraries may define operators in the same namespace.
_library = torch.library.Library("megatron", "FRAGMENT")
_library.define(
    "linear_into_main_grad_backward(Tensor grad_output, Tensor input, Tensor weight) -> Tensor"
)
_library.impl(
    "linear_into_main_grad_backward", _linear_into_main_grad_backward, "CompositeExplicitAutograd"
)


# Ordered, as an operator with side effects: its only output is the input gradient, so a compiler
# that saw a pure function would drop it where that gradient is unused (an input reached through
# an operator whose derivative is zero) and merge two calls with the same arguments (a weight
# applied twice to one input), losing weight gradients.
_register_effectful_op(
    torch.ops.megatron.linear_into_main_grad_backward.default, _EffectType.ORDERED
)


@torch.library.register_fake("megatron::linear_into_main_grad_backward", lib=_library)
def _(grad_output: torch.Tensor, input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad_output.new_empty((*grad_output.shape[:-1], weight.shape[1]))
