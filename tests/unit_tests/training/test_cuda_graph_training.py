"""GPU, 2 ranks over NCCL: `pretrain_gpt.py` with the whole training iteration in a CUDA graph
(`--cuda-graph-impl full_iteration`) trains exactly as without one.

Under deterministic kernels (`torch.use_deterministic_algorithms`) the graphed run's per-iteration
losses, gradient norms and learning rates, and its evaluations (run eagerly between replays),
equal the eager run's bitwise, for Megatron-FSDP ZeRO-3 and ZeRO-2 and the DDP engine with and
without the distributed optimizer, with 1 and 4 microbatches, in bf16 with clipping acting; with
Megatron-FSDP's gradient-accumulation options (kept compute weights, deferred reductions); with
dropout too (the graph replays the default generator's offsets); for MoE models in bf16 and in
FP8, at expert-parallel sizes 1 and 2. The learning rate is a power of
two: the graphed step reads it in fp32, and a rate fp32 rounds would differ by that rounding (a
relative 6e-8), which is documented, not tested. A step whose loss is inf is skipped on the
device as the eager loop skips it (the losses after it equal the eager run's: the weights and
the optimizer state were left unchanged), or raises with `--check-for-nan-in-loss-and-grad`.
A host synchronisation inside the iteration makes the capture fail with an error naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from unittest import mock

import pytest
import torch
from torch.utils.data import Dataset

import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training.global_vars import get_args
from megatron.training.training import TrainingHistory, pretrain
from tests.unit_tests.distributed_harness import DistributedTestError, run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--micro-batch-size 2 --train-iters 8 --lr 0.001953125 --lr-decay-style constant "
    "--mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --clip-grad 0.05 --bf16 "
    "--eval-interval 3 --eval-iters 1 --log-num-zeros-in-grad"
).split()
"""Iterations 1-2 eager (warm-up), 3 captured and replayed, 4-8 replayed; evaluations after 3
and 6 (between replays) and at the end; clipping acts at every step."""

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
GRAPHED = ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2"]
FSDP = ["--use-megatron-fsdp", "--no-fsdp-all-gather-in-start-param-sync"]
FSDP += ["--overlap-grad-reduce", "--overlap-param-gather"]
ENGINES = {
    "fsdp_zero3": [*FSDP, "--data-parallel-sharding-strategy", "optim_grads_params"],
    "fsdp_zero2": [*FSDP, "--data-parallel-sharding-strategy", "optim_grads"],
    "ddp": ["--overlap-grad-reduce"],
    "distributed_optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
}
NON_FINITE_ITERATION = 5


def _pretrain(
    flags: list[str], forward_step=pretrain_gpt.forward_step, provider=None
) -> TrainingHistory | str:
    """pretrain_gpt on this rank under deterministic kernels: its history, or the message of
    the RuntimeError it raised."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(True)
    try:
        return pretrain(
            provider or pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            argv=[*flags, "--distributed-backend", "nccl"],
        )
    except RuntimeError as error:
        return str(error)
    finally:
        torch.use_deterministic_algorithms(False)


def _pretrain_graphed(flags: list[str], *steps) -> tuple[TrainingHistory | str, int]:
    """`_pretrain(flags, *steps)` with graph flags, and how many times a CUDA graph replayed
    (counted in this test only), so a run that silently trained eagerly fails."""
    replay = torch.cuda.CUDAGraph.replay
    calls = []

    def counted(graph: torch.cuda.CUDAGraph) -> None:
        calls.append(1)
        replay(graph)

    with mock.patch.object(torch.cuda.CUDAGraph, "replay", counted):
        return _pretrain(flags, *steps), len(calls)


def _graphed_histories(flags: list[str], *steps) -> list[TrainingHistory | str]:
    """Every rank's history (or error message) of the graphed run, each rank having replayed a
    graph; `steps`: `_pretrain`'s forward step and dataset provider."""
    results = run_distributed(_pretrain_graphed, 2, flags, *steps)
    assert all(replays > 0 for _, replays in results), [replays for _, replays in results]
    return [history for history, _ in results]


def _same(first: object, second: object) -> bool:
    """Equal, where nan equals nan (a skipped step's norm)."""
    if isinstance(first, float) and isinstance(second, float):
        return first == second or (math.isnan(first) and math.isnan(second))
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_same(first[k], second[k]) for k in first)
    if isinstance(first, list) and isinstance(second, list):
        return len(first) == len(second) and all(map(_same, first, second))
    return first == second


def _assert_same_training(eager: list, graphed: list) -> None:
    for eager_rank, graphed_rank in zip(eager, graphed):
        assert isinstance(eager_rank, TrainingHistory), eager_rank
        assert isinstance(graphed_rank, TrainingHistory), graphed_rank
        for field in dataclasses.fields(TrainingHistory):
            want = getattr(eager_rank, field.name)
            got = getattr(graphed_rank, field.name)
            assert _same(got, want), f"{field.name}: graphed {got}, eager {want}"


@pytest.mark.parametrize("num_microbatches", [1, 4])
@pytest.mark.parametrize("engine", ENGINES)
def test_graphed_training_equals_eager_training(engine, num_microbatches):
    flags = [*BASE, *NO_DROPOUT, *ENGINES[engine]]
    flags += ["--global-batch-size", str(2 * 2 * num_microbatches)]
    eager = run_distributed(_pretrain, 2, flags)
    graphed = _graphed_histories([*flags, *GRAPHED])
    _assert_same_training(eager, graphed)
    history = eager[0]
    assert len(history.losses) == 8 and len(set(history.loss_curve())) == 8  # it trained
    assert min(history.grad_norms) > 0.05  # clipping acted at every step
    assert sorted(history.validation_losses) == [3, 6]


@pytest.mark.parametrize(
    "engine, options",
    [
        ("fsdp_zero3", ["--megatron-fsdp-keep-unsharded-params"]),
        ("fsdp_zero3", ["--megatron-fsdp-accumulate-unsharded-grads"]),
        ("fsdp_zero2", ["--megatron-fsdp-accumulate-unsharded-grads"]),
    ],
)
def test_graphed_accumulation_options_equal_their_eager_training(engine, options):
    """Kept compute weights and deferred reductions cross microbatches inside the graph."""
    flags = [*BASE, *NO_DROPOUT, *ENGINES[engine], *options, "--global-batch-size", "16"]
    eager = run_distributed(_pretrain, 2, flags)
    graphed = _graphed_histories([*flags, *GRAPHED])
    _assert_same_training(eager, graphed)
    assert len(set(eager[0].loss_curve())) == 8  # it trained


def test_graphed_training_with_dropout_equals_eager_training():
    """Dropout draws from the default generator, whose offsets a replay advances as the eager
    kernels do: the same masks."""
    flags = [*BASE, *ENGINES["fsdp_zero3"], "--global-batch-size", "16"]
    eager = run_distributed(_pretrain, 2, flags)
    graphed = _graphed_histories([*flags, *GRAPHED])
    _assert_same_training(eager, graphed)


def test_graphed_training_with_multi_token_prediction_equals_eager_training():
    """The depths' losses, recorded on the device inside the graph and read after each replay,
    and their gradient scale are the eager run's."""
    flags = [*BASE, *NO_DROPOUT, *ENGINES["fsdp_zero3"], "--global-batch-size", "16"]
    flags += ["--mtp-num-layers", "2"]
    eager = run_distributed(_pretrain, 2, flags)
    graphed = _graphed_histories([*flags, *GRAPHED])
    _assert_same_training(eager, graphed)
    assert sorted(eager[0].losses[-1]) == ["lm loss", "mtp_1 loss", "mtp_2 loss"]
    assert len({losses["mtp_2 loss"] for losses in eager[0].losses}) == 8  # recorded every step


MOE = "--num-experts 4 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3"
WORST_CASE = "--expert-model-parallel-size 2 --moe-pad-dispatch-to-worst-case"


MOE_CASES = {
    "ddp": ("ddp", ""),
    "fsdp_zero3": ("fsdp_zero3", ""),
    "ep2-alltoall": ("distributed_optimizer", f"{WORST_CASE} --moe-token-dispatcher-type alltoall"),
    "ep2-allgather": ("fsdp_zero3", f"{WORST_CASE} --moe-token-dispatcher-type allgather"),
}
"""The MoE runs a graph captures: (engine, expert-parallel flags) by id."""


@pytest.mark.skipif(
    torch.cuda.device_count() >= 2 and torch.cuda.get_device_capability()[0] < 9,
    reason="the grouped GEMM's bf16 kernel (no host read) needs Hopper or newer",
)
@pytest.mark.parametrize("engine, expert_parallel", MOE_CASES.values(), ids=MOE_CASES)
def test_graphed_moe_training_equals_eager_training(engine, expert_parallel):
    """Dropless MoE layers with grouped GEMMs read nothing on the host (at expert-parallel size
    2 with the padded worst-case exchange): the router, its losses (recorded on the device
    and read after each replay), the dispatch and the experts replay as they ran."""
    flags = [*BASE, *NO_DROPOUT, *ENGINES[engine], "--global-batch-size", "16"]
    flags += [*MOE.split(), *expert_parallel.split()]
    eager = run_distributed(_pretrain, 2, flags)
    graphed = _graphed_histories([*flags, *GRAPHED])
    _assert_same_training(eager, graphed)
    history = eager[0]
    assert {"load_balancing_loss", "z_loss"} <= set(history.losses[-1])
    assert len(set(history.loss_curve())) == 8  # it trained


FP8 = "--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max"
FP8_MOE_CASES = {
    "ep1-zero3": ("fsdp_zero3", "--fp8-param-gather"),
    "ep2-alltoall": ("distributed_optimizer", f"{WORST_CASE} --moe-token-dispatcher-type alltoall"),
    "ep2-allgather-zero3": (
        "fsdp_zero3",
        f"{WORST_CASE} --moe-token-dispatcher-type allgather --fp8-param-gather",
    ),
}
"""The FP8 MoE runs a graph captures: (engine, further flags) by id."""


@pytest.mark.skipif(
    torch.cuda.device_count() >= 2 and torch.cuda.get_device_capability()[0] < 9,
    reason="the grouped FP8 experts' Triton kernels need Hopper or newer",
)
@pytest.mark.parametrize("engine, extra", FP8_MOE_CASES.values(), ids=FP8_MOE_CASES)
def test_graphed_fp8_moe_training_equals_eager_training(engine, extra):
    """Grouped FP8 experts take their token counts on the device (after the padded exchange's
    real rows at expert-parallel size 2): graphed as eager, and eager as with the counts read
    on the host (the exchange sized there)."""
    flags = [*BASE, *NO_DROPOUT, *ENGINES[engine], "--global-batch-size", "16"]
    flags += [*MOE.split(), *FP8.split(), *extra.split()]
    eager = run_distributed(_pretrain, 2, flags)
    host_sized = [flag for flag in flags if flag != "--moe-pad-dispatch-to-worst-case"]
    if host_sized != flags:
        _assert_same_training(run_distributed(_pretrain, 2, host_sized), eager)
    graphed = _graphed_histories([*flags, *GRAPHED])
    _assert_same_training(eager, graphed)
    assert len(set(eager[0].loss_curve())) == 8  # it trained


def test_the_local_spelling_graphs_the_iteration_too():
    """Upstream's earlier spelling, `--cuda-graph-impl local --cuda-graph-scope full_iteration`."""
    flags = [*BASE, *NO_DROPOUT, *ENGINES["ddp"], "--global-batch-size", "8"]
    local = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
    eager = run_distributed(_pretrain, 2, flags)
    graphed = _graphed_histories([*flags, *local, "--cuda-graph-warmup-steps", "2"])
    _assert_same_training(eager, graphed)


class _PoisonedSplit(Dataset):
    """A training split whose samples in `poisoned` carry a "poison" of inf (1.0 elsewhere),
    which the forward step multiplies the losses by: a data-driven inf the graph replays."""

    def __init__(self, dataset: Dataset, poisoned: range):
        self.dataset = dataset
        self.poisoned = poisoned

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = dict(self.dataset[index])
        sample["poison"] = torch.tensor(math.inf if index in self.poisoned else 1.0)
        return sample


def _poisoned_provider(num_samples: list[int]) -> tuple:
    train, valid, test = pretrain_gpt.train_valid_test_datasets_provider(num_samples)
    global_batch = get_args().global_batch_size
    start = (NON_FINITE_ITERATION - 1) * global_batch  # the sampler reads in order
    return _PoisonedSplit(train, range(start, start + global_batch)), valid, test


def _poisoned_forward_step(data_iterator, model):
    batch = pretrain_gpt.get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    if "poison" in batch:  # training batches (the evaluation splits have none)
        output = output * batch["poison"].view(-1, *([1] * (output.dim() - 1)))
    return output, functools.partial(pretrain_gpt.loss_func, batch["loss_mask"])


@pytest.mark.parametrize("engine", ["fsdp_zero3", "distributed_optimizer"])
def test_a_non_finite_step_is_skipped_on_the_device(engine):
    flags = [*BASE, *NO_DROPOUT, *ENGINES[engine], "--global-batch-size", "8"]
    flags += ["--no-check-for-nan-in-loss-and-grad"]
    poisoned = (_poisoned_forward_step, _poisoned_provider)
    eager = run_distributed(_pretrain, 2, flags, *poisoned)
    graphed = _graphed_histories([*flags, *GRAPHED], *poisoned)
    _assert_same_training(eager, graphed)
    history = graphed[0]
    assert history.skipped_iterations == [NON_FINITE_ITERATION]
    assert math.isinf(history.loss_curve()[NON_FINITE_ITERATION - 1])
    assert all(math.isfinite(loss) for loss in history.loss_curve()[NON_FINITE_ITERATION:])


def test_a_non_finite_step_raises_with_the_check_on():
    flags = [*BASE, *NO_DROPOUT, *ENGINES["fsdp_zero3"], "--global-batch-size", "8", *GRAPHED]
    # The graph replays from iteration 3; the poisoned iteration 5 is a replay.
    for message in _graphed_histories(flags, _poisoned_forward_step, _poisoned_provider):
        assert isinstance(message, str) and "The loss is not finite" in message
        assert "--no-check-for-nan-in-loss-and-grad" in message


def _host_reading_forward_step(data_iterator, model):
    output, loss_func = pretrain_gpt.forward_step(data_iterator, model)
    if output.detach().isnan().any().item():  # a host read: fine eagerly, refused in a capture
        raise AssertionError("nan output")
    return output, loss_func


def _pretrain_raising(flags: list[str]) -> TrainingHistory:
    return pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        ModelType.encoder_or_decoder,
        _host_reading_forward_step,
        argv=[*flags, "--distributed-backend", "nccl"],
    )


def test_a_host_synchronisation_in_the_iteration_fails_the_capture_with_the_cause():
    """The error reaches the test through the harness, which then replaces its ranks (a failed
    capture may leave communicators in a state later tests should not inherit)."""
    flags = [*BASE, *NO_DROPOUT, *ENGINES["ddp"], "--global-batch-size", "4", *GRAPHED]
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_pretrain_raising, 2, flags)
    message = str(error.value)
    assert "Capturing the training iteration in a CUDA graph failed" in message
    assert ".item()" in message and "drop --cuda-graph-impl" in message
