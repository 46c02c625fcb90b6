"""The one place Megatron-FSDP issues collectives from.

Every all-gather, reduce-scatter and all-reduce of the engine goes through `Collectives`, so the
policy of how they run lives here: which reduction op averages (NCCL has `AVG`, gloo does not;
nor does any when the average is over more ranks than the group's, as for expert gradients, see
`expert_parallel.py`), and skipping communication on single-rank groups. The calls are
synchronous on the current stream; `FsdpContext` picks that stream (the all-gather or
reduce-scatter stream on GPU), so the same code runs on CPU and GPU.

Weights are gathered and gradients reduce-scattered tensor by tensor, straight into and out of the
whole tensors (`all_gather_tensors`, `reduce_scatter_tensors`: one NCCL group launch each): going
through one flat shard-major buffer would need a packing or unpacking kernel, which moves every
byte once more, in strided blocks that copy at half the bandwidth of whole tensors on 2 ranks
(`tools/benchmark_collective_host.py`). With `use_symm_mem` the compute weights lie in NCCL
symmetric windows (`symmetric_memory.py`), so the same grouped all-gather runs NCCL's symmetric
kernel.

The process-group methods are called directly rather than through `torch.distributed`'s
wrappers, whose argument checks cost as much host time as the launch itself; these calls run per
unit and step. Each is synchronous on the current stream, as the wrappers are without
`async_op`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions

from megatron.core.multi_tensor import add_tensors_, copy_tensors_
from megatron.core.utils import all_gather_single


class Collectives:
    """Issues the engine's collectives; outputs are preallocated (`out=` style)."""

    def __init__(self):
        self._averages: dict[dist.ProcessGroup, dist.ReduceOp] = {}

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """Concatenates every rank's `input` (in group-rank order) into `output`, in
        `output`'s dtype.

        Always in place: `input` is first copied (and cast) into this rank's slot of `output`,
        so a cast needs no buffer of its own.
        """
        if group.size() == 1:
            output.copy_(input)
            return
        own = _own_block(output, group)
        own.copy_(input)
        all_gather_single(output, own, group=group)

    def all_gather_tensors(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        own_blocks: list[torch.Tensor] | None = None,
        inputs_in_place: bool = False,
    ) -> None:
        """Gathers every rank's `inputs[i]` into `outputs[i]` (in group-rank order), in the
        outputs' dtype, as one grouped collective: NCCL launches one kernel for all of them.

        In place, as `all_gather`: the inputs are first copied (and cast) into this rank's block
        of each output, in few launches (`copy_tensors_`), so a cast needs no buffer of its own.

        Args:
            outputs: 1-D, N equal blocks each.
            inputs: one block's worth of elements each, in any dtype.
            group: the ranks to gather from.
            own_blocks: this rank's block of each output, where the caller keeps them (views
                of persistent storage); made here otherwise.
            inputs_in_place: the caller has copied the inputs into its blocks already (in one
                launch, `megatron.core.fusions.segment_copy`).
        """
        if own_blocks is None:
            own_blocks = [_own_block(output, group) for output in outputs]
        if not inputs_in_place:
            copy_tensors_(own_blocks, inputs)
        if group.size() > 1:
            _all_gather_coalesced(outputs, own_blocks, group=group)

    def reduce_scatter_tensors(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        average: bool,
        divisor: int | None = None,
        accumulate: bool = False,
    ) -> None:
        """Reduces each of `inputs` (1-D, N equal blocks) over `group` into `outputs[i]`, this
        rank's block of it, as one grouped collective: NCCL launches one kernel for all.
        `average` divides the sum by `divisor` (default: the group's size); fp16 inputs are
        divided in place first where the collective sums (`_average_first`).

        With `accumulate` (a group of one rank only) the reduction is added to `outputs`: the
        inputs, which are the reduction, are averaged in place and added, with no copy.

        Raises:
            ValueError: `accumulate` over a group of several ranks.
        """
        divisor = divisor or group.size()
        if accumulate:
            if group.size() != 1:
                raise ValueError(
                    f"reduce_scatter_tensors(accumulate=True) adds in place over one rank only, "
                    f"but the group has {group.size()} ranks."
                )
            _finish_average(inputs, dist.ReduceOp.SUM, divisor, average)
            add_tensors_(outputs, inputs)
            return
        if group.size() == 1:
            copy_tensors_(outputs, inputs)
            _finish_average(outputs, dist.ReduceOp.SUM, divisor, average)
            return
        op = self._op(group, average, divisor)
        average = _average_first(inputs, op, divisor, average)
        _reduce_scatter_coalesced(outputs, inputs, op=op, group=group)
        _finish_average(outputs, op, divisor, average)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        average: bool,
        divisor: int | None = None,
    ) -> None:
        """Reduces `input` over `group` and leaves this rank's 1/N slice of it in `output`;
        `average` divides the sum by `divisor` (default: the group's size; fp16 inputs in place
        first, `_average_first`)."""
        divisor = divisor or group.size()
        if group.size() == 1:
            output.copy_(input)
            _finish_average([output], dist.ReduceOp.SUM, divisor, average)
            return
        op = self._op(group, average, divisor)
        average = _average_first([input], op, divisor, average)
        _reduce_scatter_single(output, input, op=op, group=group)
        _finish_average([output], op, divisor, average)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        average: bool,
        divisor: int | None = None,
    ) -> None:
        """Reduces `tensor` over `group` in place; `average` divides the sum by `divisor`
        (default: the group's size)."""
        divisor = divisor or group.size()
        if group.size() == 1:
            _finish_average([tensor], dist.ReduceOp.SUM, divisor, average)
            return
        op = self._op(group, average, divisor)
        average = _average_first([tensor], op, divisor, average)
        dist.all_reduce(tensor, op=op, group=group)
        _finish_average([tensor], op, divisor, average)

    def all_reduce_max(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Replaces `tensor` in place by its elementwise maximum over `group`."""
        if group.size() > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)

    def _op(self, group: dist.ProcessGroup, average: bool, divisor: int) -> dist.ReduceOp:
        if not average or divisor != group.size():
            return dist.ReduceOp.SUM
        op = self._averages.get(group)
        if op is None:  # looked up once per group: `get_backend` costs a few us per call
            op = dist.ReduceOp.AVG if dist.get_backend(group) == "nccl" else dist.ReduceOp.SUM
            self._averages[group] = op
        return op


# torch 2.13 renamed the process-group collectives too; older releases have the old names.
_ALL_GATHER_COALESCED, _REDUCE_SCATTER_SINGLE, _REDUCE_SCATTER_COALESCED = (
    new if hasattr(dist.ProcessGroup, new) else old
    for new, old in (
        ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
        ("reduce_scatter_single", "_reduce_scatter_base"),
        ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
    )
)


def _own_block(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's block of `tensor`, 1-D and N equal blocks in group-rank order."""
    return tensor.view(group.size(), -1)[group.rank()]


def _all_gather_coalesced(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], *, group: dist.ProcessGroup
) -> None:
    """The grouped all-gather (the process-group method torch's own `_coalescing_manager`
    uses; `torch.distributed` has no public call for it)."""
    options = AllgatherOptions()
    options.asyncOp = False
    _wait(getattr(group, _ALL_GATHER_COALESCED)(outputs, inputs, options))


def _reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, *, op: dist.ReduceOp, group: dist.ProcessGroup
) -> None:
    _wait(getattr(group, _REDUCE_SCATTER_SINGLE)(output, input, _reduce_scatter_options(op)))


def _reduce_scatter_coalesced(
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    *,
    op: dist.ReduceOp,
    group: dist.ProcessGroup,
) -> None:
    _wait(getattr(group, _REDUCE_SCATTER_COALESCED)(outputs, inputs, _reduce_scatter_options(op)))


def _reduce_scatter_options(op: dist.ReduceOp) -> ReduceScatterOptions:
    options = ReduceScatterOptions()
    options.reduceOp = op
    options.asyncOp = False
    return options


def _wait(work: dist.Work | None) -> None:
    """Orders the current stream after a synchronous collective, as `torch.distributed`'s
    wrappers do (gloo: waits for it); a build that ran it on the current stream returns none."""
    if work is not None:
        work.wait()


def _average_first(
    inputs: list[torch.Tensor], op: dist.ReduceOp, divisor: int, average: bool
) -> bool:
    """Divides fp16 inputs by `divisor` before a SUM that is to average them, and returns
    whether the SUM's result still needs dividing. An fp16 sum over N ranks overflows where
    the average does not (loss-scaled gradients sit near the top of fp16's range), so a step
    other engines take would be skipped as overflowed; Megatron-LM scales gradients before
    their collective for this. Other dtypes are divided after, on the smaller output."""
    if average and op != dist.ReduceOp.AVG and divisor != 1 and inputs[0].dtype == torch.float16:
        torch._foreach_div_(inputs, divisor)
        return False
    return average


def _finish_average(
    tensors: list[torch.Tensor], op: dist.ReduceOp, divisor: int, average: bool
) -> None:
    """Divides SUMs into averages over `divisor` ranks where `op` could not average itself."""
    if average and op != dist.ReduceOp.AVG and divisor != 1:
        torch._foreach_div_(tensors, divisor)
