"""FP8 linear layers: the three GEMMs of `y = x W^T + b` in FP8.

With X `[M, K]` the input (flattened), W `[N, K]` the weight and dY `[M, N]` the output gradient,
and Hopper's FP8 GEMM taking a row-major first and a column-major second operand (`gemm.py`):

| GEMM  | computes     | first operand (row-major) | second operand (column-major)        |
|-------|--------------|---------------------------|--------------------------------------|
| fprop | `Y = X W^T`  | X                         | `W.t()` (W row-major: a free view)   |
| dgrad | `dX = dY W`  | dY                        | `Wt.t()`, Wt = W^T contiguous        |
| wgrad | `dW = dY^T X`| dYt = dY^T contiguous     | `Xt.t()`, Xt = X^T contiguous        |

X and W are E4M3; dY is E5M2 under the `hybrid` format, E4M3 under `e4m3`. The wgrad GEMM
contracts over the tokens, so dYt and Xt are padded with zero columns to a multiple of 16 tokens
(128 under the blockwise recipe, whose dYt and Xt are quantised again in 1x128 blocks along the
tokens, and whose W and Wt have the same 128x128 blocks: `blockwise.py`).
Forward saves the FP8 Xt for backward (1 byte per element) rather than the input. Only the
forward GEMM uses fast accumulation (upstream's choice). The bias gradient is the sum of the
high-precision output gradient; `fp8_wgrad=False` (`--no-fp8-wgrad`) computes wgrad from the
high-precision input and output gradient instead.

The weight gradient goes where `grad_accumulation.weight_grad_target` says, as for the
high-precision linears: fused into an engine's `main_grad` (the GEMM writes over an `overwrite`
target, and adds a temporary to an accumulating one), returned to autograd, or not computed.

A layer runs in FP8 when it has an `Fp8LinearSlots` (its `fp8` attribute), which
`transformer_block.enable_fp8_linears` gives the linear layers of the transformer layers that
train in FP8 (and of the multi-token prediction depths).

On a GPU a layer of a per-tensor recipe runs as one C++ autograd node (`cpp_linear.py`), whose
results the tests find the same bit for bit; its backward asks Python once
(`native_backward_inputs`), and computes only the gradients the running backward needs (a
`torch.autograd.grad` of the bias alone casts no output gradient, so records no amax), where
the Python functions compute those their inputs require. The Python function `_Fp8Linear` runs
off CUDA and under the blockwise recipe; the column-parallel layers under tensor parallelism run
`_Fp8ColumnParallelLinear`.
"""

from __future__ import annotations

import enum
from types import ModuleType

import torch
import torch.distributed as dist

from megatron.core.fp8.blockwise import ROW_BLOCK, quantize_1x128, quantize_1x128_transposed
from megatron.core.fp8.cpp_linear import native_linear
from megatron.core.fp8.experts import Fp8ExpertSlots
from megatron.core.fp8.gemm import fp8_mm
from megatron.core.fp8.quantize import GEMM_ALIGNMENT, amax_of, compute_scale, quantize
from megatron.core.fp8.recipe import Fp8Recipe, fp8_max
from megatron.core.fp8.scaling import BACKWARD, FORWARD, DelayedScalingState
from megatron.core.fp8.tensor import BlockFp8Tensor, Fp8Tensor
from megatron.core.fp8.weights import fp8_weight_of
from megatron.core.tensor_parallel.grad_accumulation import (
    FusionTarget,
    native_target,
    weight_grad_into,
    weight_grad_target,
)
from megatron.core.tensor_parallel.mappings import gather_first_async, reduce_scatter_first_async
from megatron.core.utils import direct_apply, once_differentiable

_GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Fp8LinearSlots:
    """A linear layer's FP8 settings: the recipe, and under delayed scaling the model's state and
    the layer's slots in it (one for its input, one for its output gradient).

    Args:
        recipe: the model's FP8 recipe.
        state: the model's delayed-scaling state (delayed recipes), else None.
    """

    def __init__(self, recipe: Fp8Recipe, state: DelayedScalingState | None = None) -> None:
        if recipe.delayed != (state is not None):
            raise ValueError("Fp8LinearSlots: a delayed recipe needs a DelayedScalingState.")
        self.recipe = recipe
        self.state = state
        self.input_slot = state.new_slot(FORWARD) if state is not None else None
        self.grad_slot = state.new_slot(BACKWARD) if state is not None else None

    def input_scale(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scale a cast of the input `x` uses now (a tensor of its own) and where its amax
        is recorded (None: nowhere)."""
        scale, record = self.cast_scale(FORWARD, x.device)
        if scale is None:
            return compute_scale(amax_of(x), fp8_max(self.recipe.forward_dtype)), None
        return scale.clone(), record

    def quantize_input(self, x: torch.Tensor, transpose: bool) -> Fp8Tensor | BlockFp8Tensor:
        """The 2-D input `x` in FP8 (and its padded transpose when `transpose`)."""
        return self._quantize(x, FORWARD, self.recipe.forward_dtype, transpose)

    def quantize_grad(self, grad: torch.Tensor, transpose: bool) -> Fp8Tensor | BlockFp8Tensor:
        """The 2-D output gradient `grad` in FP8 (and its padded transpose when `transpose`)."""
        return self._quantize(grad, BACKWARD, self.recipe.backward_dtype, transpose)

    def quantize_gathered_input(
        self, x: torch.Tensor
    ) -> tuple[Fp8Tensor | BlockFp8Tensor, torch.Tensor | None]:
        """The 2-D input `x` a sequence-parallel layer gathered, in FP8 without its transpose,
        and what `transposed_input` casts that transpose with again in backward: the scale
        (None under the blockwise recipe, whose scales come from the values again)."""
        if self.recipe.blockwise:
            return quantize_1x128(x, self.recipe.forward_dtype), None
        scale, record = self.input_scale(x)
        return quantize(x, self.recipe.forward_dtype, scale=scale, amax_out=record), scale

    def transposed_input(
        self, x: torch.Tensor, scale: torch.Tensor | None
    ) -> Fp8Tensor | BlockFp8Tensor:
        """The weight-gradient operand of the gathered input `x`, bit for bit the one forward
        would have made (`quantize_gathered_input`)."""
        dtype = self.recipe.forward_dtype
        if self.recipe.blockwise:
            return quantize_1x128_transposed(x, dtype)
        return quantize(x, dtype, scale=scale, transpose=True).transposed_operand()

    def saved_input_t(
        self, data: torch.Tensor, scale_inv: torch.Tensor
    ) -> Fp8Tensor | BlockFp8Tensor:
        """The transposed input's operand from the tensors forward saved for backward."""
        if self.recipe.blockwise:
            return BlockFp8Tensor(data, scale_inv, ROW_BLOCK)
        return Fp8Tensor(data, scale_inv)

    def cast_scale(
        self, direction: str, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What a per-tensor cast of the input (`FORWARD`) or the output gradient (`BACKWARD`)
        on `device` uses now: the delayed-scaling scale and where the cast's amax is recorded
        (None: not recorded), or (None, None) under current scaling (the cast scales by the
        tensor's own amax)."""
        if self.state is None:
            return None, None
        slot = self.input_slot if direction == FORWARD else self.grad_slot
        return self.state.cast_tensors(direction, slot, device)

    def native_linear(self, x: torch.Tensor) -> ModuleType | None:
        """The C++ extension where it runs this layer on the input `x`: per-tensor recipes on
        CUDA (`cpp_linear.native_linear`); else None."""
        return None if self.recipe.blockwise else native_linear(x)

    def _quantize(
        self, x: torch.Tensor, direction: str, dtype: torch.dtype, transpose: bool
    ) -> Fp8Tensor | BlockFp8Tensor:
        if self.recipe.blockwise:
            return quantize_1x128(x, dtype, transpose=transpose)
        scale, record = self.cast_scale(direction, x.device)
        return quantize(x, dtype, scale=scale, amax_out=record, transpose=transpose)

    def linear(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`F.linear(input_, weight, bias)` with its GEMMs in FP8 (module docstring), plus
        `residual` where given (in the forward GEMM where the C++ node runs it)."""
        native = self.native_linear(input_)
        if native is not None:
            return _native_linear(native, input_, weight, bias, residual, self)
        out = _apply_linear(input_, weight, bias, self, _weight_needs_grad(weight))
        return out if residual is None else residual + out

    def column_parallel_linear(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        sequence_parallel: bool,
    ) -> torch.Tensor:
        """`overlapped_linear.column_parallel_linear` (tp > 1) with its GEMMs in FP8."""
        return _apply_column_parallel(
            input_, weight, bias, group, sequence_parallel, self, _weight_needs_grad(weight)
        )


def computes_in_fp8(module: torch.nn.Module, name: str) -> bool:
    """Whether `module`'s parameter `name` is the weight of a linear layer (or the stacked
    weights of MoE experts, `megatron.core.fp8.experts`) that runs its GEMMs in FP8 (an engine
    may then keep it as FP8 bytes: `fp8_param_gather`)."""
    slots = getattr(module, "fp8", None)
    return name == "weight" and isinstance(slots, (Fp8LinearSlots, Fp8ExpertSlots))


def _weight_needs_grad(weight: torch.Tensor) -> bool:
    """Whether a backward can ask for `weight`'s gradient: read before the autograd function,
    whose `needs_input_grad` says True under `torch.no_grad()` too (an evaluation forward would
    make and keep the transposed input for nothing)."""
    return torch.is_grad_enabled() and weight.requires_grad


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, tensor.shape[-1])


def _fprop(
    x: Fp8Tensor | BlockFp8Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    recipe: Fp8Recipe,
) -> torch.Tensor:
    """`X W^T + b`, the bias in the GEMM where cuBLASLt takes it (bf16 / fp16 output), else
    added after (exactly: the GEMM adds it in fp32 before rounding to fp32 alike)."""
    w = fp8_weight_of(weight, recipe.blockwise)
    fused_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
    out = fp8_mm(
        x,
        w.fprop_operand(),
        out_dtype=out_dtype,
        fast_accum=recipe.fprop_fast_accum,
        bias=bias if fused_bias else None,
    )
    if bias is not None and not fused_bias:
        out = out + bias
    return out


def _dgrad(
    grad: Fp8Tensor | BlockFp8Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype,
    recipe: Fp8Recipe,
) -> torch.Tensor:
    """`dY W`, flattened."""
    w = fp8_weight_of(weight, recipe.blockwise)
    return fp8_mm(grad, w.dgrad_operand(), out_dtype=out_dtype)


class _WgradMode(enum.Enum):
    """Where a weight gradient GEMM writes."""

    RETURN = enum.auto()  # a new tensor, returned to autograd
    OVERWRITE = enum.auto()  # the GEMM writes the (contiguous) main_grad
    COPY = enum.auto()  # copied over a main_grad the GEMM cannot write (not contiguous)
    ACCUMULATE = enum.auto()  # added to main_grad


def _wgrad_destination(target: FusionTarget | None) -> tuple[_WgradMode, torch.Tensor | None]:
    """How the FP8 weight gradient reaches `target` (None: returned), and the tensor it goes
    into.

    Raises:
        ValueError: a main_grad of a dtype the FP8 GEMM does not write.
    """
    if target is None:
        return _WgradMode.RETURN, None
    main_grad = target.tensor
    if main_grad.dtype not in _GEMM_OUT_DTYPES:
        raise ValueError(
            f"FP8 weight gradients go into bf16, fp16 or fp32 main_grads, got {main_grad.dtype}."
        )
    if not target.overwrite:
        return _WgradMode.ACCUMULATE, main_grad
    if main_grad.is_contiguous():
        return _WgradMode.OVERWRITE, main_grad
    return _WgradMode.COPY, main_grad


def _fp8_wgrad(
    grad: Fp8Tensor | BlockFp8Tensor,
    input_t: Fp8Tensor | BlockFp8Tensor,
    target: FusionTarget | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """`dY^T X` from dY's and X's padded transposes, into `target` (None: returned in
    `dtype`)."""
    mode, main_grad = _wgrad_destination(target)
    a, b = grad.transposed_operand(), input_t.t()
    if mode is _WgradMode.RETURN:
        return fp8_mm(a, b, out_dtype=dtype)
    if mode is _WgradMode.OVERWRITE:
        fp8_mm(a, b, out_dtype=main_grad.dtype, out=main_grad)
    elif mode is _WgradMode.COPY:
        main_grad.copy_(fp8_mm(a, b, out_dtype=main_grad.dtype))
    else:
        main_grad.add_(fp8_mm(a, b, out_dtype=main_grad.dtype))
    return None


class _Fp8Linear(torch.autograd.Function):
    """`F.linear` with its three GEMMs in FP8 (module docstring)."""

    @staticmethod
    def forward(
        ctx,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slots: Fp8LinearSlots,
        weight_needs_grad: bool,
    ) -> torch.Tensor:
        recipe = slots.recipe
        fp8_wgrad = weight_needs_grad and recipe.wgrad
        x = slots.quantize_input(_flat(input_), transpose=fp8_wgrad)
        out = _fprop(x, weight, bias, input_.dtype, recipe)
        if fp8_wgrad:
            input_t = x.transposed_operand()
            ctx.save_for_backward(input_t.data, input_t.scale_inv, weight)
        else:
            ctx.save_for_backward(input_ if weight_needs_grad else None, None, weight)
        # The parameter itself, for the FP8 weight cache and fusion (a checkpoint's
        # recomputation saves another tensor object).
        ctx.weight = weight
        ctx.slots, ctx.fp8_wgrad, ctx.has_bias = slots, fp8_wgrad, bias is not None
        ctx.input_shape, ctx.input_dtype = input_.shape, input_.dtype
        return out.view(*input_.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        saved_input, input_scale_inv, _ = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        wanted, target = False, None
        if needs_weight:
            wanted, target = weight_grad_target(ctx.weight, ctx.next_functions[1][0])
        fp8_wgrad = wanted and ctx.fp8_wgrad
        slots = ctx.slots
        grad_2d = _flat(grad_output)
        grad_input = grad_weight = grad_bias = None
        if needs_input or fp8_wgrad:
            grad = slots.quantize_grad(grad_2d, transpose=fp8_wgrad)
        if needs_input:
            grad_input = _dgrad(grad, ctx.weight, ctx.input_dtype, slots.recipe)
            grad_input = grad_input.view(ctx.input_shape)
        if fp8_wgrad:
            input_t = slots.saved_input_t(saved_input, input_scale_inv)
            grad_weight = _fp8_wgrad(grad, input_t, target, ctx.weight.dtype)
        if ctx.has_bias and needs_bias:
            grad_bias = grad_2d.sum(dim=0)
        if wanted and not fp8_wgrad:
            grad_weight = weight_grad_into(target, grad_2d, saved_input)
        return grad_input, grad_weight, grad_bias, None, None


def _native_linear(
    native: ModuleType,
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    slots: Fp8LinearSlots,
) -> torch.Tensor:
    """`_Fp8Linear`, plus `residual` where given, as one C++ autograd node (`cpp_linear.py`):
    the forward's scales and FP8 weight are looked up here, what the backward needs of Python at
    the backward (`native_backward_inputs`)."""
    recipe = slots.recipe
    scale, record = slots.cast_scale(FORWARD, input_.device)
    # Views of the state, written in place: the backward's cast reads the values of its time.
    grad_scale, grad_record = slots.cast_scale(BACKWARD, input_.device)
    w = fp8_weight_of(weight).tensor
    # Positional (`csrc/fp8_linear.cpp`'s order): keywords cost the host microseconds.
    return native.linear(
        input_,  # x
        weight,
        bias,
        residual,
        scale,
        record,
        grad_scale,
        grad_record,
        w.data,  # weight_data
        w.scale_inv,  # weight_scale_inv
        recipe.forward_dtype == torch.float8_e4m3fn,  # e4m3_forward
        recipe.backward_dtype == torch.float8_e4m3fn,  # e4m3_backward
        recipe.wgrad,  # fp8_wgrad
        recipe.fprop_fast_accum,  # fast_accum
    )


def native_backward_inputs(
    weight: torch.Tensor, accumulates: bool | None, need_input: bool
) -> tuple[bool, FusionTarget | None, torch.Tensor | None, torch.Tensor | None]:
    """What the C++ node's backward asks Python, once: where the weight gradient goes
    (`grad_accumulation.native_target`) and, where the input gradient is wanted, the FP8
    weight's contiguous transpose and its scale's inverse (made at the weight's first backward,
    kept with its FP8 copy)."""
    wanted, target = native_target(weight, accumulates)
    if not need_input:
        return wanted, target, None, None
    transposed = fp8_weight_of(weight).transposed()
    return wanted, target, transposed.data, transposed.scale_inv


_apply_linear = direct_apply(_Fp8Linear)


class _Fp8ColumnParallelLinear(torch.autograd.Function):
    """`overlapped_linear._ColumnParallelLinear` with its GEMMs in FP8: the same communication
    and overlap. Under sequence parallelism the gathered input is quantised whole (its
    amax is the whole tensor's, the same on every tp rank), only this rank's part of the
    high-precision input is kept, and backward gathers it again and re-quantises its transpose
    as forward would have (with the forward's scale, or in blocks from the same values: the
    forward's values, bit for bit)."""

    @staticmethod
    def forward(
        ctx,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        sequence_parallel: bool,
        slots: Fp8LinearSlots,
        weight_needs_grad: bool,
    ) -> torch.Tensor:
        needs_weight = weight_needs_grad
        fp8_wgrad = needs_weight and slots.recipe.wgrad
        total = input_
        if sequence_parallel:
            total, gathering = gather_first_async(input_, group)
            gathering.wait()
            x, scale = slots.quantize_gathered_input(_flat(total))
            ctx.save_for_backward(input_, scale if fp8_wgrad else None, weight)
        else:
            x2d = _flat(input_)
            x = slots.quantize_input(x2d, transpose=fp8_wgrad)
            if fp8_wgrad:
                input_t = x.transposed_operand()
                ctx.save_for_backward(input_t.data, input_t.scale_inv, weight)
            else:
                ctx.save_for_backward(input_ if needs_weight else None, None, weight)
        out = _fprop(x, weight, bias, input_.dtype, slots.recipe)
        ctx.weight = weight
        ctx.slots, ctx.fp8_wgrad, ctx.has_bias = slots, fp8_wgrad, bias is not None
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.input_dtype = input_.dtype
        return out.view(*total.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        saved, saved_scale, _ = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        group, sequence_parallel = ctx.group, ctx.sequence_parallel
        grad_2d = _flat(grad_output)
        wanted, target = False, None
        if needs_weight:
            wanted, target = weight_grad_target(ctx.weight, ctx.next_functions[1][0])
        fp8_wgrad = wanted and ctx.fp8_wgrad
        total, gathering = saved, None
        if sequence_parallel and wanted:
            total, gathering = gather_first_async(saved, group)
        grad = None
        if needs_input or fp8_wgrad:
            grad = ctx.slots.quantize_grad(grad_2d, transpose=fp8_wgrad)
        grad_input = reducing = None
        if needs_input:
            grad_total = _dgrad(grad, ctx.weight, ctx.input_dtype, ctx.slots.recipe)
            grad_total = grad_total.view(*grad_output.shape[:-1], grad_total.shape[-1])
            if sequence_parallel:
                if gathering is not None:
                    gathering.wait()
                    gathering = None
                grad_input, reducing = reduce_scatter_first_async(grad_total, group)
            else:
                grad_input = grad_total
                reducing = dist.all_reduce(grad_input, group=group, async_op=True)
        if gathering is not None:
            gathering.wait()
        grad_weight = grad_bias = None
        if fp8_wgrad:
            if sequence_parallel:
                input_t = ctx.slots.transposed_input(_flat(total), saved_scale)
            else:
                input_t = ctx.slots.saved_input_t(saved, saved_scale)
            grad_weight = _fp8_wgrad(grad, input_t, target, ctx.weight.dtype)
        elif wanted:
            grad_weight = weight_grad_into(target, grad_2d, total)
        if ctx.has_bias and needs_bias:
            grad_bias = grad_2d.sum(dim=0)
        if reducing is not None:
            reducing.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


_apply_column_parallel = direct_apply(_Fp8ColumnParallelLinear)


def check_fp8_dims(name: str, weight_shape: torch.Size) -> None:
    """Refuses a linear layer whose FP8 GEMMs Hopper cannot run.

    Raises:
        ValueError: its (this rank's) in or out features are not multiples of 16.
    """
    out_features, in_features = weight_shape
    if out_features % GEMM_ALIGNMENT or in_features % GEMM_ALIGNMENT:
        raise ValueError(
            f"FP8 GEMMs need in and out features in multiples of {GEMM_ALIGNMENT} "
            f"(layer {name}: weight [{out_features}, {in_features}] on this rank); choose "
            "hidden, FFN, head and query-group sizes that give multiples of 16 per "
            "tensor-parallel rank, or train without --fp8-format."
        )
