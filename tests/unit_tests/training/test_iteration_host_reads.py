"""CPU, 2 gloo ranks: an iteration's microbatches read nothing on the host.

`compute_gradients` is the part of a training iteration that runs once per microbatch: every
microbatch's data, forward and backward, its losses kept for the loop, then the gradients'
reduction. A full-iteration CUDA graph captures it (`megatron.training.cuda_graphs`), and the
eager loop runs it between its once-per-iteration reads of the losses and the step, so a host
read in it would cost a GPU drain per microbatch (or per layer) and fail the capture. Here it
runs, from the second iteration on (the first creates state: optimizer moments, the engines'
buffers), under `no_host_reads()` in `pretrain_gpt.py`'s own loop with 4 microbatches:

- the MoE runs the 2-GPU graph test captures (`test_cuda_graph_training.MOE_CASES`: grouped
  GEMMs; at expert-parallel size 2 the padded worst-case exchange; under the DDP engine, the
  distributed optimizer and Megatron-FSDP ZeRO-3), with the router's losses, metrics and expert
  bias;
- dense models with per-token losses (`--calculate-per-token-loss`: each microbatch's token
  count kept for the loop, the gradients divided by the step's count on the device).

The optimizer step and what it logs run after `compute_gradients` (`take_optimizer_step`, or in a
graph `step_on_device`), outside this check.

One read is meant: Megatron-FSDP compares across ranks the units each forward ran
(`rank_check.py`), and reads the comparison of one forward at the start of the next. On a GPU it
reads it from pinned memory once the device has passed that forward's end (a CUDA graph leaves
it out), so it drains nothing; on CPU the comparison is read at once.

The graph flags themselves need CUDA (refused here, `test_cuda_graph_flags.py`); the graphed
runs are compared with the eager ones on 2 GPUs (`test_cuda_graph_training.py`).
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest

from megatron.core.distributed.fsdp.rank_check import UnitsRunCheck
from megatron.training import train_step
from tests.unit_tests.distributed_harness import DistributedTestError, run_distributed
from tests.unit_tests.host_reads import no_host_reads
from tests.unit_tests.training.checkpoint_checks import main
from tests.unit_tests.training.test_cuda_graph_training import ENGINES, MOE_CASES

ITERATIONS = 3
RUN = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    f"--micro-batch-size 2 --global-batch-size 16 --train-iters {ITERATIONS} --lr 1e-2 "
    "--mock-data --vocab-size 64 --num-workers 0 --eval-iters 0 --log-interval 1 "
    "--bf16"
).split()
"""4 microbatches per iteration and rank at 2 ranks."""

MOE = (
    "--num-experts 4 --moe-grouped-gemm --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
    "--moe-z-loss-coeff 1e-3 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-per-layer-logging"
)
PER_TOKEN = "--calculate-per-token-loss"


def _checked_run(flags: list[str]) -> int:
    """`pretrain_gpt.py` with `flags` on this rank, its `compute_gradients` after the first
    call under `no_host_reads()`. Returns how many calls were checked."""
    compute_gradients = train_step.compute_gradients
    calls = 0

    @functools.wraps(compute_gradients)
    def checked_compute_gradients(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            return compute_gradients(*args, **kwargs)
        with no_host_reads(allowed=(UnitsRunCheck.resolve,)):
            return compute_gradients(*args, **kwargs)

    with mock.patch.object(train_step, "compute_gradients", checked_compute_gradients):
        main(flags)
    return calls - 1


@pytest.mark.parametrize("engine, expert_parallel", MOE_CASES.values(), ids=MOE_CASES)
def test_moe_microbatches_read_nothing_on_the_host(engine, expert_parallel):
    flags = [*RUN, *ENGINES[engine], *MOE.split(), *expert_parallel.split()]
    assert run_distributed(_checked_run, 2, flags) == [ITERATIONS - 1] * 2


@pytest.mark.parametrize("engine", ["ddp", "distributed_optimizer", "fsdp_zero3"])
def test_dense_microbatches_read_nothing_on_the_host_with_per_token_losses(engine):
    flags = [*RUN, *ENGINES[engine], PER_TOKEN]
    assert run_distributed(_checked_run, 2, flags) == [ITERATIONS - 1] * 2


def test_the_check_sees_an_exchange_sized_on_the_host():
    """At expert-parallel size 2 without the padding, each MoE layer reads its token counts."""
    flags = [*RUN, *ENGINES["ddp"], *MOE.split(), "--expert-model-parallel-size", "2"]
    with pytest.raises(DistributedTestError, match="a host read") as failure:
        run_distributed(_checked_run, 2, flags)
    assert "in dispatch" in str(failure.value) and "token_dispatcher.py" in str(failure.value)
