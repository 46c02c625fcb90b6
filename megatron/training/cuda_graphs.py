"""The whole training iteration in one CUDA graph (`--cuda-graph-impl full_iteration`, or
`local` with `--cuda-graph-scope full_iteration`), replayed at every iteration.

The device work of one iteration is: every microbatch's forward and backward, the engine's
gradient reduction (the training loop's `compute_gradients`), the optimizer's step on the device
(`MegatronOptimizer.step_on_device`: norm, clipping, skip on a non-finite norm, step) and the
reduction of the reported losses. `GraphedIteration` runs it:

- before each run, outside the graph: the iteration's micro-batches are taken from the data
  iterator and copied into static device buffers (`StaticBatches`), and the learning rates the
  scheduler set are written into the device tensors the step reads;
- the first `--cuda-graph-warmup-steps` iterations run it eagerly on a side stream (they are real
  iterations: they train, count and log), which creates the optimizer's state, the engine's
  buffers and the NCCL communicators before anything is captured;
- the next iteration captures it in a CUDA graph, then every iteration replays the graph;
- after each run the loop reads one small tensor (the losses, the gradient norm, whether the
  step was skipped, the zero count): logging, the NaN check, the schedule and evaluation run on
  the host, outside the graph, as in an eager iteration.

A replay runs only device work: nothing the host does inside the iteration (Python logic,
reading a tensor's value) happens again, so capture fails, with an error that says so, on any
host synchronisation inside it. The flags whose work needs the host inside the iteration are
refused up front (`flag_groups/cuda_graphs.py`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import torch

from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.device_step import DeviceStepResult
from megatron.training.loss_reduction import LossLayout, loss_values, reduce_loss_dicts
from megatron.training.schedules import DataIterator
from megatron.training.utils import print_rank_0

ComputeGradients = Callable[[DataIterator, int], list[dict[str, torch.Tensor]]]
"""`(data_iterator, num_microbatches) -> loss dicts`: every microbatch's forward and backward
and the gradient reduction, leaving the gradients ready for the optimizer step."""

StepResult = tuple[dict[str, float], bool, float, int | None]
"""(losses, update_successful, grad_norm, num_zeros_in_grad), as `MegatronOptimizer.step()`
and the loss averaging give them."""

CAPTURE_FAILED = (
    "Capturing the training iteration in a CUDA graph failed: {error}. The usual cause is code "
    "inside the iteration (the forward step, the loss function, the engine, the optimizer) that "
    "waits for the GPU on the host, which CUDA refuses during a capture: .item(), .tolist(), "
    "float() or printing of a tensor, a NaN/Inf check that branches on a tensor's value (keep "
    "such a check on the device, or apply it to what the loop reads after the step), "
    "torch.cuda.synchronize(), a tensor made from host data, a random-state swap. Fix that "
    "code, or drop --cuda-graph-impl / --cuda-graph-scope to train without graphs."
)


class StaticBatches:
    """The device buffers a graphed iteration reads its micro-batches from: one per microbatch
    and key, made from the first iteration's batches, refilled before every run.

    Args:
        device: where the buffers live.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[dict[str, torch.Tensor]] = []

    def copy_in(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """Copies `batches` into the buffers (queued on the current stream).

        Raises:
            ValueError: a value is not a tensor, or the batches differ in number, keys, shapes
                or dtypes from the first iteration's (a graph replays fixed buffers).
        """
        for index, batch in enumerate(batches):
            for key, value in batch.items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"Micro-batch {index}'s {key!r} is a {type(value).__name__}; a graphed "
                        "iteration replays device buffers, so a batch may hold tensors only."
                    )
        if not self._buffers:
            self._buffers = [
                {key: torch.empty_like(value, device=self.device) for key, value in batch.items()}
                for batch in batches
            ]
        self._check(batches)
        for buffers, batch in zip(self._buffers, batches):
            for key, value in batch.items():
                buffers[key].copy_(value, non_blocking=True)

    def _check(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """Raises unless `batches` have the buffers' number, keys, shapes and dtypes."""

        def shapes(batch: dict[str, torch.Tensor]) -> dict[str, tuple]:
            return {key: (tuple(value.shape), value.dtype) for key, value in batch.items()}

        expected = [shapes(buffers) for buffers in self._buffers]
        given = [shapes(batch) for batch in batches]
        if given != expected:
            raise ValueError(
                f"The iteration's micro-batches ({given}) differ from those the CUDA graph was "
                f"made for ({expected}): a graph replays buffers of fixed number, keys, shapes "
                "and dtypes. Give every iteration batches of the same form, or drop the graph "
                "flags."
            )

    def iterator(self) -> Iterator[dict[str, torch.Tensor]]:
        """The buffers, one micro-batch after another, each in a dict of its own (a forward
        step may pop keys from what it receives)."""
        return iter([dict(buffers) for buffers in self._buffers])


class GraphedIteration:
    """Runs a training iteration's device work eagerly, then through its CUDA graph.

    Args:
        compute_gradients: the forward, backward and gradient reduction of the iteration.
        model: the wrapped model (told after replays that its weights changed).
        optimizer: steps on the device (`step_on_device`).
        args: validated arguments (`cuda_graph_warmup_steps`, `num_microbatches`).
        device: the GPU.
    """

    def __init__(
        self,
        compute_gradients: ComputeGradients,
        model: _BaseDataParallel,
        optimizer: MegatronOptimizer,
        args: argparse.Namespace,
        device: torch.device,
    ):
        self._compute_gradients = compute_gradients
        self._model = model
        self._optimizer = optimizer
        self._warmup_steps = args.cuda_graph_warmup_steps
        self._num_microbatches = args.num_microbatches
        self._batches = StaticBatches(device)
        self._side_stream = torch.cuda.Stream(device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._readout: torch.Tensor | None = None
        self._layout: LossLayout = []
        self._runs = 0
        self._replayed = False

    def __call__(self, data_iterator: DataIterator) -> StepResult:
        """Runs one iteration on the next `num_microbatches` micro-batches of `data_iterator`
        (each taken whole: the forward step must take one item per microbatch; the flags refuse
        a batch-size schedule, which would change their number).

        Raises:
            ValueError: batches of another form (see `StaticBatches.copy_in`).
            RuntimeError: the capture failed (see `CAPTURE_FAILED`).
        """
        self._batches.copy_in([next(data_iterator) for _ in range(self._num_microbatches)])
        self._optimizer.write_learning_rates_to_device()
        if self._runs < self._warmup_steps:
            readout = self._run_on_side_stream()
        else:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            self._replayed = True
            readout = self._readout
        self._runs += 1
        return self._decode(readout.tolist())

    def before_eager_use(self) -> None:
        """Tells the engine that replays changed its weights, which its host-side bookkeeping
        did not see (a replay runs no Python): call it before the model runs outside the graph
        (evaluation, the end of training)."""
        if self._replayed:
            self._model.start_param_sync(force_sync=True)
            self._replayed = False

    def close(self) -> None:
        """Frees the graph (its memory pool, and its hold on the NCCL communicators it
        captured) once training ends or fails; no collective runs (a failure may be this
        rank's alone)."""
        if self._graph is not None:
            self._graph.reset()
        self._graph = self._readout = None

    def _work(self) -> torch.Tensor:
        """The iteration's device work; returns the float64 readout `_decode` reads."""
        loss_dicts = self._compute_gradients(self._batches.iterator(), self._num_microbatches)
        result = self._optimizer.step_on_device()
        losses, self._layout = reduce_loss_dicts(loss_dicts)
        return torch.cat([losses.double(), result.packed()])

    def _decode(self, values: list[float]) -> StepResult:
        """The step's results from the readout `_work` returned, read to the host."""
        width = sum(width for _, width in self._layout)
        return loss_values(self._layout, values[:width]), *DeviceStepResult.unpack(values[width:])

    def _run_on_side_stream(self) -> torch.Tensor:
        """An eager run, on a side stream as capture's warm-up wants (so that nothing lazily
        made for the iteration is tied to the default stream)."""
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            readout = self._work()
        torch.cuda.current_stream().wait_stream(side)
        return readout

    def _capture(self) -> None:
        """Captures `_work` in the graph (the next `replay()` runs this iteration).

        Raises:
            RuntimeError: the capture failed (see `CAPTURE_FAILED`).
        """
        print_rank_0(
            f"> capturing the training iteration in a CUDA graph after {self._runs} eager "
            "iteration(s)"
        )
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the data loader's threads may pin memory meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                readout = self._work()
        except RuntimeError as error:
            raise RuntimeError(CAPTURE_FAILED.format(error=error)) from error
        self._graph, self._readout = graph, readout
