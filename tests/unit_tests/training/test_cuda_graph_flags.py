"""The CUDA-graph flags (`--cuda-graph-impl`, `--cuda-graph-scope`, `--cuda-graph-warmup-steps`):
what is built is accepted in both of upstream's spellings, everything else is refused with a
message naming the flag and the fix (no CUDA, not NCCL, per-layer graphs, and each flag whose
work needs the host inside the iteration); and the graphed iteration's static input buffers."""

from __future__ import annotations

import re

import pytest
import torch

from megatron.training.configs_from_args import core_transformer_config_from_args
from megatron.training.cuda_graphs import StaticBatches
from megatron.training.flag_groups import cuda_graphs as cuda_graph_flags
from megatron.training.flag_groups.cuda_graphs import full_iteration_cuda_graph
from tests.unit_tests.training.flag_checks import FSDP, validated

FULL = ("--cuda-graph-impl", "full_iteration")
LOCAL = ("--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration")
NCCL = ("--distributed-backend", "nccl")
NO_EARLY_GATHER = "--no-fsdp-all-gather-in-start-param-sync"


def test_graphs_are_off_by_default():
    args = validated()
    assert (args.cuda_graph_impl, args.cuda_graph_scope) == ("none", None)
    assert args.cuda_graph_warmup_steps == 3  # upstream's default
    assert not full_iteration_cuda_graph(args)
    assert core_transformer_config_from_args(args).cuda_graph_impl == "none"


@pytest.mark.parametrize("spelling", [FULL, LOCAL], ids=["full_iteration", "local+scope"])
def test_both_spellings_of_a_full_iteration_graph_are_accepted(cuda_available, spelling):
    args = validated(*spelling, *NCCL, FSDP, NO_EARLY_GATHER, "--cuda-graph-warmup-steps", "1")
    assert full_iteration_cuda_graph(args)
    # The model knows (its FP8 experts run the kernels a graph can hold at any size).
    assert core_transformer_config_from_args(args).cuda_graph_impl == "full_iteration"
    # Nothing is forced: the flag the user had to give is as given, the NaN check stays on
    # (it reads what the loop reads after each replay).
    assert args.fsdp_all_gather_in_start_param_sync is False
    assert args.check_for_nan_in_loss_and_grad is True


@pytest.mark.parametrize("spelling", [FULL, LOCAL], ids=["full_iteration", "local+scope"])
def test_graphs_without_cuda_are_refused(cuda_unavailable, spelling):
    with pytest.raises(ValueError, match="needs CUDA, which is not available; drop it"):
        validated(*spelling)


def test_graphs_over_gloo_are_refused(cuda_available):
    with pytest.raises(ValueError, match="needs --distributed-backend nccl"):
        validated(*FULL)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--cuda-graph-impl", "transformer_engine"),
            "--cuda-graph-impl transformer_engine: Transformer Engine's per-layer CUDA graphs "
            "are not built in this project; use --cuda-graph-impl full_iteration",
        ),
        (
            ("--cuda-graph-impl", "local"),
            "per-layer CUDA graphs, which are not built in this project; add "
            "--cuda-graph-scope full_iteration",
        ),
        (
            ("--cuda-graph-scope", "full_iteration"),
            "--cuda-graph-scope full_iteration needs --cuda-graph-impl local; for the whole "
            "training iteration in one graph pass --cuda-graph-impl full_iteration alone",
        ),
        (
            ("--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "mlp"),
            "only the full_iteration scope is built (the whole training iteration in one "
            "graph); per-layer and inference graphs (attn, mlp) are not. Pass "
            "--cuda-graph-scope full_iteration",
        ),
        (
            (*FULL, "--cuda-graph-scope", "full_iteration_inference"),
            "per-layer and inference graphs (full_iteration_inference) are not",
        ),
        (
            ("--cuda-graph-warmup-steps", "5"),
            "--cuda-graph-warmup-steps 5 applies to CUDA graphs only: add --cuda-graph-impl "
            "full_iteration or drop the flag",
        ),
        (
            (*FULL, "--cuda-graph-warmup-steps", "0"),
            "--cuda-graph-warmup-steps 0 must be >= 1: the optimizer creates its state in its "
            "first step",
        ),
    ],
    ids=["te", "local", "scope-alone", "per-layer", "inference", "warmup-alone", "warmup-0"],
)
def test_what_is_not_built_is_refused(cuda_available, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validated(*flags, *NCCL)


@pytest.mark.parametrize(
    "flags, message",
    [
        ((FSDP,), "pass --no-fsdp-all-gather-in-start-param-sync"),
        (("--fp16",), "loss scaling (--fp16, --loss-scale) decides on the host"),
        (("--bf16", "--loss-scale", "1024"), "train with --bf16 (without --loss-scale)"),
        (
            ("--rampup-batch-size", "8", "8", "64", "--global-batch-size", "32"),
            "a batch-size schedule (--rampup-batch-size, --step-batch-size-schedule) changes",
        ),
        (("--step-batch-size-schedule", "0:8 1K:16"), "drop the schedule"),
        (("--num-experts", "2"), "MoE layers (--num-experts) size their token exchange"),
        (("--recompute-granularity", "selective"), "activation recomputation"),
        (("--tensor-model-parallel-size", "2", "--sequence-parallel"), "drop --sequence-parallel"),
        (("--tensor-model-parallel-size", "2"), "and set --attention-dropout 0"),
        (("--empty-unused-memory-level", "1"), "--empty-unused-memory-level 1 empties"),
        (
            (
                "--start-weight-decay",
                "0",
                "--end-weight-decay",
                "0.1",
                "--weight-decay-incr-style",
                "linear",
            ),
            "use a constant weight decay",
        ),
    ],
    ids=lambda value: value[0] if isinstance(value, tuple) else "",
)
def test_what_needs_the_host_inside_the_iteration_is_refused(cuda_available, flags, message):
    expected = re.escape("--cuda-graph-impl full_iteration: ") + ".*" + re.escape(message)
    with pytest.raises(ValueError, match=expected):
        validated(*FULL, *NCCL, *flags, world_size=4)


MOE = ("--num-experts", "4", "--moe-grouped-gemm", "--bf16")
WORST_CASE = ("--expert-model-parallel-size", "2", "--moe-pad-dispatch-to-worst-case")


@pytest.fixture
def fp8_kernels_run(monkeypatch):
    """The grouped FP8 experts' Triton kernels run on this (pretended) GPU."""
    monkeypatch.setattr(cuda_graph_flags, "grouped_fp8_takes_device_counts", lambda: True)


FP8 = ("--fp8-format", "hybrid")


@pytest.mark.parametrize(
    "flags",
    [MOE, (*MOE, *WORST_CASE), (*MOE, *FP8), (*MOE, *FP8, *WORST_CASE)],
    ids=["expert-parallel-1", "worst-case-exchange", "fp8", "fp8-worst-case-exchange"],
)
def test_moe_layers_that_read_nothing_on_the_host_are_accepted(
    cuda_available, fp8_kernels_run, flags
):
    """Grouped FP8 experts too, where their kernels take the counts on the device."""
    assert full_iteration_cuda_graph(validated(*FULL, *NCCL, *flags))


@pytest.mark.parametrize(
    "flags, missing",
    [
        (("--num-experts", "4", "--bf16"), "add --moe-grouped-gemm"),
        (("--num-experts", "4", "--moe-grouped-gemm"), "add --bf16"),
        ((*MOE, "--moe-expert-capacity-factor", "1.5"), "drop --moe-expert-capacity-factor"),
        ((*MOE, "--expert-model-parallel-size", "2"), "add --moe-pad-dispatch-to-worst-case"),
        (
            (*MOE, *FP8, "--expert-model-parallel-size", "2"),
            "add --moe-pad-dispatch-to-worst-case",
        ),
        ((*MOE, *FP8, "--no-fp8-wgrad"), "drop --no-fp8-wgrad (the high-precision weight"),
    ],
    ids=["loop", "fp32", "capacity", "expert-parallel", "fp8-expert-parallel", "fp8-no-wgrad"],
)
def test_moe_layers_that_read_on_the_host_are_refused_naming_what_to_change(
    cuda_available, fp8_kernels_run, flags, missing
):
    expected = "MoE layers (--num-experts) size their token exchange or their experts' GEMMs"
    with pytest.raises(ValueError, match=re.escape(expected) + ".*" + re.escape(missing)):
        validated(*FULL, *NCCL, *flags)


def test_fp8_moe_layers_without_the_grouped_fp8_kernels_are_refused(cuda_available, monkeypatch):
    monkeypatch.setattr(cuda_graph_flags, "grouped_fp8_takes_device_counts", lambda: False)
    missing = "drop --fp8-format hybrid (the FP8 experts' grouped kernels, which take the counts"
    with pytest.raises(ValueError, match=re.escape(missing)):
        validated(*FULL, *NCCL, *MOE, *FP8)


def test_tensor_parallelism_without_attention_dropout_is_accepted(cuda_available):
    flags = ("--tensor-model-parallel-size", "2", "--attention-dropout", "0")
    assert full_iteration_cuda_graph(validated(*FULL, *NCCL, *flags, world_size=4))


def test_what_runs_outside_the_graph_is_accepted(cuda_available):
    """Checks and logs read after each replay, evaluation and per-token loss on the device."""
    flags = ("--log-num-zeros-in-grad", "--log-params-norm", "--calculate-per-token-loss")
    flags += ("--eval-interval", "2", "--bf16", "--optimizer", "sgd")
    assert full_iteration_cuda_graph(validated(*FULL, *NCCL, *flags))


# The static input buffers (CPU here; the graph's are on the GPU).


def _batches(seed: int, num: int = 2) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "tokens": torch.randint(0, 64, (2, 8), generator=generator),
            "loss_mask": torch.rand(2, 8, generator=generator),
        }
        for _ in range(num)
    ]


def test_static_batches_refill_the_same_buffers():
    static = StaticBatches(torch.device("cpu"))
    static.copy_in(_batches(0))
    first = list(static.iterator())
    addresses = [{k: v.data_ptr() for k, v in batch.items()} for batch in first]
    for seed in (1, 2):
        batches = _batches(seed)
        static.copy_in(batches)
        read = list(static.iterator())
        assert [{k: v.data_ptr() for k, v in batch.items()} for batch in read] == addresses
        for got, given in zip(read, batches):
            assert got.keys() == given.keys()
            for key in given:
                assert torch.equal(got[key], given[key]) and got[key] is not given[key]


def test_static_batches_hand_out_dicts_a_forward_step_may_change():
    static = StaticBatches(torch.device("cpu"))
    static.copy_in(_batches(0))
    next(static.iterator()).pop("tokens")  # as pretrain_gpt's get_batch pops keys
    assert all("tokens" in batch for batch in static.iterator())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b[:1], "differ from those the CUDA graph was made for"),
        (lambda b: [{**b[0], "extra": torch.ones(1)}, b[1]], "differ from those"),
        (lambda b: [{**b[0], "tokens": b[0]["tokens"][:1]}, b[1]], "fixed number, keys, shapes"),
        (lambda b: [{**b[0], "tokens": b[0]["tokens"].int()}, b[1]], "and dtypes"),
        (lambda b: [{**b[0], "tokens": [1, 2]}, b[1]], "may hold tensors only"),
    ],
    ids=["number", "keys", "shape", "dtype", "not-a-tensor"],
)
def test_static_batches_refuse_batches_of_another_form(change, message):
    static = StaticBatches(torch.device("cpu"))
    static.copy_in(_batches(0))
    with pytest.raises(ValueError, match=message):
        static.copy_in(change(_batches(1)))
