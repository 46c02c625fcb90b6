"""Tensor-parallel layers with Megatron-core's names: `ColumnParallelLinear`,
`RowParallelLinear` and `VocabParallelEmbedding`.

With a tp group of size T:

- `ColumnParallelLinear` holds rows `[out/T, in]` of the weight (output features split): its
  input is replicated over tp (or, under sequence parallelism, all-gathered from the sequence
  parts first), its output is split over tp unless `gather_output`.
- `RowParallelLinear` holds columns `[out, in/T]` (input features split): it takes a tp-split
  input and sums the partial products over tp (all-reduce; reduce-scatter to sequence parts
  under sequence parallelism); the bias is added after that sum.
- `VocabParallelEmbedding` holds rows `[V/T, h]` of the table: ids outside this rank's range
  give zero rows, and the partial lookups are summed over tp.

Every rank initialises by drawing the whole canonical (T = 1) weight with the generator state a
T = 1 model would have, then keeping its part, so the same seed gives the same global weights
whatever T (Megatron-core's `use_cpu_initialization` semantics, on the parameter's own device).
The tp group is `tp_group` when given, else parallel_state's tp group when it is initialised,
else none (T = 1). At T = 1 these layers compute exactly what a plain linear / embedding does.
Each layer says how its parameters are split through `tensor_parallel_layouts()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.grad_accumulation import linear
from megatron.core.tensor_parallel.layout import TensorParallelLayout, shard_tensor
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    grad_sum_over_tp,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.overlapped_linear import column_parallel_linear
from megatron.core.tensor_parallel.utils import (
    VocabUtility,
    get_tensor_model_parallel_group_if_none,
    group_rank,
    group_size,
)

if TYPE_CHECKING:
    from megatron.core.fp8.linear import Fp8LinearSlots

InitMethod = Callable[[torch.Tensor], torch.Tensor]


class _TensorParallelModule(torch.nn.Module):
    """The tp group of a layer, its size and rank, and initialisation of split weights."""

    def __init__(self, config: ModelParallelConfig, tp_group: dist.ProcessGroup | None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group

    @property
    def tp_size(self) -> int:
        """Number of ranks the layer is split over (1 without tensor parallelism)."""
        return group_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        """This rank's index in the layer's tp group (0 without tensor parallelism)."""
        return group_rank(self.tp_group)

    def _check_config_tp_size(self) -> None:
        configured = self.config.tensor_model_parallel_size
        if configured != self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: config.tensor_model_parallel_size={configured} but its "
                f"tensor-parallel group has {self.tp_size} rank(s); initialise parallel_state "
                "with the same size or pass a tp_group of that size."
            )

    def _initialize_split(
        self,
        param: torch.Tensor,
        full_shape: tuple[int, ...],
        layout: TensorParallelLayout,
        init_method: InitMethod,
    ) -> None:
        """Draws the whole canonical tensor with `init_method` and copies this rank's part of
        it into `param`, so the generator advances exactly as at T = 1."""
        if self.tp_size == 1:
            init_method(param)
            return
        with torch.no_grad():
            full = torch.empty(full_shape, dtype=param.dtype, device=param.device)
            init_method(full)
            param.copy_(shard_tensor(full, layout, self.tp_rank, self.tp_size))


class _ParallelLinear(_TensorParallelModule):
    """What column- and row-parallel linears share: sizes, parameters and their init."""

    partition_dim: int
    """Dimension of the weight `[out, in]` split over tp."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: InitMethod,
        bias: bool,
        stride: int,
        skip_bias_add: bool,
        is_expert: bool,
        tp_group: dist.ProcessGroup | None,
        skip_weight_param_allocation: bool = False,
    ):
        # Expert layers take their (expert tensor-parallel) group explicitly, never the dense tp.
        if not is_expert:
            tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        super().__init__(config, tp_group)
        if not is_expert:
            self._check_config_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.init_method = init_method
        self.stride = stride
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        shape = [output_size, input_size]
        if shape[self.partition_dim] % (stride * self.tp_size) != 0:
            raise ValueError(
                f"{type(self).__name__}: the split size "
                f"{'output_size' if self.partition_dim == 0 else 'input_size'}="
                f"{shape[self.partition_dim]} is not divisible by stride ({stride}) x "
                f"tensor-parallel size ({self.tp_size}); choose a multiple of "
                f"{stride * self.tp_size}."
            )
        shape[self.partition_dim] //= self.tp_size
        dtype = config.params_dtype
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
        bias_size = shape[0]
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(bias_size, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.fp8: Fp8LinearSlots | None = None
        """FP8 settings when the layer's GEMMs run in FP8 (given by the transformer block
        that holds it, `megatron.core.fp8`); None: high precision."""
        self.reset_parameters()

    @property
    def sequence_parallel(self) -> bool:
        """Whether the layer's outer side is split along the sequence (config's
        `sequence_parallel` with more than one tp rank; never for expert layers, whose tokens
        come from the dispatcher)."""
        return self.config.sequence_parallel and self.tp_size > 1 and not self.is_expert

    @property
    def _fusion(self) -> bool:
        return self.config.gradient_accumulation_fusion

    def _weight_layout(self) -> TensorParallelLayout:
        return TensorParallelLayout(self.partition_dim, self.stride)

    def reset_parameters(self) -> None:
        """Weight: this rank's part of `init_method` applied to the whole `[out, in]` weight;
        bias zero."""
        if self.weight is not None:
            full = (self.output_size, self.input_size)
            self._initialize_split(self.weight, full, self._weight_layout(), self.init_method)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def _resolve_weight(self, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            if self.weight is None:
                raise ValueError(
                    f"{type(self).__name__} was built with skip_weight_param_allocation=True; "
                    "pass the weight to forward()."
                )
            return self.weight
        return weight

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"bias={self.bias is not None}, skip_bias_add={self.skip_bias_add}, "
            f"stride={self.stride}, tp_size={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}"
            + (f", fp8={self.fp8.recipe.format}/{self.fp8.recipe.kind}" if self.fp8 else "")
        )


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's rows (output features) split over tp.

    Args:
        input_size: Size of the last input dimension.
        output_size: Size of the last output dimension of the whole layer (all tp ranks).
        config: Model-parallel config (`params_dtype`, `sequence_parallel`,
            `tensor_model_parallel_size`, which must equal the tp group's size).
        init_method: In-place initialiser, applied to the whole `[output_size, input_size]`
            weight (this rank keeps its part).
        bias: Whether the layer has a bias (split like the output).
        gather_output: All-gather the output over tp (the whole `output_size` on every rank);
            otherwise each rank returns its part.
        stride: The weight's rows are `stride` equal blocks, each split over tp on its own (a
            gated MLP passes 2 so that each rank holds matching parts of both halves).
        skip_bias_add: Return the bias instead of adding it.
        is_expert: An expert's projection: no communication (the token dispatcher does it)
            and no tp group unless `tp_group` is given.
        tp_comm_buffer_name: Transformer Engine's communication-overlap buffer name; unused.
        tp_group: The tp group; None resolves to parallel_state's, else no tp.
        skip_weight_param_allocation: Allocate no weight; forward then takes it (an output
            layer whose weight is the tied embedding table).

    Raises:
        ValueError: `gather_output` with sequence parallelism or with `stride > 1`, sizes not
            divisible, or a config whose tp size disagrees with the group.
    """

    partition_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        skip_bias_add: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        skip_weight_param_allocation: bool = False,
    ):
        del tp_comm_buffer_name  # only Transformer Engine's userbuffers use it
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            stride=stride,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_group=tp_group,
            skip_weight_param_allocation=skip_weight_param_allocation,
        )
        self.gather_output = gather_output
        if gather_output and self.sequence_parallel:
            raise ValueError(
                "ColumnParallelLinear: gather_output=True cannot be combined with "
                "sequence_parallel; keep the output split (gather_output=False)."
            )
        if gather_output and stride > 1 and self.tp_size > 1:
            raise ValueError(
                "ColumnParallelLinear: gather_output=True with stride > 1 would return the "
                "output features in tp-block order, not the canonical one; use stride=1."
            )

    def tensor_parallel_layouts(self) -> dict[str, TensorParallelLayout]:
        """Weight and bias split along their first dimension with the layer's stride."""
        layouts = {}
        if self.weight is not None:
            layouts["weight"] = self._weight_layout()
        if self.bias is not None:
            layouts["bias"] = TensorParallelLayout(0, self.stride)
        return layouts

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Projects the last dimension of `input_`.

        Args:
            input_: [s, b, input_size] (under sequence parallelism [s/T, b, input_size]: this
                rank's part of the sequence); other leading shapes work without it.
            weight: The weight to use instead of the layer's own (required when built with
                `skip_weight_param_allocation`).

        Returns:
            `(output, bias)`: output [..., output_size/T] (the whole `output_size` with
            `gather_output`; the whole sequence under sequence parallelism); bias is the
            un-added bias when `skip_bias_add`, else None.
        """
        weight = self._resolve_weight(weight)
        bias = None if self.skip_bias_add else self.bias
        if self.is_expert and not self.sequence_parallel:
            output = linear(input_, weight, bias, self.fp8, fusion=self._fusion)
        else:
            output = column_parallel_linear(
                input_,
                weight,
                bias,
                self.tp_group,
                self.sequence_parallel,
                self.fp8,
                fusion=self._fusion,
            )
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's columns (input features) split over tp.

    Args:
        input_size: Size of the last input dimension of the whole layer (all tp ranks).
        output_size: Size of the last output dimension.
        config: Model-parallel config (`params_dtype`, `sequence_parallel`,
            `tensor_model_parallel_size`, which must equal the tp group's size).
        init_method: In-place initialiser, applied to the whole `[output_size, input_size]`
            weight (this rank keeps its part).
        bias: Whether the layer has a bias (replicated over tp, added after the sum over tp).
        input_is_parallel: The input is already this rank's part of the last dimension (the
            output of a `ColumnParallelLinear`); otherwise it is split here.
        skip_bias_add: Return the bias instead of adding it.
        stride: The weight's columns are `stride` blocks, each split over tp on its own.
        is_expert: An expert's projection: no communication (the token dispatcher does it)
            and no tp group unless `tp_group` is given.
        tp_comm_buffer_name: Transformer Engine's communication-overlap buffer name; unused.
        tp_group: The tp group; None resolves to parallel_state's, else no tp.

    Raises:
        ValueError: sequence parallelism without `input_is_parallel`, a split input with
            `stride > 1`, sizes not divisible, or a config whose tp size disagrees.
    """

    partition_dim = 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: InitMethod,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ):
        del tp_comm_buffer_name  # only Transformer Engine's userbuffers use it
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            stride=stride,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_group=tp_group,
        )
        self.input_is_parallel = input_is_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel needs input_is_parallel=True (the input "
                "must be the tp-split output of a ColumnParallelLinear)."
            )
        if not input_is_parallel and stride > 1 and self.tp_size > 1:
            raise ValueError(
                "RowParallelLinear: splitting the input here (input_is_parallel=False) does not "
                "match a weight of stride > 1; pass the input already split or use stride=1."
            )

    def tensor_parallel_layouts(self) -> dict[str, TensorParallelLayout]:
        """The weight split along its second dimension; the bias is replicated."""
        return {"weight": self._weight_layout()}

    def forward(
        self, input_: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Projects the last dimension of `input_` and sums the parts over tp.

        Args:
            input_: [..., input_size/T] when `input_is_parallel`, else [..., input_size].
            residual: A tensor of the output's shape added to it last (a transformer layer's
                residual connection), or None. At tp 1 it joins the GEMM where the layer's C++
                node runs (`grad_accumulation.linear`): no kernel, and no autograd node, of its
                own. Not with `skip_bias_add`, whose caller adds the bias after.

        Returns:
            `(output, bias)`: output [..., output_size] (under sequence parallelism
            [s/T, b, output_size]: this rank's part of the sequence); bias is the un-added
            bias when `skip_bias_add` (its gradient summed over tp under sequence
            parallelism), else None.

        Raises:
            ValueError: a `residual` with `skip_bias_add`.
        """
        if residual is not None and self.skip_bias_add:
            raise ValueError(
                "RowParallelLinear: a residual is added after the bias, which skip_bias_add "
                "leaves to the caller; add the residual there too."
            )
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        bias = self.bias
        if self.tp_size == 1 or self.is_expert:
            # Nothing to sum: the bias can join the GEMM, as in a plain linear.
            if self.skip_bias_add:
                return linear(input_, self.weight, fp8=self.fp8, fusion=self._fusion), bias
            output = linear(
                input_, self.weight, bias, self.fp8, fusion=self._fusion, residual=residual
            )
            return output, None
        output = linear(input_, self.weight, fp8=self.fp8, fusion=self._fusion)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
            if bias is not None:
                bias = grad_sum_over_tp(bias, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output, self.tp_group)
        if self.skip_bias_add:
            return output, bias
        if bias is not None:
            output = output + bias
        return (output if residual is None else residual + output), None


class VocabParallelEmbedding(_TensorParallelModule):
    """An embedding table with its rows (the vocabulary) split over tp.

    Args:
        num_embeddings: Vocabulary size (all tp ranks); must be divisible by the tp size.
        embedding_dim: Width of a row.
        init_method: In-place initialiser, applied to the whole `[num_embeddings,
            embedding_dim]` table (this rank keeps its part).
        config: Model-parallel config (`params_dtype`, `tensor_model_parallel_size`).
        reduce_scatter_embeddings: Sum the partial lookups with a reduce-scatter along the
            sequence (sequence parallelism) instead of an all-reduce. As in Megatron-core the
            input is then [b, s] and the output [s/T, b, h] (transposed before the
            reduce-scatter); without it the output has the input's layout plus h.
        tp_group: The tp group; None resolves to parallel_state's, else no tp.

    Raises:
        ValueError: a vocabulary not divisible by the tp size, or a config whose tp size
            disagrees with the group.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod,
        config: ModelParallelConfig,
        reduce_scatter_embeddings: bool = False,
        tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(config, get_tensor_model_parallel_group_if_none(tp_group))
        self._check_config_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.init_method = init_method
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.vocab_range = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, self.tp_rank, self.tp_size
        )
        """`[first, last)` token ids whose rows this rank holds."""
        start, end = self.vocab_range
        self.weight = torch.nn.Parameter(
            torch.empty(end - start, embedding_dim, dtype=config.params_dtype)
        )
        self.reset_parameters()

    def tensor_parallel_layouts(self) -> dict[str, TensorParallelLayout]:
        """The table split along the vocabulary (its first dimension)."""
        return {"weight": TensorParallelLayout(0)}

    def reset_parameters(self) -> None:
        """This rank's rows of `init_method` applied to the whole table."""
        full = (self.num_embeddings, self.embedding_dim)
        self._initialize_split(self.weight, full, TensorParallelLayout(0), self.init_method)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Looks up token ids.

        Args:
            input_: Token ids in [0, num_embeddings), [b, s] with
                `reduce_scatter_embeddings`, any shape otherwise.

        Returns:
            The embeddings, `input_.shape + (embedding_dim,)`; with
            `reduce_scatter_embeddings` [s/T, b, embedding_dim].
        """
        if self.tp_size > 1:
            start, end = self.vocab_range
            outside = (input_ < start) | (input_ >= end)
            output = F.embedding((input_ - start).masked_fill(outside, 0), self.weight)
            output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            output = F.embedding(input_, self.weight)
        if self.reduce_scatter_embeddings:
            output = output.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.tp_size}, "
            f"reduce_scatter_embeddings={self.reduce_scatter_embeddings}"
        )
