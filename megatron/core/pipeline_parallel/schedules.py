"""Megatron-LM's forward-backward schedules: every microbatch of one iteration through every
pipeline stage, forward, loss on the last stage and (unless evaluating) backward.

`get_forward_backward_func()` picks the schedule as Megatron-core's does: no pipelining with one
stage, 1F1B (`forward_backward_pipelining_without_interleaving`) with several, the interleaved
schedule (`forward_backward_pipelining_with_interleaving`) with several model chunks per rank
(virtual stages). The order of passes and the transfers between stages come from
`schedule_order.communication_plans`; this module runs them: each stage's input activation
arrives from the previous stage and its output goes to the next, the gradient of the output
comes back and that of the input goes on. Only the last stage computes the loss.

The engines' gradient accumulation spans the iteration: every pass of a model chunk runs in its
engine's accumulation scope, and only the backward of its last microbatch is the step's last
(outside `no_sync()`, for both engines: `microbatch_loss.accumulation_scope`), so the
once-per-step reductions run once per chunk, right after its last backward.

With `config.overlap_p2p_comm` (Megatron-LM's `--no-overlap-p2p-communication` turns it off) the
interleaved schedule overlaps its transfers with the passes: each exchange is issued where the
plan puts it, in the same order (so every send meets the same receive), but a rank waits for a
received tensor only when the pass that consumes it starts (for the whole exchange where the
backend coalesces it, as NCCL does), and for its sends at the end of the iteration, so
transfers run while the passes between compute. Results are the same either way.

The script's `forward_step_func(data_iterator, model) -> (output_tensor, loss_func)` runs
unchanged on every stage: a stage without the embedding (`pre_process=False`) reads its input
from `set_input_tensor`, which the schedule calls before each forward; on every stage but the
last, `output_tensor` is the hidden states and `loss_func` is not called. With a single data
iterator and several chunks per rank, each microbatch is read once and handed to every chunk.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.microbatch_loss import accumulation_scope, microbatch_loss
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, PendingExchange
from megatron.core.pipeline_parallel.schedule_order import (
    Action,
    Pass,
    Payload,
    check_interleaving,
    communication_plans,
)
from megatron.core.tensor_parallel.utils import group_size

Report = dict[str, torch.Tensor]
ForwardStepFunc = Callable[[Iterator[Any], torch.nn.Module], tuple[torch.Tensor, Callable]]
ScheduleResult = tuple[list[Report], torch.Tensor | None]
"""Each microbatch's reported losses (on the last stage; empty elsewhere), and the token count
`loss_func` returned summed over this rank's microbatches (None: none returned one)."""


def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None) -> Callable:
    """The schedule for `pp_size` stages of `vp_size` chunks each (None, None: parallel_state's
    pipeline size and no virtual stages), Megatron-core's rule: no pipelining for one stage,
    interleaved with virtual stages, else 1F1B."""
    if pp_size is None and vp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size > 1:
        if vp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def forward_backward_no_pipelining(**kwargs: Any) -> ScheduleResult:
    """Every microbatch's forward, loss and backward in turn on one stage (arguments as
    `forward_backward_pipelining_with_interleaving`'s; `pp_group` is not read)."""
    kwargs["pp_group"] = None
    return _run(**kwargs)


def forward_backward_pipelining_without_interleaving(**kwargs: Any) -> ScheduleResult:
    """1F1B over the pipeline group: warm-up forwards, one forward and one backward at a time,
    cool-down backwards (arguments as `forward_backward_pipelining_with_interleaving`'s, with
    one model chunk)."""
    model = kwargs["model"]
    if isinstance(model, (list, tuple)) and len(model) != 1:
        raise ValueError(
            f"forward_backward_pipelining_without_interleaving got {len(model)} model chunks; "
            "pass one, or use forward_backward_pipelining_with_interleaving for virtual stages."
        )
    return _run(**kwargs)


def forward_backward_pipelining_with_interleaving(**kwargs: Any) -> ScheduleResult:
    """The interleaved 1F1B schedule: several model chunks (virtual stages) per rank.

    Keyword Args:
        forward_step_func: `(data_iterator, model) -> (output_tensor, loss_func)`.
        data_iterator: this rank's micro-batches: one iterator (each microbatch is read once and
            given to every chunk), or Megatron-LM's list of one per chunk.
        model: the wrapped model chunks of this rank, virtual stage order (a module: one).
        num_microbatches: M, the microbatches of the iteration.
        seq_length: the sequence length of the micro-batches.
        micro_batch_size: sequences per micro-batch.
        forward_only: forwards only (evaluation): no backward, no accumulation scopes.
        scale_loss: multiplies each loss before backward (fp16's loss scale).
        calculate_per_token_loss: backpropagate summed losses (see `microbatch_loss`).
        cp_group: the context-parallel group (None: none).
        tp_group: the tensor-parallel group (its size divides the boundary tensors' sequence
            under sequence parallelism; None: the model config's `tensor_model_parallel_size`).
        pp_group: the pipeline group (None: parallel_state's).
        microbatch_group_size_per_vp_stage: microbatches per group of the interleaved schedule
            (None: the pipeline size).

    Returns:
        Each microbatch's reported losses (last stage only) and this rank's token count.
    """
    return _run(**kwargs)


def _run(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | list[Iterator[Any]],
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    forward_only: bool = False,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    calculate_per_token_loss: bool = False,
    cp_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> ScheduleResult:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if pp_group is None and parallel_state.model_parallel_is_initialized():
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = group_size(pp_group)
    pp_rank = 0 if pp_size == 1 else pp_group.rank()
    num_chunks = len(chunks)
    config = chunks[0].config
    if pp_size == 1 and num_chunks > 1:
        raise ValueError(
            f"{num_chunks} model chunks on a single pipeline stage: virtual stages need "
            "--pipeline-model-parallel-size > 1."
        )
    group = microbatch_group_size_per_vp_stage or pp_size
    if num_chunks > 1:
        check_interleaving(pp_size, num_microbatches, group)
    plan = communication_plans(pp_size, num_microbatches, num_chunks, group, forward_only)[pp_rank]
    communicator = None
    if pp_size > 1:
        if seq_length is None or micro_batch_size is None:
            raise ValueError(
                "Pipeline schedules need seq_length and micro_batch_size: the stages exchange "
                "[seq_length, micro_batch_size, hidden_size] tensors."
            )
        seq = seq_length // group_size(cp_group)
        if config.sequence_parallel:
            seq //= config.tensor_model_parallel_size if tp_group is None else tp_group.size()
        dtype = config.pipeline_dtype or config.params_dtype
        device = next(chunks[0].parameters()).device
        if device.type == "meta":  # pragma: no cover - wrapped models hold real storage
            raise ValueError("pipeline stages on the meta device cannot exchange tensors.")
        communicator = P2PCommunicator(
            pp_group, (seq, micro_batch_size, config.hidden_size), dtype, device
        )
    # As Megatron-LM: only the interleaved schedule overlaps its transfers.
    overlap = config.overlap_p2p_comm and num_chunks > 1
    runner = _PipelineRun(
        chunks,
        _MicrobatchData(data_iterator, num_chunks),
        forward_step_func,
        num_microbatches,
        forward_only,
        scale_loss,
        calculate_per_token_loss,
        cp_group,
        pp_size,
        pp_rank,
    )
    issued: list[PendingExchange] = []
    for step in plan:
        if communicator is not None and step.exchange:
            exchange = communicator.post(
                (t, runner.to_send.pop(_key(t)) if t.send else None) for t in step.exchange
            )
            receives = [t for t in step.exchange if not t.send]
            for index, transfer in enumerate(receives):
                runner.pending[_key(transfer)] = (exchange, index)
            if overlap:
                # Only exchanges with operations left: a completed one would keep its sent
                # tensors alive to the end of the iteration.
                issued = [pending for pending in issued if not pending.poll()]
                issued.append(exchange)
            else:
                exchange.wait()
        if step.action is not None:
            runner.run(step.action)
    for exchange in issued:
        exchange.wait()
    return runner.loss_dicts, runner.num_tokens


def _key(transfer) -> tuple[Payload, int, int]:
    return (transfer.payload, transfer.microbatch, transfer.chunk)


class _MicrobatchData:
    """Hands each forward its micro-batch: from the chunk's own iterator (a list of one per
    chunk), or read once from a shared iterator and given to every chunk (a shallow copy each,
    so a forward step that pops keys leaves the others theirs)."""

    def __init__(self, data_iterator: Iterator[Any] | list[Iterator[Any]], num_chunks: int):
        self._per_chunk = data_iterator if isinstance(data_iterator, list) else None
        if self._per_chunk is not None and len(self._per_chunk) != num_chunks:
            raise ValueError(
                f"{len(self._per_chunk)} data iterators for {num_chunks} model chunks; pass one "
                "per chunk, or a single iterator."
            )
        self._shared = data_iterator
        self._num_chunks = num_chunks
        self._cache: dict[int, Any] = {}
        self._uses: dict[int, int] = {}

    def iterator_for(self, microbatch: int, chunk: int) -> Iterator[Any]:
        if self._per_chunk is not None:
            return self._per_chunk[chunk]
        if self._shared is None:
            return iter(())
        if microbatch not in self._cache:
            self._cache[microbatch] = next(self._shared)
        batch = self._cache[microbatch]
        self._uses[microbatch] = self._uses.get(microbatch, 0) + 1
        if self._uses[microbatch] == self._num_chunks:
            del self._cache[microbatch], self._uses[microbatch]
        return iter([copy.copy(batch)])


class _PipelineRun:
    """The state of one iteration on one rank: the tensors between passes."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        data: _MicrobatchData,
        forward_step_func: ForwardStepFunc,
        num_microbatches: int,
        forward_only: bool,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None,
        calculate_per_token_loss: bool,
        cp_group: dist.ProcessGroup | None,
        pp_size: int,
        pp_rank: int,
    ):
        self.chunks = chunks
        self.data = data
        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.scale_loss = scale_loss
        self.calculate_per_token_loss = calculate_per_token_loss
        self.cp_group = cp_group
        self.pp_size = pp_size
        self.pp_rank = pp_rank
        # The exchange each received tensor arrives by (and its index there), until taken.
        self.pending: dict[tuple, tuple[PendingExchange, int]] = {}
        self.to_send: dict[tuple, torch.Tensor] = {}
        # Per (microbatch, chunk) between its forward and its backward.
        self._inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.loss_dicts: list[Report] = []
        self.num_tokens: torch.Tensor | None = None

    def _is_first(self, chunk: int) -> bool:
        return self.pp_rank == 0 and chunk == 0

    def _is_last(self, chunk: int) -> bool:
        return self.pp_rank == self.pp_size - 1 and chunk == len(self.chunks) - 1

    def _take(self, key: tuple) -> torch.Tensor:
        """A received tensor, once its receive completed."""
        exchange, index = self.pending.pop(key)
        return exchange.take(index)

    def run(self, action: Action) -> None:
        if action.kind is Pass.FORWARD:
            self._forward(action.microbatch, action.chunk)
        else:
            self._backward(action.microbatch, action.chunk)

    def _scope(self, chunk: int, is_last: bool):
        if self.forward_only:
            return contextlib.nullcontext()
        return accumulation_scope(self.chunks[chunk], is_last)

    def _forward(self, microbatch: int, chunk: int) -> None:
        model = self.chunks[chunk]
        input_tensor = None
        if not self._is_first(chunk):
            input_tensor = self._take((Payload.ACTIVATION, microbatch, chunk))
            if not self.forward_only:
                input_tensor.requires_grad_()
        target = _unwrapped(model)
        if input_tensor is not None or hasattr(target, "set_input_tensor"):
            target.set_input_tensor(input_tensor)
        with self._scope(chunk, is_last=False):
            output, loss_func = self.forward_step_func(
                self.data.iterator_for(microbatch, chunk), model
            )
        if self._is_last(chunk):
            result = microbatch_loss(
                loss_func(output),
                self.num_microbatches,
                self.forward_only,
                self.calculate_per_token_loss,
                self.cp_group,
            )
            self.loss_dicts.append(result.report)
            if result.num_tokens is not None:
                tokens = result.num_tokens
                self.num_tokens = tokens if self.num_tokens is None else self.num_tokens + tokens
            output = result.loss
        else:
            self.to_send[(Payload.ACTIVATION, microbatch, chunk)] = output.detach()
        if not self.forward_only:
            self._inputs[(microbatch, chunk)] = input_tensor
            self._outputs[(microbatch, chunk)] = output

    def _backward(self, microbatch: int, chunk: int) -> None:
        input_tensor = self._inputs.pop((microbatch, chunk))
        output = self._outputs.pop((microbatch, chunk))
        if self._is_last(chunk):
            grad = None
            if self.scale_loss is not None:
                output = self.scale_loss(output)
        else:
            grad = self._take((Payload.GRADIENT, microbatch, chunk))
        # A chunk's backwards run in microbatch order: its last ends its accumulation.
        with self._scope(chunk, is_last=microbatch == self.num_microbatches - 1):
            torch.autograd.backward(output, grad_tensors=grad)
        if not self._is_first(chunk):
            self.to_send[(Payload.GRADIENT, microbatch, chunk)] = input_tensor.grad


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a data-parallel wrapper (which keeps it as `.module`)."""
    return getattr(model, "module", model)
