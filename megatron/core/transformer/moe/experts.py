"""The routed experts of an MoE layer: this rank's expert MLPs as stacked parameters.

Each projection is ONE parameter whose dim 0 is the local expert index (shapes at ETP 1):
`linear_fc1.weight` [num_local_experts, fc1_out, hidden] (fc1_out = 2 * moe_ffn_hidden_size
with `gated_linear_unit`, the `[x W | x V]` halves of the dense MLP) and `linear_fc2.weight`
[num_local_experts, hidden, moe_ffn_hidden_size], plus `.bias` [num_local_experts, out] with
`add_bias_linear`. Local expert i is global expert `first_expert + i`. `SequentialMLP` (a loop of
GEMMs) and `GroupedMLP` (one grouped GEMM per projection) hold the same parameters, so
checkpoints do not depend on the choice.

Expert tensor parallelism (ETP, the `expt_tp` group) splits each expert's MLP width over etp
ranks, as the dense MLP splits its width over tp: fc1 is column-parallel per expert (local weight
[num_local_experts, fc1_out / etp, hidden]; with `gated_linear_unit` in stride 2, so rank t holds
`[W_t; V_t]`, its part of each half), fc2 row-parallel per expert (local weight
[num_local_experts, hidden, moe_ffn_hidden_size / etp]). Each rank's fc2 output is a partial sum
that the dispatcher's combine adds up over `expt_tp`. The fc2 bias is therefore replicated over
`expt_tp` and added on its rank 0 only; its gradient is summed over `expt_tp` so every replica
gets the same one. `ExpertLinear.tensor_parallel_layouts()` states these splits relative to
`expt_tp` (nothing at ETP 1).

Initialisation depends on neither the expert-parallel nor the expert tensor-parallel size: each
projection draws one seed from the CPU's default generator (identically on every rank, whatever
the layout), each global expert's whole weights are drawn from a generator seeded by it and the
expert index, and each rank keeps its part, so a model built at any EP and ETP starts from the
same global weights. `ExpertLinear.reset_parameters()` does this, at construction and again when
a model built on the `meta` device is materialised, so both draw the same weights.

The routing weights multiply each token's activation (and fc2 bias) inside the experts, as in
Megatron-core, so the dispatcher's combine only sums.

With ETP x EP = 1 under tensor + sequence parallelism every tp rank holds all experts whole and
feeds them its own part of the sequence: the layer then passes the tp group (`tp_group`) and the
experts' gradients are summed over it in backward (`grad_sum_over_tp`), as for any replicated
parameter.

In a transformer layer that trains in FP8 each `ExpertLinear` has FP8 settings (its `fp8`
attribute, given by the transformer block): its experts' GEMMs then run in FP8, one per expert or
grouped (`megatron.core.fp8.experts`); the biases and the routing weights stay in high precision.

How the GEMMs run is chosen once (`ExpertGemm`, the experts' `gemm`): a loop of GEMMs, one per
expert with tokens, sized by the counts read on the host (`SequentialMLP`); one grouped GEMM per
projection whose group offsets stay on the device, so nothing is read on the host
(`GroupedMLP`); or FP8 GEMMs sized on the host (set by the transformer block with the FP8
settings). The input may hold padding rows after the counts' sum (a dispatcher's WORST_CASE
sizing): their outputs are left unspecified, and their gradients never reach a weight.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.fp8 import expert_gemm_kernels
from megatron.core.fp8.experts import host_counts_in_graph
from megatron.core.fusions.expert_bias import add_expert_bias, expert_bias_fusable
from megatron.core.tensor_parallel.layout import TensorParallelLayout, shard_tensor
from megatron.core.tensor_parallel.mappings import grad_sum_over_tp
from megatron.core.tensor_parallel.utils import divide, group_rank, group_size
from megatron.core.transformer.mlp import mlp_activation
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import cuda_graph_capturing, outside_compiled_graphs, with_zero_rows

if TYPE_CHECKING:
    from megatron.core.fp8.experts import Fp8ExpertSlots

Projection = Callable[["ExpertLinear", torch.Tensor], torch.Tensor]
"""Multiplies rows grouped by expert by one projection's expert weights."""

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


class ExpertGemm(enum.Enum):
    """How the experts' GEMMs run (module docstring)."""

    LOOP = "loop"
    """One GEMM per expert with tokens; the counts are read on the host."""
    GROUPED = "grouped"
    """One `torch._grouped_mm` per projection, offsets on the device (on a CPU whose PyTorch
    lacks it for the dtype: a loop over the experts of GEMMs over all rows, masked to the
    expert's, which needs no host read either)."""
    FP8 = "fp8"
    """FP8 GEMMs, one per expert or grouped (`megatron.core.fp8.experts`); counts on the host,
    or on the device where the grouped FP8 kernels take them (`reads_counts_on_host`)."""


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The default generator of `device` seeded with `seed`, restored afterwards."""
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        if cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs on `device` in `dtype` (tried once, then cached); on
    the `meta` device, whether it traces (tracing runs its meta function, which takes bf16 only
    where the CPU and CUDA kernels also take other dtypes)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_WORKS:
        _GROUPED_MM_WORKS[key] = _try_grouped_mm(device, dtype)
    return _GROUPED_MM_WORKS[key]


@outside_compiled_graphs
def _try_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    # Run eagerly even inside a compiled layer: traced, it would meet the kernel's meta
    # function, which is stricter than the CPU kernel.
    if _grouped_mm is None:
        return False
    try:
        a = torch.ones(16, 16, device=device, dtype=dtype)
        b = torch.ones(1, 16, 16, device=device, dtype=dtype).transpose(1, 2)
        _grouped_mm(a, b, offs=torch.tensor([16], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_fp8_takes_device_counts() -> bool:
    """Whether grouped FP8 experts built now take their counts on the device: the Triton grouped
    kernels, which read them there, run on the current GPU."""
    return torch.cuda.is_available() and expert_gemm_kernels.kernels_available(
        torch.device("cuda", torch.cuda.current_device())
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: `_grouped_mm`'s backward rejects
    broadcast gradients (stride 0, e.g. from a `sum()`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _ZeroGradFor(torch.autograd.Function):
    """`x` itself (no copy); backward also gives `param` a zero gradient: `param` stays in the
    graph, so the collectives on its gradient's path run here too, without a [rows, out] zero
    tensor added to `x`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        ctx.param_shape, ctx.param_dtype = param.shape, param.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_zeros(ctx.param_shape, dtype=ctx.param_dtype)


class ExpertLinear(torch.nn.Module):
    """The stacked weights (and biases) of one projection of every local expert.

    Each expert's `[out, in]` weight is split over `expt_tp_group` along `split_dim` (0: out
    features, column-parallel; 1: in features, row-parallel), in `stride` blocks each split
    separately (`TensorParallelLayout`'s rule). A row-parallel projection's outputs are partial
    sums over `expt_tp_group`: its bias is replicated and added on the group's rank 0 only.

    Args:
        num_local_experts: Experts on this rank (dim 0).
        input_size: In-features of each expert (all expt_tp ranks).
        output_size: Out-features of each expert (all expt_tp ranks).
        config: The transformer configuration (`params_dtype`).
        bias: Whether each expert has a bias.
        init_method: In-place initialiser of each expert's whole `[out, in]` weight.
        first_expert: Global index of local expert 0.
        split_dim: Dimension of each expert's `[out, in]` weight split over `expt_tp_group`.
        stride: Number of blocks along `split_dim`, each split over `expt_tp_group` on its own.
        expt_tp_group: The expert tensor-parallel group; None: not split.
        tp_group: The tp ranks holding these same experts whole for other tokens, over which all
            gradients are summed; None: none.
    """

    def __init__(
        self,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        config: TransformerConfig,
        bias: bool,
        *,
        init_method: Callable[[torch.Tensor], torch.Tensor],
        first_expert: int = 0,
        split_dim: int,
        stride: int = 1,
        expt_tp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.init_method = init_method
        self.first_expert = first_expert
        self.split_dim = split_dim
        self.stride = stride
        self.expt_tp_group = expt_tp_group
        self.tp_group = tp_group
        shape = [output_size, input_size]
        shape[split_dim] = divide(shape[split_dim], group_size(expt_tp_group))
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(num_local_experts, *shape, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(num_local_experts, shape[0], dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.fp8: Fp8ExpertSlots | None = None
        """The projection's FP8 settings (given by the transformer block that holds it,
        `megatron.core.fp8.experts`); None: high precision."""
        self.reset_parameters()

    def _expert_layout(self) -> TensorParallelLayout:
        """The split of one expert's `[out, in]` weight (and of its `[out]` bias when
        `split_dim` is 0)."""
        return TensorParallelLayout(self.split_dim, self.stride)

    def tensor_parallel_layouts(self) -> dict[str, TensorParallelLayout]:
        """The stacked parameters' splits over `expt_tp_group` (not over the dense tp group);
        none without an expert tensor-parallel group of two or more ranks."""
        if group_size(self.expt_tp_group) == 1:
            return {}
        layout = TensorParallelLayout(self.split_dim + 1, self.stride)
        layouts = {"weight": layout}
        if self.bias is not None and self.split_dim == 0:
            layouts["bias"] = layout
        return layouts

    def reset_parameters(self) -> None:
        """Draws one seed from the CPU's default generator, then initialises each local expert
        from it and its global index (`_reset_expert`); biases zero.

        On the `meta` device it draws nothing: the model is initialised when it is
        materialised, and a seed drawn now would shift every later draw of the generator.
        """
        if self.weight.is_meta:
            return
        seed = int(torch.randint(0, 2**62, (), device="cpu").item())
        for index in range(self.weight.shape[0]):
            self._reset_expert(index, seed + self.first_expert + index)

    def _reset_expert(self, index: int, seed: int) -> None:
        """Initialises local expert `index` from `seed`: `init_method` applied to the expert's
        whole `[out, in]` weight, of which this rank keeps its part; bias zero."""
        full_shape = list(self.weight.shape[1:])
        full_shape[self.split_dim] *= group_size(self.expt_tp_group)
        weight = self.weight[index]
        with torch.no_grad(), _seeded(seed, weight.device):
            full = torch.empty(full_shape, dtype=weight.dtype, device=weight.device)
            self.init_method(full)
            rank, size = group_rank(self.expt_tp_group), group_size(self.expt_tp_group)
            weight.copy_(shard_tensor(full, self._expert_layout(), rank, size))
            if self.bias is not None:
                self.bias[index].zero_()

    def loop(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of `x` grouped by expert (`counts` each) times their expert's weight, one GEMM per
        expert with tokens (bias not added)."""
        chunks = torch.split(x, counts)
        # With no token at all, one empty GEMM still ties the weight to the graph, so every
        # rank produces a (zero) gradient for it.
        used = [i for i, count in enumerate(counts) if count] or [0]
        weight = grad_sum_over_tp(self.weight, self.tp_group)
        outputs = [F.linear(chunks[i], weight[i]) for i in used]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def fp8_experts(
        self,
        x: torch.Tensor,
        counts: list[int] | torch.Tensor,
        grouped: bool,
        gemm_rows: int | None = None,
    ) -> torch.Tensor:
        """The same as `loop` with FP8 settings, as grouped FP8 GEMMs where the kernel runs
        them and `grouped` asks for them (`megatron.core.fp8.experts`; `counts` on the host, or
        on the device summing to at most the rows of `x`, of which `gemm_rows` are expected to
        be real)."""
        return self.fp8.experts_linear(
            x, self.weight, counts, grouped=grouped, tp_group=self.tp_group, gemm_rows=gemm_rows
        )

    def grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The same as `loop`, as one grouped GEMM (`offsets`: int32 cumulative counts, on the
        device; the rows after the last offset are left unspecified)."""
        weight = grad_sum_over_tp(self.weight, self.tp_group)
        return _ContiguousGrad.apply(_grouped_mm(x, weight.transpose(1, 2), offs=offsets))

    def masked(self, x: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """The same as `grouped` where `torch._grouped_mm` does not run: for each expert, a
        GEMM over all rows of which its own are kept (`expert_of_row`: [rows], the number of
        local experts for padding rows, which get zeros). Shapes do not depend on the counts,
        so nothing is read on the host; the work is the experts' number of times the rows'."""
        weight = grad_sum_over_tp(self.weight, self.tp_group)
        out = x.new_zeros(x.shape[0], weight.shape[1])
        for index in range(weight.shape[0]):
            mine = (expert_of_row == index).unsqueeze(1)
            out = torch.where(mine, F.linear(x, weight[index]), out)
        return out

    def add_bias(
        self, x: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x` [rows, out], grouped by expert (`counts`: tokens per expert; rows past their sum
        are padding, which get no bias), plus each row's expert bias, times the row's routing
        weight when `weights` [rows, 1] is given (the sum taken in fp32 with fp32 weights),
        in `x`'s dtype: on CUDA in one kernel per direction
        (`megatron.core.fusions.expert_bias`), else by PyTorch's ops."""
        bias = grad_sum_over_tp(self.bias, self.tp_group)
        if self.split_dim == 1 and group_size(self.expt_tp_group) > 1:
            # The outputs are summed over expt_tp, so the bias is added once, on rank 0. The
            # other ranks keep it in their graph: the sum of its gradient over expt_tp in
            # backward is a collective every rank must join.
            bias = grad_sum_over_tp(bias, self.expt_tp_group)
            if group_rank(self.expt_tp_group) != 0:
                return _ZeroGradFor.apply(x, bias)
        counts = counts.to(bias.device)
        if expert_bias_fusable(x):
            return add_expert_bias(x, bias, counts, weights)
        # The padding rows repeat a zero bias; the known row count spares a host read.
        counts = torch.cat([counts, (x.shape[0] - counts.sum()).view(1)])
        bias = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
        rows = bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return (x + (rows if weights is None else rows * weights)).to(x.dtype)


class SequentialMLP(MegatronModule):
    """This rank's experts, computed as a loop of GEMMs over the experts that got tokens
    (`ExpertGemm.LOOP`: the counts are read on the host).

    Args:
        num_local_experts: Experts on this rank.
        config: The transformer configuration (`moe_ffn_hidden_size`, `gated_linear_unit`,
            `activation_func`, `glu_linear_offset`, `activation_func_clamp_value`,
            `add_bias_linear`, the init methods).
        first_expert: Global index of local expert 0.
        tp_group: The tp group when every tp rank holds these same experts whole (expert tensor
            x expert-model-parallel size 1 under sequence parallelism): their gradients are
            summed over it. None otherwise.
        expt_tp_group: The expert tensor-parallel group each expert's MLP width is split over;
            None: not split.
    """

    GEMM = ExpertGemm.LOOP
    """The class's way to run the GEMMs in high precision."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        first_expert: int = 0,
        *,
        tp_group: dist.ProcessGroup | None = None,
        expt_tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(config)
        self.num_local_experts = num_local_experts
        ffn = config.moe_ffn_hidden_size
        bias = config.add_bias_linear
        hidden = config.hidden_size
        groups = dict(expt_tp_group=expt_tp_group, tp_group=tp_group)
        # Gated: the [W; V] halves are split over expt_tp each on its own (stride 2), so every
        # rank holds matching parts of both, as the dense MLP's fc1.
        halves = 2 if config.gated_linear_unit else 1
        experts = num_local_experts
        self.linear_fc1 = ExpertLinear(
            experts,
            hidden,
            halves * ffn,
            config,
            bias,
            init_method=config.init_method,
            first_expert=first_expert,
            split_dim=0,
            stride=halves,
            **groups,
        )
        self.linear_fc2 = ExpertLinear(
            experts,
            ffn,
            hidden,
            config,
            bias,
            init_method=config.output_layer_init_method,
            first_expert=first_expert,
            split_dim=1,
            **groups,
        )

    @property
    def gemm(self) -> ExpertGemm:
        """How the GEMMs run: the class's `GEMM`, or FP8 once the transformer block gives the
        projections FP8 settings (`enable_fp8`)."""
        return self.GEMM if self.linear_fc1.fp8 is None else ExpertGemm.FP8

    def reads_counts_on_host(self) -> bool:
        """Whether the GEMMs read the token counts on the host, so that the dispatch sizes its
        exchanges there too (`DispatchSizing.of`). The loop of GEMMs reads them; grouped GEMMs
        do not, nor do grouped FP8 GEMMs with FP8 weight gradients where their Triton kernels
        run on the current GPU: they take the counts on the device (`megatron.core.fp8.experts`),
        and an input with padding rows after the counts' sum (a WORST_CASE dispatch). Asked at
        construction, before the block gives FP8 settings (`enable_fp8`): the config says
        whether it will."""
        if self.GEMM is not ExpertGemm.GROUPED:
            return True
        if self.config.fp8 is None:
            return False
        return not (self.config.fp8_wgrad and grouped_fp8_takes_device_counts())

    def enable_fp8(self, fc1: Fp8ExpertSlots, fc2: Fp8ExpertSlots) -> None:
        """Runs the projections' GEMMs in FP8 with these settings (`ExpertGemm.FP8`)."""
        self.linear_fc1.fp8, self.linear_fc2.fp8 = fc1, fc2

    def forward(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor
    ) -> torch.Tensor:
        """Applies each token's expert, scaled by its routing weight.

        Args:
            tokens: [N, hidden], grouped by local expert; rows past the counts' sum are
                padding.
            tokens_per_expert: [num_local_experts] counts, on the host or the device (read on
                the host by the LOOP GEMMs, and by FP8 GEMMs that do not take them on the
                device: `reads_counts_on_host`).
            probs: [N] routing weights.

        Returns:
            [N, hidden]: probs * expert(token) per row, in the tokens' dtype (the padding
            rows' unspecified).
        """
        project = self._projection(tokens, tokens_per_expert)
        intermediate = project(self.linear_fc1, tokens)
        if self.linear_fc1.bias is not None:
            intermediate = self.linear_fc1.add_bias(intermediate, tokens_per_expert)
        weights = probs.unsqueeze(-1)
        intermediate = mlp_activation(intermediate, self.config, weights)
        output = project(self.linear_fc2, intermediate)
        if self.linear_fc2.bias is not None:
            output = self.linear_fc2.add_bias(output, tokens_per_expert, weights)
        return output.to(tokens.dtype)

    def _projection(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> Projection:
        """How this forward multiplies rows by their experts' weights, decided once for both
        projections by `gemm`."""
        gemm = self.gemm
        fp8 = gemm is ExpertGemm.FP8
        if gemm is ExpertGemm.GROUPED:
            return self._grouped_projection(tokens, tokens_per_expert)
        if fp8 and self.GEMM is ExpertGemm.GROUPED and tokens_per_expert.is_cuda:
            # Left on the GPU by a dispatch sized without a host read (`reads_counts_on_host`):
            # they stay there where both projections' FP8 kernels take them, else one host read
            # serves both.
            rows = self._real_rows(tokens)
            if self._fp8_takes_device_counts(tokens, rows):
                return lambda linear, x: linear.fp8_experts(
                    x, tokens_per_expert, grouped=True, gemm_rows=rows
                )
            if cuda_graph_capturing():
                fc1 = self.linear_fc1  # the larger projection
                raise RuntimeError(host_counts_in_graph(fc1.fp8, tokens, fc1.weight, rows, True))
        counts = tokens_per_expert.tolist()  # the host read of LOOP and FP8, one for both
        real = sum(counts)
        padding = tokens.shape[0] - real
        grouped = self.GEMM is ExpertGemm.GROUPED

        def project(linear: ExpertLinear, x: torch.Tensor) -> torch.Tensor:
            x = x[:real] if padding else x
            out = linear.fp8_experts(x, counts, grouped) if fp8 else linear.loop(x, counts)
            return with_zero_rows(out, padding)

        return project

    def _real_rows(self, tokens: torch.Tensor) -> int:
        """The real rows expected among `tokens`, whose counts stay on the device: all of them
        at one rank per expert group (FIXED); under the padded exchange (WORST_CASE), a 1 / ep
        share, what balanced routing sends each expert-parallel rank."""
        return tokens.shape[0] // self.config.expert_model_parallel_size

    def _fp8_takes_device_counts(self, tokens: torch.Tensor, rows: int) -> bool:
        """Whether both projections' grouped FP8 GEMMs of `tokens` (`rows` real ones) read the
        experts' rows on the device (`Fp8ExpertSlots.expert_gemms`); decided outside compiled
        graphs, where the kernels run."""
        if torch.compiler.is_compiling():
            return _fp8_takes_device_counts_outside_graph(self, tokens, rows)
        return all(
            linear.fp8.expert_gemms(tokens, linear.weight, rows, grouped=True).read_rows_on_device
            for linear in (self.linear_fc1, self.linear_fc2)
        )

    def _grouped_projection(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> Projection:
        """One grouped GEMM per projection, or its masked stand-in on a CPU without the kernel
        and in compiled layers of another dtype than bf16 (`ExpertGemm.GROUPED`); nothing is
        read on the host."""
        counts = tokens_per_expert.to(tokens.device, non_blocking=True)
        if not grouped_mm_available(tokens.device, tokens.dtype):
            if tokens.device.type == "cuda":
                raise RuntimeError(
                    f"moe_grouped_gemm needs torch._grouped_mm on this GPU for {tokens.dtype}, "
                    f"which PyTorch {torch.__version__} does not provide; use bf16 on Hopper or "
                    "newer, a newer PyTorch, or set moe_grouped_gemm=False."
                )
            return self._masked_projection(tokens, counts)
        if torch.compiler.is_compiling() and not grouped_mm_available(
            torch.device("meta"), tokens.dtype
        ):
            # A compiled layer in a dtype the grouped GEMM does not trace in (not bf16).
            return self._masked_projection(tokens, counts)
        if not tokens.shape[0]:  # an empty GEMM still ties the weights to the graph
            return lambda linear, x: linear.loop(x, [0] * self.num_local_experts)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return lambda linear, x: linear.grouped(x, offsets)

    @staticmethod
    def _masked_projection(tokens: torch.Tensor, counts: torch.Tensor) -> Projection:
        """`ExpertLinear.masked` for the rows of `tokens`, grouped by expert (`counts`, on the
        device)."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        expert_of_row = torch.searchsorted(torch.cumsum(counts, 0), rows, right=True)
        return lambda linear, x: linear.masked(x, expert_of_row)


_fp8_takes_device_counts_outside_graph = outside_compiled_graphs(
    SequentialMLP._fp8_takes_device_counts
)


class GroupedMLP(SequentialMLP):
    """`SequentialMLP` computed with one grouped GEMM per projection (`moe_grouped_gemm`,
    `ExpertGemm.GROUPED`).

    Uses `torch._grouped_mm` (`torch.nn.functional.grouped_mm` where it exists) with the
    per-expert offsets on the device: nothing is read on the host. On CUDA it must be available
    for the parameters' dtype (bf16 on Hopper and newer; in other dtypes PyTorch's own fallback
    reads the offsets on the host): the forward otherwise raises `RuntimeError`. On CPU, where
    some PyTorch builds lack it (and for float64), each projection runs a loop over the
    experts of GEMMs over all rows, masked to the expert's rows, which needs no host read
    either (`ExpertLinear.masked`). In FP8 the projections run grouped FP8 GEMMs
    (`megatron.core.fp8.experts`): on a GPU where this package's Triton kernels run, with the
    counts on the device (experts large enough for one cuBLAS GEMM each read them on the host,
    once per forward); elsewhere `torch._scaled_grouped_mm` where it applies, or one FP8 GEMM
    per expert, sized on the host.
    """

    GEMM = ExpertGemm.GROUPED
