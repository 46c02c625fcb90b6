"""FP8 experts: the three GEMMs of every expert of an MoE projection in FP8.

An `ExpertLinear` (`megatron.core.transformer.moe.experts`) holds the stacked weights
`[num_local_experts, out, in]` of one projection, and its input comes grouped by expert (`counts`
rows each). With FP8 settings (`Fp8ExpertSlots`, its `fp8` attribute) each expert e computes
`Y_e = X_e W_e^T`, `dX_e = dY_e W_e` and `dW_e = dY_e^T X_e` as the dense FP8 linear layers do
(`megatron.core.fp8.linear`: E4M3 inputs and weights, E5M2 output gradients under `hybrid`,
fast accumulation in the forward GEMM only), each tensor of each expert with a scale of its own,
as Transformer Engine's grouped linear layers keep one quantizer per expert GEMM:

- each expert's weight by its current amax (`Fp8ExpertWeights`, made once per change);
- each expert's input and output gradient by the recipe: its own amax when it is cast
  (`tensorwise`), or (`delayed`) the amax history of a forward and a backward slot per *global*
  expert in the model's `DelayedScalingState`. Every rank holds the slots of every expert and
  records into those of its own; the end-of-pass MAX reduction over the amax group then gives
  each expert the amax of its tokens on every rank, so the scales do not depend on the
  expert-parallel size, and a checkpoint's state fits any.

Each pass casts all the experts' rows at once (`grouped_quantize.quantize_experts`: on CUDA one
kernel launch, two under current scaling) into the padded layout the grouped GEMMs read, with
the transposed copy the weight gradient reads; the per-expert GEMMs take views of them.

The GEMMs of a `GroupedMLP` on a GPU run as one launch each (`ExpertGemms`): this package's
Triton grouped GEMMs (`expert_gemm_kernels.py`: any FP8 operands, E5M2 output gradients
included, and weight gradients written into fp32 `main_grad`s unrounded, as the dense layers
write theirs), or, where Triton does not run, PyTorch's grouped FP8 GEMM
(`torch._scaled_grouped_mm`, `grouped_gemm.py`) where it applies (E4M3 operands, a bf16 output).
Elsewhere (off CUDA, an expert layer that is not grouped, experts whose GEMMs are large enough to
keep the GPU busy one at a time: `PER_EXPERT_FROM_FLOPS`) each expert with tokens runs one
`torch._scaled_mm` per GEMM (`fp8_mm`). `describe_expert_gemms` says which, for the start-up log.
Where all three run the Triton kernels, the counts may stay on the device (`DeviceExpertRows`:
the kernels' table is computed there, their grids sized by upper bounds), so the layer needs no
host synchronisation; the other kernels read them on the host. A model trained in CUDA graphs
runs the Triton kernels at any size (`Fp8ExpertSlots`' `graphed`), since a graph cannot hold a
host read (`HOST_COUNTS_IN_GRAPH`, the error of a capture that meets one).

Weight gradients go where `grad_accumulation.weight_grad_target` says, as the dense FP8 layers':
fused into an engine's `main_grad` (written over, with zeros for experts without tokens, or
added to), returned to autograd, or not computed. Experts that every tensor-parallel rank holds
whole (`tp_group`) get their gradients summed over it here and returned to autograd.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import torch.distributed as dist

from megatron.core.fp8 import expert_gemm_kernels, grouped_gemm
from megatron.core.fp8.gemm import fp8_mm
from megatron.core.fp8.grouped_gemm import (
    DeviceExpertRows,
    ExpertRows,
    fp8_grouped_mm,
    fp8_grouped_wgrad,
)
from megatron.core.fp8.grouped_quantize import GroupedFp8Tensor, quantize_experts
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.scaling import BACKWARD, FORWARD, DelayedScalingState
from megatron.core.fp8.weights import Fp8ExpertWeights, fp8_weight_of
from megatron.core.tensor_parallel.grad_accumulation import (
    FusionTarget,
    weight_grad_into,
    weight_grad_target,
)
from megatron.core.tensor_parallel.utils import group_size
from megatron.core.utils import (
    cuda_graph_capturing,
    direct_apply,
    once_differentiable,
    outside_compiled_graphs,
    with_zero_rows,
)

_GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ExpertGemm(enum.Enum):
    """How one of an expert projection's three GEMMs runs (the value, for the log)."""

    PER_EXPERT = "one torch._scaled_mm per expert"
    SCALED_GROUPED_MM = "torch._scaled_grouped_mm"
    TRITON = "a Triton grouped GEMM"


_PER_EXPERT = ExpertGemm.PER_EXPERT

PER_EXPERT_FROM_FLOPS = 4e10
"""The mean FLOPs of one expert's GEMM from which a grouped expert layer runs one
`torch._scaled_mm` per expert rather than a grouped GEMM. A GEMM launch costs the host about
40 us, in which an H200 does about 4e10 FP8 FLOPs: smaller GEMMs one at a time leave the GPU
waiting for the host (64 experts of a DeepSeek-V3 shape, 2-4 GFLOP each: 2.5-3.4 ms of host time
per GEMM and projection against 0.1 grouped), while larger ones keep it busy, and cuBLAS ran them
faster than the grouped kernels on an H200 (8 experts of Mixtral's shape, 120-240 GFLOP each:
the forward of fc1 in 1.6 ms, against 2.3 by the Triton kernel and 2.5 by
`torch._scaled_grouped_mm`)."""


@dataclasses.dataclass(frozen=True)
class ExpertGemms:
    """How an FP8 expert projection's GEMMs run (module docstring).

    Attributes:
        fprop: the forward GEMM.
        dgrad: the input-gradient GEMM.
        wgrad: the weight-gradient GEMM (`SCALED_GROUPED_MM`: into bf16 gradients only, the
            others one GEMM per expert).
    """

    fprop: ExpertGemm = _PER_EXPERT
    dgrad: ExpertGemm = _PER_EXPERT
    wgrad: ExpertGemm = _PER_EXPERT

    @property
    def read_rows_on_device(self) -> bool:
        """Whether every GEMM reads where the experts' rows lie from the device (the Triton
        kernels): the counts need not reach the host (`DeviceExpertRows`)."""
        return self.fprop is self.dgrad is self.wgrad is ExpertGemm.TRITON

    @classmethod
    def where_possible(
        cls,
        recipe: Fp8Recipe,
        device: torch.device,
        dtype: torch.dtype,
        flops_per_expert: float | None = None,
    ) -> ExpertGemms:
        """The kernels that run the GEMMs of an expert layer on `device` whose inputs are of
        `dtype` and whose experts' GEMMs take `flops_per_expert` on average (None: whatever
        their size): one GEMM per expert from `PER_EXPERT_FROM_FLOPS`; below, the Triton
        grouped GEMMs where they run (on an H200 they took less GPU and host time than
        PyTorch's grouped GEMM), else PyTorch's where it applies, else one GEMM per expert."""
        if flops_per_expert is not None and flops_per_expert >= PER_EXPERT_FROM_FLOPS:
            return cls()
        if expert_gemm_kernels.kernels_available(device):
            triton = ExpertGemm.TRITON
            return cls(fprop=triton, dgrad=triton, wgrad=triton if recipe.wgrad else _PER_EXPERT)
        if dtype != torch.bfloat16 or not grouped_gemm.grouped_kernel_available(device):
            return cls()
        scaled = ExpertGemm.SCALED_GROUPED_MM
        e4m3 = recipe.backward_dtype == torch.float8_e4m3fn
        backward = scaled if e4m3 else _PER_EXPERT
        return cls(fprop=scaled, dgrad=backward, wgrad=backward if recipe.wgrad else _PER_EXPERT)


def describe_expert_gemms(
    recipe: Fp8Recipe,
    grouped: bool,
    device: torch.device,
    dtype: torch.dtype,
    graphed: bool = False,
) -> str:
    """How the routed experts' FP8 GEMMs run, for the start-up log: "the routed experts' FP8
    GEMMs run one torch._scaled_mm per expert (...)".

    Args:
        recipe: the model's recipe.
        grouped: the experts are a `GroupedMLP` (`moe_grouped_gemm`).
        device: where they compute.
        dtype: the dtype of their inputs (the parameters').
        graphed: the training iteration runs in a CUDA graph (`Fp8ExpertSlots`).
    """
    prefix = "the routed experts' FP8 GEMMs run"
    if not grouped:
        return f"{prefix} {_PER_EXPERT.value}"
    gemms = ExpertGemms.where_possible(recipe, device, dtype)
    if gemms == ExpertGemms():
        inputs = str(dtype).removeprefix("torch.")
        return (
            f"{prefix} {_PER_EXPERT.value} (no grouped FP8 GEMM for {inputs} inputs on this "
            f"{device.type} device)"
        )
    wgrad = gemms.wgrad.value
    if not recipe.wgrad:
        wgrad = "one high-precision GEMM per expert (no FP8 weight gradient)"
    elif gemms.wgrad is ExpertGemm.SCALED_GROUPED_MM:
        wgrad += f" (into fp32 main_grads {_PER_EXPERT.value})"
    line = (
        f"{prefix}: forward {gemms.fprop.value}, input gradient {gemms.dgrad.value}, weight "
        f"gradient {wgrad}"
    )
    if graphed:
        return f"{line}, for experts of any size (CUDA graphs)"
    return (
        f"{line}; experts whose GEMMs average {PER_EXPERT_FROM_FLOPS / 1e9:.0f} GFLOP or more: "
        f"{_PER_EXPERT.value}"
    )


class Fp8ExpertSlots:
    """An expert projection's FP8 settings: the recipe, and under delayed scaling the model's
    state and a forward and a backward slot per global expert (module docstring).

    Args:
        recipe: the model's FP8 recipe.
        state: the model's delayed-scaling state (delayed recipes), else None.
        num_experts: the experts of the MoE layer (all ranks).
        first_expert: the global index of this rank's first expert.
        num_local_experts: this rank's experts.
        graphed: the training iteration runs in a CUDA graph (`cuda_graph_impl`
            "full_iteration"): where the Triton kernels run (with FP8 weight gradients), grouped
            GEMMs run them, which take the counts on the device, at any size (`expert_gemms`),
            so that eager warm-up iterations run the kernels the graph holds.
    """

    def __init__(
        self,
        recipe: Fp8Recipe,
        state: DelayedScalingState | None = None,
        *,
        num_experts: int,
        first_expert: int,
        num_local_experts: int,
        graphed: bool = False,
    ) -> None:
        if recipe.delayed != (state is not None):
            raise ValueError("Fp8ExpertSlots: a delayed recipe needs a DelayedScalingState.")
        if not 0 <= first_expert <= first_expert + num_local_experts <= num_experts:
            raise ValueError(
                f"Fp8ExpertSlots: local experts {first_expert}..{first_expert + num_local_experts}"
                f" are not among the {num_experts} experts."
            )
        self.recipe = recipe
        self.state = state
        self.graphed = graphed
        self.input_slots = self.grad_slots = range(0)
        if state is not None:
            local = slice(first_expert, first_expert + num_local_experts)
            self.input_slots = state.new_slots(FORWARD, num_experts)[local]
            self.grad_slots = state.new_slots(BACKWARD, num_experts)[local]

    def experts_linear(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor,
        counts: list[int] | torch.Tensor,
        *,
        grouped: bool,
        tp_group: dist.ProcessGroup | None = None,
        gemm_rows: int | None = None,
    ) -> torch.Tensor:
        """Each expert's rows of `input_` times its weight, the GEMMs in FP8 (module
        docstring).

        Args:
            input_: `[M, in]`, grouped by expert.
            weight: the stacked weights `[num_local_experts, out, in]` (the parameter itself).
            counts: each local expert's rows of `input_` (0 included): host integers summing
                to `M`, or an integer tensor on `input_`'s device summing to at most `M` (the
                rows after are padding, whose outputs are unspecified). A tensor stays there
                where every GEMM runs a Triton grouped kernel (no host synchronisation; other
                kernels read it on the host).
            grouped: run as grouped GEMMs where the kernel applies (`GroupedMLP`).
            tp_group: the tensor-parallel ranks holding these same experts whole, over which
                the weight gradient is summed; None: none.
            gemm_rows: the real rows the choice of kernels assumes (`expert_gemms`), where
                counts in a tensor leave padding; None: `M`.

        Returns:
            `[M, out]` in the input's dtype.

        Raises:
            RuntimeError: counts in a tensor that a GEMM must read on the host, while a CUDA
                graph captures (which cannot hold a host read).
        """
        args = (self, input_, weight, counts, grouped, tp_group, gemm_rows)
        if torch.compiler.is_compiling():
            # Outside any compiled graph: the kernels' choice, the FP8 weight cache and the
            # scaling state are host state (as for the dense FP8 linear layers).
            return _experts_linear_outside_graph(*args)
        return _experts_linear(*args)

    def expert_gemms(
        self, input_: torch.Tensor, weight: torch.Tensor, rows: int, grouped: bool
    ) -> ExpertGemms:
        """How `experts_linear` runs the GEMMs of `input_` times `weight`.

        Args:
            input_: the input, whose device and dtype decide the kernels.
            weight: the stacked weights `[num_local_experts, out, in]`.
            rows: the input's real rows, from which the experts' mean GEMM size is estimated
                (`PER_EXPERT_FROM_FLOPS`; not for `graphed` experts, which the size does not
                decide).
            grouped: grouped GEMMs are asked for (`GroupedMLP`).

        Returns:
            The kernels; where every one reads the rows on the device
            (`ExpertGemms.read_rows_on_device`), counts in a tensor stay there.
        """
        if not grouped:
            return ExpertGemms()
        flops = None if self.graphed else _mean_gemm_flops(weight, rows)
        return ExpertGemms.where_possible(self.recipe, input_.device, input_.dtype, flops)

    def quantize(
        self,
        x: torch.Tensor,
        rows: ExpertRows | DeviceExpertRows,
        direction: str,
        *,
        transpose: bool,
    ) -> GroupedFp8Tensor:
        """Each expert's rows of `x` (2-D) quantised with the expert's scale, all at once
        (`quantize_experts`).

        Args:
            x: `[M, cols]`, grouped by expert.
            rows: where each expert's rows lie.
            direction: FORWARD (inputs) or BACKWARD (output gradients).
            transpose: also make the transposed copy.
        """
        forward = direction == FORWARD
        dtype = self.recipe.forward_dtype if forward else self.recipe.backward_dtype
        scales = records = None
        if self.state is not None:
            slots = self.input_slots if forward else self.grad_slots
            scales, records = self.state.cast_range(direction, slots, x.device)
        return quantize_experts(
            x, rows, dtype, scales=scales, amax_out=records, transpose=transpose
        )


def _expert_mm(
    cast: GroupedFp8Tensor,
    weights: Fp8ExpertWeights,
    *,
    kernel: ExpertGemm,
    dgrad: bool,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """`X_e W_e^T` (forward) or `dY_e W_e` (`dgrad`) of every expert, `[M, cols]`, by
    `kernel`."""
    rows = cast.rows
    width = weights.data.shape[2 if dgrad else 1]
    device = weights.data.device
    if kernel is not _PER_EXPERT:
        if rows.rows == 0:
            return torch.empty(0, width, dtype=out_dtype, device=device)
        b = weights.grouped_dgrad_operand() if dgrad else weights.grouped_fprop_operand()
        if kernel is ExpertGemm.TRITON:
            return expert_gemm_kernels.grouped_mm(
                cast.data,
                cast.scale_invs,
                b,
                weights.strided_scale_invs,
                rows.gemm_table(device),
                rows.gemm_tiles,
                out_dtype=out_dtype,
                fast_accum=fast_accum,
                real_rows=rows.rows,
            )
        product = fp8_grouped_mm(
            cast.data, cast.scale_invs, b, weights.scale_invs(), rows, fast_accum=fast_accum
        )
        return rows.unpad(product)
    if dgrad:
        weights.transposes()  # every expert's, in one launch rather than one per expert
    # Over the padded rows, whose products are zero rows, dropped after: each expert's part and
    # output is a view made with the others' in one call.
    out = torch.empty(rows.padded_rows, width, dtype=out_dtype, device=device)
    outs = out.split(rows.padded_counts)
    for index, part in enumerate(cast.per_expert(cast.data, 0)):
        if part is not None:
            expert = weights[index]
            b = expert.dgrad_operand() if dgrad else expert.fprop_operand()
            fp8_mm(part, b, out_dtype=out_dtype, fast_accum=fast_accum, out=outs[index])
    return rows.unpad(out)


def _fp8_wgrad(
    grads: GroupedFp8Tensor,
    inputs: GroupedFp8Tensor,
    weight: torch.Tensor,
    target: FusionTarget | None,
    kernel: ExpertGemm,
) -> torch.Tensor | None:
    """`dY_e^T X_e` of every expert from the transposed copies, by `kernel`, into `target`
    (None: returned in the weight's dtype); experts without rows get zeros where it is written
    over, and keep their gradient where it is added to."""
    rows = grads.rows
    dest = target.tensor if target is not None else torch.empty_like(weight)
    overwrite = target is None or target.overwrite
    if dest.dtype not in _GEMM_OUT_DTYPES:
        raise ValueError(
            f"FP8 weight gradients go into bf16, fp16 or fp32 main_grads, got {dest.dtype}."
        )
    if kernel is ExpertGemm.TRITON and rows.padded_rows:
        expert_gemm_kernels.grouped_wgrad_into(
            dest,
            grads.transposed,
            grads.scale_invs,
            inputs.transposed.t(),
            inputs.scale_invs,
            rows.gemm_table(dest.device),
            accumulate=not overwrite,
        )
    elif kernel is ExpertGemm.SCALED_GROUPED_MM and dest.dtype == torch.bfloat16 and rows.rows:
        product = fp8_grouped_wgrad(
            grads.transposed, grads.scale_invs, inputs.transposed.t(), inputs.scale_invs, rows
        )
        for index, count in enumerate(rows.counts):
            if count == 0:  # an empty group's product is left to the kernel: make it zero
                product[index].zero_()
        if overwrite:
            dest.copy_(product)
        else:
            dest.add_(product)
    else:
        lefts = grads.per_expert(grads.transposed, 1)
        rights = inputs.per_expert(inputs.transposed.t(), 0)
        for a, b, view in zip(lefts, rights, dest.unbind(0)):
            if a is None:
                if overwrite:
                    view.zero_()
                continue
            if overwrite and view.is_contiguous():
                fp8_mm(a, b, out_dtype=dest.dtype, out=view)
            elif overwrite:
                view.copy_(fp8_mm(a, b, out_dtype=dest.dtype))
            else:
                view.add_(fp8_mm(a, b, out_dtype=dest.dtype))
    return dest if target is None else None


def _high_precision_wgrad(
    grad: torch.Tensor,
    input_: torch.Tensor,
    rows: ExpertRows,
    weight: torch.Tensor,
    target: FusionTarget | None,
) -> torch.Tensor | None:
    """`dY_e^T X_e` of every expert in the inputs' precision (`--no-fp8-wgrad`), into `target`
    (None: returned)."""
    pairs = zip(rows.split(grad), rows.split(input_))
    if target is None:
        return torch.stack([weight_grad_into(None, g, x) for g, x in pairs]).to(weight.dtype)
    for index, (g, x) in enumerate(pairs):
        weight_grad_into(FusionTarget(target.tensor[index], target.overwrite), g, x)
    return None


class _Fp8Experts(torch.autograd.Function):
    """`Fp8ExpertSlots.experts_linear` (module docstring)."""

    @staticmethod
    def forward(
        ctx,
        input_: torch.Tensor,
        weight: torch.Tensor,
        slots: Fp8ExpertSlots,
        rows: ExpertRows | DeviceExpertRows,
        gemms: ExpertGemms,
        tp_group: dist.ProcessGroup | None,
        weight_needs_grad: bool,
    ) -> torch.Tensor:
        recipe = slots.recipe
        fp8_wgrad = weight_needs_grad and recipe.wgrad
        cast = slots.quantize(input_, rows, FORWARD, transpose=fp8_wgrad)
        out = _expert_mm(
            cast,
            fp8_weight_of(weight),
            kernel=gemms.fprop,
            dgrad=False,
            out_dtype=input_.dtype,
            fast_accum=recipe.fprop_fast_accum,
        )
        if fp8_wgrad:
            ctx.save_for_backward(cast.transposed, cast.scale_invs)
        elif weight_needs_grad:
            ctx.save_for_backward(input_)
        # The parameter itself, for the FP8 weight cache and fusion (a checkpoint's
        # recomputation saves another tensor object).
        ctx.weight = weight
        ctx.slots, ctx.rows, ctx.gemms, ctx.tp_group = slots, rows, gemms, tp_group
        ctx.fp8_wgrad, ctx.input_dtype = fp8_wgrad, input_.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        saved = ctx.saved_tensors
        rows, gemms, weight = ctx.rows, ctx.gemms, ctx.weight
        needs_input, needs_weight = ctx.needs_input_grad[:2]
        tp_shared = group_size(ctx.tp_group) > 1
        wanted, target = needs_weight, None
        if needs_weight and not tp_shared:
            wanted, target = weight_grad_target(weight, ctx.next_functions[1][0])
        fp8_wgrad = wanted and ctx.fp8_wgrad
        grad_output = grad_output.contiguous()
        grads = None
        if needs_input or fp8_wgrad:
            grads = ctx.slots.quantize(grad_output, rows, BACKWARD, transpose=fp8_wgrad)
        grad_input = grad_weight = None
        if needs_input:
            grad_input = _expert_mm(
                grads,
                fp8_weight_of(weight),
                kernel=gemms.dgrad,
                dgrad=True,
                out_dtype=ctx.input_dtype,
                fast_accum=False,
            )
        if fp8_wgrad:
            inputs = GroupedFp8Tensor(None, saved[1], rows, transposed=saved[0])
            grad_weight = _fp8_wgrad(grads, inputs, weight, target, gemms.wgrad)
        elif wanted:
            grad_weight = _high_precision_wgrad(grad_output, saved[0], rows, weight, target)
        if tp_shared and grad_weight is not None:
            dist.all_reduce(grad_weight, group=ctx.tp_group)
        return grad_input, grad_weight, None, None, None, None, None


_apply_experts = direct_apply(_Fp8Experts)

HOST_COUNTS_IN_GRAPH = (
    "FP8 experts read their token counts on the host, which a CUDA graph cannot hold: {why}"
)
"""The error of a capture that meets experts needing host counts (`host_counts_in_graph`)."""


def _experts_linear(
    slots: Fp8ExpertSlots,
    input_: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int] | torch.Tensor,
    grouped: bool,
    tp_group: dist.ProcessGroup | None,
    gemm_rows: int | None,
) -> torch.Tensor:
    """`Fp8ExpertSlots.experts_linear`, run eagerly."""
    needs_weight = torch.is_grad_enabled() and weight.requires_grad
    if isinstance(counts, torch.Tensor):
        rows = DeviceExpertRows(counts, input_.shape[0])
    else:
        rows = ExpertRows(counts)
    gemm_rows = rows.rows if gemm_rows is None else gemm_rows
    gemms = slots.expert_gemms(input_, weight, gemm_rows, grouped)
    padding = 0
    if isinstance(rows, DeviceExpertRows) and not gemms.read_rows_on_device:
        if cuda_graph_capturing():
            raise RuntimeError(host_counts_in_graph(slots, input_, weight, gemm_rows, grouped))
        rows = rows.on_host()
        padding = input_.shape[0] - rows.rows
        input_ = input_[: rows.rows]
    out = _apply_experts(input_, weight, slots, rows, gemms, tp_group, needs_weight)
    return with_zero_rows(out, padding)


_experts_linear_outside_graph = outside_compiled_graphs(_experts_linear)


def host_counts_in_graph(
    slots: Fp8ExpertSlots, input_: torch.Tensor, weight: torch.Tensor, rows: int, grouped: bool
) -> str:
    """`HOST_COUNTS_IN_GRAPH` for the experts `slots` sets, of stacked `weight` over `rows`
    real rows of `input_`, with the reason their GEMMs read the counts on the host
    (`Fp8ExpertSlots.expert_gemms`)."""
    if not grouped:
        why = "their GEMMs run one per expert (not a GroupedMLP); use moe_grouped_gemm"
    elif not slots.recipe.wgrad:
        why = (
            "their weight gradients are not in FP8 (--no-fp8-wgrad), and the high-precision "
            "ones read them; drop --no-fp8-wgrad"
        )
    elif not expert_gemm_kernels.kernels_available(input_.device):
        why = (
            "the Triton grouped kernels, which take them on the device, do not run on this GPU "
            "(they need Triton and compute capability 9.0 or later); train without the graph"
        )
    else:  # large experts in a model not built for graphs (`Fp8ExpertSlots.graphed`)
        why = (
            f"their GEMMs average {_mean_gemm_flops(weight, rows) / 1e9:.0f} GFLOP (from "
            f"{PER_EXPERT_FROM_FLOPS / 1e9:.0f}: one cuBLAS GEMM per expert); build the model "
            "with TransformerConfig(cuda_graph_impl='full_iteration') (--cuda-graph-impl "
            "full_iteration sets it), whose experts run the grouped kernels at any size"
        )
    return HOST_COUNTS_IN_GRAPH.format(why=why)


def _mean_gemm_flops(weight: torch.Tensor, rows: int) -> float:
    """The mean FLOPs of one expert's GEMM over `rows` rows of stacked `weight`."""
    experts, out_features, in_features = weight.shape
    return 2.0 * rows * out_features * in_features / max(experts, 1)
