"""The distributed optimizer's parameter all-gather in FP8 (`fp8_param_gather`, DDP engine).

With `use_distributed_optimizer` each rank steps its rows of every parameter (`param_shard`) and
the engine all-gathers the other rows after the step (`BucketShards`). With `fp8_param_gather`
the trainable weights of linear layers that compute in FP8 (`megatron.core.fp8`) travel as E4M3
bytes with one scale per tensor (per expert for the stacked weights of MoE experts, whose rows
are the experts) instead, as Megatron-LM's do (its parameters are then Transformer Engine FP8
tensors). Megatron-FSDP's `Fp8ComputeWeights` does the work, as for its ZeRO-1/2:

- each rank takes the absolute maximum of its rows of each such weight (what the optimizer wrote:
  the fp32 main shard rounded to the parameter's dtype); one MAX all-reduce for all of the
  engine's FP8 weights (one per data-parallel group: the dense one, and the expert one for
  experts with groups of their own) gives each whole tensor's amax and the scale `448 / amax`
  (`fp8_gather.Fp8Refresh`);
- each rank casts its rows to E4M3 with that scale, and each bucket's FP8 rows are all-gathered
  in one collective: one byte per element where bf16 moves two;
- the FP8 linear layers compute with the gathered bytes (`fp8_weight_of`, answered here).

The bytes and scales are those of the cast of the whole weight that an FP8 linear layer makes
without the option, so training is the same bit for bit: only what travels changes.

What the parameter itself holds (every rank still holds the whole model): on this rank's rows,
what the optimizer wrote; on the rows other ranks own, the dequantised FP8 weight
(`fp8 * scale_inv`, rounded to the parameter's dtype), i.e. the values the FP8 layers compute
with, not stale ones. A row's exact value is held by the rank that steps it only, so the engine's
`state_dict()` shows these weights as `Shard(0)` DTensors of each rank's rows: checkpoints hold
the exact weights, as without the option, and loading them gathers them whole. That is also why
the weights must not be fp32: an fp32 parameter's rows are the distributed optimizer's main
weights themselves, which the FP8 values must not replace (the engine refuses it).

A parameter written outside the optimizer's step (a load, `copy_`, `broadcast_params`) holds the
whole new weight on every rank: until the next gather the FP8 layers cast it whole (the cache of
`fp8_weight_of`), as without the option. Such writes are read from the parameter's version
counter and address, recorded after each gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.dbuffer import ShardLayout
from megatron.core.distributed.fsdp.fp8_gather import Fp8ComputeWeights
from megatron.core.fp8.linear import computes_in_fp8
from megatron.core.fp8.tensor import Fp8Tensor
from megatron.core.fp8.weights import Fp8ExpertWeights, Fp8Weight, register_fp8_weight


def fp8_gathered_weights(module: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """The trainable parameters of `module` that every module registering them uses as the
    weight of an FP8 linear layer, with their names: what `fp8_param_gather` gathers in FP8."""
    in_fp8: dict[torch.nn.Parameter, bool] = {}
    for submodule in module.modules():
        for name, param in submodule.named_parameters(recurse=False):
            in_fp8[param] = in_fp8.get(param, True) and computes_in_fp8(submodule, name)
    names = {param: name for name, param in module.named_parameters()}
    return {p: names[p] for p, fp8 in in_fp8.items() if fp8 and p.requires_grad}


class Fp8ParamGather:
    """The FP8 all-gather of one bucket's FP8 weights of one dtype (module docstring).

    Args:
        params: the weights, all of one dtype (bf16 or fp16), in the bucket's order.
        names: their names, for messages.
        group: the data-parallel group the bucket is sharded over.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        group: dist.ProcessGroup,
    ):
        self.params = tuple(params)
        layout = ShardLayout([p.shape for p in params], group.size())
        rank = group.rank()
        self.weights = Fp8ComputeWeights(
            layout,
            rank,
            self.params,
            names,
            model_dtype=self.params[0].dtype,
            transient=False,
            amax_group=group if group.size() > 1 else None,
            gather_group=group,
            device=self.params[0].device,
        )
        self._own_rows = []
        for i in range(len(layout)):
            start = rank * layout.chunk_rows[i]
            self._own_rows.append(slice(start, start + layout.valid_rows(i, rank)))
        self._index = {id(param): i for i, param in enumerate(self.params)}
        # Each parameter's (version, address) once the last gather wrote it; None: the gathered
        # bytes do not follow the parameter (never gathered, or written without a version).
        self._gathered_at: list[tuple[int, int] | None] = [None] * len(self.params)
        # Replaces the registration `Fp8ComputeWeights` made: the gathered bytes answer only
        # while the parameter holds what the gather left.
        for param in self.params:
            register_fp8_weight(param, self.weight_of)

    def weight_of(self, param: torch.nn.Parameter) -> Fp8Weight | Fp8ExpertWeights | None:
        """The gathered FP8 weight of `param`; None where `param` was written since the last
        gather (`fp8_weight_of` then casts the parameter itself)."""
        index = self._index[id(param)]
        if self._gathered_at[index] != _written(param):
            return None
        return self.weights.weight_of(param)

    def start_refresh(self) -> Fp8ComputeWeights:
        """This rank's amax of its rows of each weight, for `Fp8Refresh`, which sets the
        scales and casts the rows (with other buckets', in one launch where it can)."""
        self.weights.start_refresh(
            [param.detach()[rows] for param, rows in zip(self.params, self._own_rows)]
        )
        return self.weights

    @torch.no_grad()
    def finish_refresh(self, comm: Collectives) -> None:
        """All-gathers this rank's rows, cast to FP8 by `Fp8Refresh` (one collective), then
        writes the dequantised weight into the rows other ranks own."""
        self.weights.finish_refresh(comm)
        for param, rows in zip(self.params, self._own_rows):
            gathered = self.weights.weight_of(param)
            others = (slice(0, rows.start), slice(rows.stop, param.shape[0]))
            for part in others:
                if part.stop > part.start:
                    param.detach()[part].copy_(_dequantized_rows(gathered, part))
        self._gathered_at = [_written(param) for param in self.params]

    def forget(self) -> None:
        """The parameters were written where no version counter saw it: until the next gather,
        the FP8 layers cast them whole."""
        self._gathered_at = [None] * len(self.params)


def _dequantized_rows(gathered: Fp8Weight | Fp8ExpertWeights, rows: slice) -> torch.Tensor:
    """Rows `rows` of a gathered FP8 weight in fp32: of stacked expert weights, the experts
    `rows`, each with its own scale."""
    if isinstance(gathered, Fp8ExpertWeights):
        experts = range(rows.start, rows.stop)
        return torch.stack([gathered[index].tensor.dequantize() for index in experts])
    return Fp8Tensor(gathered.tensor.data[rows], gathered.tensor.scale_inv).dequantize()


def _written(param: torch.nn.Parameter) -> tuple[int, int]:
    """What changes when `param` is written in place (its version) or swapped (its address)."""
    return param._version, param.data_ptr()
