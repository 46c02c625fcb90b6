"""What the training loop does around its iterations for operations: the profiler, manual
garbage collection, CUDA memory history and the allocator cache (Megatron-LM's `train()`).

`TrainingOperations` is entered around the loop and told where each iteration starts and ends
and when an evaluation runs:

- `--profile --use-pytorch-profiler`: a `torch.profiler` run with Megatron-LM's schedule (wait
  `--profile-step-start` - 1 steps, warm up 1, record `--profile-step-end` - start), stepped
  before each iteration, so the trace holds iterations start to end - 1; it is written when the
  recording ends (or when training stops first) to
  `<--tensorboard-dir>/../torch_profile/rank-<rank>.json.gz` (`./torch_profile/` without a
  TensorBoard directory), a Chrome trace that Perfetto and TensorBoard open.
- `--profile` alone: an nsys capture range, `cudaProfilerStart` before iteration start + 1 and
  `cudaProfilerStop` after iteration end (Megatron-LM's numbering, one later than the
  torch.profiler range), with `torch.autograd.profiler.emit_nvtx` ranges under
  `--record-shapes`. It needs CUDA.
- Only the `--profile-ranks` profile (every rank when none are given).
- `--manual-gc`: the automatic collector is off during training; a full collection runs at the
  start, every `--manual-gc-interval` iterations, and before each evaluation (a young-generation
  one after it) unless `--no-manual-gc-eval`. The collector is turned back on when training ends.
- `--record-memory-history`: CUDA allocations are recorded on the profiled ranks and a snapshot
  dumped to `<base>_<rank><ext>` of `--memory-snapshot-path` at each log line.
- `--empty-unused-memory-level`: `empty_unused_memory()` is called after the forward-backward
  (level 1) and after the optimizer step (level 2); without CUDA it does nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

TORCH_PROFILE_DIR = "torch_profile"
"""The folder of torch.profiler traces, beside `--tensorboard-dir` (Megatron-LM's place)."""


def torch_profile_dir(args: argparse.Namespace) -> str:
    """Where `--use-pytorch-profiler` writes its traces."""
    if args.tensorboard_dir is None:
        # Megatron-LM formats None into the path ("None/../torch_profile"): the same folder.
        return TORCH_PROFILE_DIR
    return os.path.join(os.path.dirname(os.path.abspath(args.tensorboard_dir)), TORCH_PROFILE_DIR)


def empty_unused_memory(args: argparse.Namespace, level: int) -> None:
    """Releases the CUDA allocator's unused cached blocks when `--empty-unused-memory-level` is
    at least `level` (fewer fragmentation-induced out-of-memory errors, for some speed)."""
    if args.empty_unused_memory_level >= level and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class TrainingOperations:
    """The profiler, garbage collection and memory history of one training run.

    Args:
        args: validated arguments (the profiling and garbage-collection flags;
            `validate_profiling` refused the CUDA-only ones on a run without GPUs).
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        selected = not args.profile_ranks or self.rank in args.profile_ranks
        self.profiling = args.profile and selected
        self.recording_memory = args.record_memory_history and selected
        self._profiler: torch.profiler.profile | None = None
        self._nvtx: contextlib.AbstractContextManager | None = None
        self._nsys_running = False
        self._disabled_gc = False

    def __enter__(self) -> TrainingOperations:
        args = self.args
        if args.manual_gc and gc.isenabled():
            # Collections then happen at the same iterations on every rank, not whenever one
            # rank's allocation count crosses a threshold (a straggler for all the others).
            gc.disable()
            self._disabled_gc = True
        if args.manual_gc:
            gc.collect()
        if self.recording_memory:
            torch.cuda.memory._record_memory_history()
        if self.profiling and args.use_pytorch_profiler:
            start, end = args.profile_step_start, args.profile_step_end
            self._profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start
                ),
                on_trace_ready=self._write_trace,
                record_shapes=args.pytorch_profiler_collect_shapes,
                with_stack=args.pytorch_profiler_collect_callstack,
            )
            self._profiler.start()
        return self

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        directory = torch_profile_dir(self.args)
        os.makedirs(directory, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(directory, f"rank-{self.rank}.json.gz"))

    def before_iteration(self, iteration: int) -> None:
        """Called before iteration `iteration` (numbered from 1) runs."""
        if self._profiler is not None:
            self._profiler.step()
        elif self.profiling and iteration - 1 == self.args.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self._nsys_running = True
            if self.args.record_shapes:
                self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
                self._nvtx.__enter__()

    def after_iteration(self, iteration: int, last: bool) -> None:
        """Called after iteration `iteration` and its log line (`last`: the loop's last
        iteration, which is always logged)."""
        args = self.args
        logged = last or iteration % args.log_interval == 0
        if self.profiling and iteration == args.profile_step_end:
            self._stop_profiling()
        if logged and self.recording_memory:
            base, extension = os.path.splitext(args.memory_snapshot_path)
            torch.cuda.memory._dump_snapshot(f"{base}_{self.rank}{extension}")
        if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Wraps an evaluation: with `--manual-gc` (and `--manual-gc-eval`, the default), a
        full collection before it and a young-generation one after it (its own garbage)."""
        collect = self.args.manual_gc and self.args.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)

    def _stop_profiling(self) -> None:
        if self._profiler is not None:
            # Writes the trace if the schedule's recording has not ended yet.
            self._profiler.stop()
            self._profiler = None
        if self._nsys_running:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self._nsys_running = False
            if self._nvtx is not None:
                self._nvtx.__exit__(None, None, None)
                self._nvtx = None

    def __exit__(self, *exc_info: object) -> None:
        self._stop_profiling()
        if self.recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
        if self._disabled_gc:
            gc.enable()
