"""`pretrain_gpt.py` with `--pipeline-model-parallel-size 2` on 2 gloo ranks: Megatron-FSDP and
the DDP engine train the same (losses, global gradient norms over both stages, clipping), every
rank records the last stage's losses, and the loss falls. Flags that stages do not compose with
yet are refused by name. A training step with `--calculate-per-token-loss` at 2 stages moves the
weights by the gradient of one process's plain computation (4 ranks)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.pipeline_parallel.global_names import global_name
from megatron.training.arguments import parse_args
from megatron.training.arguments_validation import validate_args
from megatron.training.configs_from_args import core_transformer_config_from_args
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    SEQ_LENGTH,
    VOCAB_SIZE,
    build_tiny_gpt,
    make_token_batches,
    tiny_gpt_config,
    wrap_for_engine,
)
from tests.unit_tests.training.schedule_checks import masked_sgd_train_step
from tests.unit_tests.training.test_pretrain_gpt import (
    TINY,
    ZERO3,
    _losses_and_norms,
    _pretrain,
    steps_read_at_once,
)

PIPELINE = [*TINY, "--global-batch-size", "8", "--pipeline-model-parallel-size", "2"]
"""4 microbatches of 2 sequences through 2 stages of one layer each, tied embeddings."""


def _both_engines(flags: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_losses_and_norms([*flags, *ZERO3]), _losses_and_norms(flags)]


def test_two_stages_train_alike_under_both_engines():
    (fsdp, ddp), (fsdp_last, ddp_last) = run_distributed(_both_engines, 2, PIPELINE)
    losses, grad_norms = ddp
    assert losses[-1] < losses[0]
    assert (grad_norms > 0.3).all(), f"clipping never acted: {grad_norms}"
    for result in (fsdp, fsdp_last, ddp_last):
        torch.testing.assert_close(result, ddp)


def _read_later_and_at_once(flags: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    later = _losses_and_norms(flags)
    with steps_read_at_once():
        return [later, _losses_and_norms(flags)]


def test_steps_read_at_the_next_iteration_count_each_stage_once():
    """The optimizer step whose outcome the loop reads later sums the norm over both stages,
    the last stage's copy of the tied embeddings left out, as the step read at once does."""
    for later, at_once in run_distributed(_read_later_and_at_once, 2, [*PIPELINE, *ZERO3]):
        torch.testing.assert_close(later, at_once, rtol=0, atol=0)


VIRTUAL = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
"""2 stages of 2 virtual stages each: rank 0 holds layers 1 and 3, rank 1 layers 2 and 4."""


UNTIED_DISTRIBUTED = ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer"]
"""The DDP engine's distributed optimizer (over every chunk's shards); untied embeddings, which
it needs with stages."""


def _one_stage_then_virtual_stages(root: str) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """4 layers at PP 1 (DP 2) for 4 iterations, saving after each; then from its checkpoint of
    iteration 1 the same run at PP 2 with 2 virtual stages per rank (a checkpoint gives them
    the PP 1 run's weights: a stage draws other initial weights than the whole model does).
    Under the DDP engine and Megatron-FSDP, then both runs again with the DDP engine's
    distributed optimizer. (start iteration, losses, grad norms) of each."""
    base = [*TINY, "--num-layers", "4", "--global-batch-size", "8"]
    runs = []
    for model, engines in (([], ([], ZERO3)), (UNTIED_DISTRIBUTED, ([],))):
        saved = os.path.join(root, "untied" if model else "tied")
        runs.append([*base, *model, "--save", saved, "--save-interval", "1"])
        runs += [
            [*base, *model, *VIRTUAL, *engine, "--load", saved, "--ckpt-step", "1"]
            for engine in engines
        ]
    results = []
    for flags in runs:
        history = _pretrain(flags)["history"]
        results.append(
            (
                history.start_iteration,
                torch.tensor(history.loss_curve()),
                torch.tensor(history.grad_norms),
            )
        )
    return results


def test_virtual_stages_train_as_one_stage(tmp_path):
    per_rank = run_distributed(_one_stage_then_virtual_stages, 2, str(tmp_path))
    for rank_result in per_rank:
        one_stage, ddp, fsdp, one_stage_untied, distributed = rank_result
        for name, (start, losses, grad_norms), virtual in (
            ("ddp", one_stage, ddp),
            ("fsdp", one_stage, fsdp),
            ("distributed optimizer", one_stage_untied, distributed),
        ):
            assert start == 0 and losses[-1] < losses[0]
            resumed, *result = virtual
            assert resumed == 1, name
            # Other splits of the same sums: equal to fp32 rounding.
            torch.testing.assert_close(
                result, [losses[1:], grad_norms[1:]], rtol=1.3e-6, atol=1e-5, msg=name
            )


@pytest.mark.parametrize(
    "extra, named",
    [
        (
            ["--untie-embeddings-and-output-weights", "--mtp-num-layers", "1"]
            + ["--use-distributed-optimizer"],
            "--mtp-num-layers",
        ),
        (["--cuda-graph-impl", "full_iteration"], "--cuda-graph-impl"),
        (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
    ],
)
def test_unbuilt_compositions_are_refused_by_name(extra, named):
    args = parse_args(args=[*PIPELINE, "--distributed-backend", "gloo", *extra])
    with pytest.raises(ValueError, match=named):
        validate_args(args, world_size=4)


def _validated(*flags: str, world_size: int = 2):
    args = parse_args(args=[*TINY, "--distributed-backend", "gloo", *flags])
    return validate_args(args, world_size=world_size)


@pytest.mark.parametrize(
    "flags, virtual",
    [
        (["--num-virtual-stages-per-pipeline-rank", "2"], 2),
        (["--num-virtual-stages-per-pipeline-rank", "1"], None),
        (["--num-layers-per-virtual-pipeline-stage", "1"], 4),
        (["--num-layers-per-virtual-pipeline-stage", "2"], 2),
        (["--num-layers-per-virtual-pipeline-stage", "4"], None),
        (
            [
                "--num-layers-per-virtual-pipeline-stage",
                "5",
                "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split",
            ],
            None,
        ),
    ],
)
def test_virtual_stages_follow_megatron_lms_derivation(flags, virtual):
    # 8 layers over 2 ranks: 4 each (5 with the embedding and loss counted). 16 microbatches.
    args = _validated(
        "--num-layers",
        "8",
        "--pipeline-model-parallel-size",
        "2",
        "--global-batch-size",
        "32",
        *flags,
    )
    assert args.virtual_pipeline_model_parallel_size == virtual


@pytest.mark.parametrize(
    "flags, named",
    [
        (
            [
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ],
            "are both set",
        ),
        (["--num-layers-per-virtual-pipeline-stage", "3"], "does not divide the 4 layer"),
        (
            [
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--decoder-first-pipeline-num-layers",
                "2",
            ],
            "give the virtual stages with --num-virtual-stages-per-pipeline-rank",
        ),
        (["--num-virtual-stages-per-pipeline-rank", "3"], "not divisible by its 3 virtual stages"),
        (["--num-virtual-stages-per-pipeline-rank", "0"], "must be >= 1"),
        # 1 microbatch (fewer than the 2 stages), then 3 (a last group of 1 < 2).
        (["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "2"], "gives 1"),
        (["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "6"], "gives 3"),
        # Scheduled sizes are checked at start-up: a ramp from 2 (1 microbatch) ...
        (
            [*VIRTUAL[2:], "--rampup-batch-size", "2", "2", "32", "--global-batch-size", "8"],
            r"--rampup-batch-size \(a global batch of 2 after 0 consumed samples\) gives 1",
        ),
        # ... and a step to 6 (3 microbatches) after 160 tokens (10 samples), which the
        # 4 iterations of 8 samples reach.
        (
            [*VIRTUAL[2:], "--step-batch-size-schedule", "0:8 160:6"],
            r"a global batch of 6 after 16 consumed samples\) gives 3",
        ),
    ],
)
def test_bad_virtual_stages_are_refused_naming_the_flags(flags, named):
    with pytest.raises(ValueError, match=named):
        _validated("--num-layers", "8", "--pipeline-model-parallel-size", "2", *flags)


@pytest.mark.parametrize(
    "schedule",
    [
        ["--rampup-batch-size", "4", "4", "8", "--global-batch-size", "8"],
        # The step to 6 comes after 1000 samples, beyond the 4 iterations' 32.
        ["--step-batch-size-schedule", "0:8 16000:6"],
    ],
)
def test_scheduled_batch_sizes_that_suit_the_interleaved_schedule_are_accepted(schedule):
    args = _validated("--num-layers", "8", *VIRTUAL, *schedule)
    assert args.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize(
    "flags, world_size, overlap",
    [
        # Upstream's default, with virtual stages only (1F1B does not overlap).
        (
            ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"],
            2,
            True,
        ),
        (["--pipeline-model-parallel-size", "2"], 2, False),
        ([], 2, False),
        (["--pipeline-model-parallel-size", "2", "--no-overlap-p2p-communication"], 2, False),
        (
            [
                "--pipeline-model-parallel-size",
                "4",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--no-overlap-p2p-communication",
            ],
            4,
            False,
        ),
    ],
)
def test_overlap_p2p_communication_reaches_the_schedule(flags, world_size, overlap):
    args = _validated(
        "--num-layers", "8", "--global-batch-size", "16", *flags, world_size=world_size
    )
    assert args.overlap_p2p_comm is overlap
    assert core_transformer_config_from_args(args).overlap_p2p_comm is overlap


def test_no_overlap_with_virtual_stages_needs_more_than_two_stages():
    """Megatron-LM's rule (a batched exchange of 2 stages would hold several operations between
    the same 2 ranks)."""
    with pytest.raises(ValueError, match="--no-overlap-p2p-communication with virtual pipeline"):
        _validated(
            "--num-layers",
            "8",
            "--pipeline-model-parallel-size",
            "2",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
            "--no-overlap-p2p-communication",
        )


def test_virtual_stages_need_stages():
    with pytest.raises(ValueError, match="--num-virtual-stages-per-pipeline-rank"):
        _validated("--num-virtual-stages-per-pipeline-rank", "2", "--num-layers", "4")


def test_split_flags_need_stages():
    args = parse_args(
        args=[*TINY, "--distributed-backend", "gloo", "--decoder-last-pipeline-num-layers", "1"]
    )
    with pytest.raises(ValueError, match="--decoder-last-pipeline-num-layers"):
        validate_args(args, world_size=1)


def _per_token_step_at_two_stages(engine: str) -> dict:
    """One `train_step` (SGD, lr 1, so the weights move by the gradient) of a tied GPT split into
    2 stages, with `--calculate-per-token-loss` and uneven token counts (none in the first
    micro-batch); the weights each rank holds are checked against one process's plain
    computation of the gradient of the global batch's loss per token. Returns the reported loss,
    its plain value, and the names of the parameters checked."""
    reference = build_tiny_gpt(share_embeddings_and_output_weights=True)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        num_microbatches, dp_rank = 2, parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        tokens, labels = make_token_batches(1, 8, seed=3)[0]
        mask = (tokens % 3 != 0).float()
        mask[: len(tokens) // (dp_size * num_microbatches)] = 0.0
        stage = parallel_state.get_pipeline_model_parallel_rank()
        torch.manual_seed(7 + stage)  # other weights than the reference's, overwritten below
        model = GPTModel(
            tiny_gpt_config(pipeline_model_parallel_size=2, calculate_per_token_loss=True),
            get_gpt_layer_local_spec(),
            vocab_size=VOCAB_SIZE,
            max_sequence_length=SEQ_LENGTH,
            pre_process=stage == 0,
            post_process=stage == 1,
            share_embeddings_and_output_weights=True,
        ).to(current_device())
        initial = reference.state_dict()
        model.load_state_dict(
            {name: initial[global_name(model, name)] for name in model.state_dict()}
        )
        wrapped = wrap_for_engine(model, engine)
        losses, skipped = masked_sgd_train_step(
            wrapped,
            (tokens, labels, mask),
            num_microbatches=num_microbatches,
            dp_rank=dp_rank,
            dp_size=dp_size,
            per_token=True,
        )
        assert not skipped
        per_token_losses = reference(tokens, labels=labels).float() * mask
        loss = per_token_losses.sum() / mask.sum()
        loss.backward()
        expected = {name: p.detach() - p.grad for name, p in reference.named_parameters()}
        checked = []
        for name, value in wrapped.state_dict().items():
            whole = global_name(model, name)
            got = value.full_tensor() if isinstance(value, DTensor) else value
            torch.testing.assert_close(got, expected[whole], msg=f"{engine}: {whole}")
            checked.append(whole)
        return dict(loss=losses["lm loss"], expected_loss=loss.item(), checked=checked)
    finally:
        parallel_state.destroy_model_parallel()


def _per_token_steps(engines: list[str]) -> list[dict]:
    return [_per_token_step_at_two_stages(engine) for engine in engines]


def test_per_token_loss_at_two_stages_equals_a_plain_computation():
    """PP 2 x DP 2 on 4 gloo ranks: the last stage's token count divides every stage's
    gradients (the tied embeddings' two copies alike), as at PP 1."""
    engines = ["ddp", "optim_grads_params"]
    per_rank = run_distributed(_per_token_steps, 4, engines)
    whole = {
        name
        for name, _ in build_tiny_gpt(share_embeddings_and_output_weights=True).named_parameters()
    }
    for index, engine in enumerate(engines):
        for rank_results in per_rank:
            result = rank_results[index]
            assert result["loss"] == pytest.approx(result["expected_loss"], rel=1e-5), engine
        assert set().union(*(r[index]["checked"] for r in per_rank)) == whole, engine
