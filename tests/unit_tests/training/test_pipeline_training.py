"""`pretrain_gpt.py` with `--pipeline-model-parallel-size 2` on 2 gloo ranks: Megatron-FSDP and
the DDP engine train the same (losses, global gradient norms over both stages, clipping), every
rank records the last stage's losses, and the loss falls. Flags that stages do not compose with
yet are refused by name. A training step with `--calculate-per-token-loss` at 2 stages moves the
weights by the gradient of one process's plain computation (4 ranks)."""

from __future__ import annotations

import argparse
import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

import pretrain_gpt
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.global_names import global_name
from megatron.training import global_vars
from megatron.training.arguments import parse_args
from megatron.training.arguments_validation import validate_args
from megatron.training.training import train_step
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    SEQ_LENGTH,
    VOCAB_SIZE,
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
    wrap_for_engine,
)
from tests.unit_tests.training.test_pretrain_gpt import TINY, ZERO3, _losses_and_norms

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


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
        (["--context-parallel-size", "2"], "--context-parallel-size"),
        (["--cuda-graph-impl", "full_iteration"], "--cuda-graph-impl"),
        (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
    ],
)
def test_unbuilt_compositions_are_refused_by_name(extra, named):
    args = parse_args(args=[*PIPELINE, "--distributed-backend", "gloo", *extra])
    with pytest.raises(ValueError, match=named):
        validate_args(args, world_size=4)


def test_split_flags_need_stages():
    args = parse_args(
        args=[*TINY, "--distributed-backend", "gloo", "--decoder-last-pipeline-num-layers", "1"]
    )
    with pytest.raises(ValueError, match="--decoder-last-pipeline-num-layers"):
        validate_args(args, world_size=1)


def _masked_forward_step(data_iterator, model):
    tokens, labels, mask = next(data_iterator)
    return model(tokens, labels=labels), functools.partial(pretrain_gpt.loss_func, mask)


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
        config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0)
        config.clip_grad = 0.0
        optimizer = get_megatron_optimizer(config, wrapped)
        scheduler = OptimizerParamScheduler(
            optimizer, 0.0, 1.0, 0.0, 0, 100, "constant", 0.0, 0.0, 1, "constant"
        )
        args = argparse.Namespace(
            num_microbatches=num_microbatches,
            micro_batch_size=len(tokens) // (dp_size * num_microbatches),
            seq_length=SEQ_LENGTH,
            data_parallel_size=dp_size,
            check_for_nan_in_loss_and_grad=True,
            calculate_per_token_loss=True,
            empty_unused_memory_level=0,
        )
        global_vars.set_args(args)
        try:
            micro = zip(
                *(
                    shard_batch(t, dp_rank, dp_size).chunk(num_microbatches)
                    for t in (tokens, labels, mask)
                )
            )
            losses, skipped, _, _ = train_step(
                _masked_forward_step, iter(list(micro)), wrapped, optimizer, scheduler, args
            )
        finally:
            global_vars.set_args(None)
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
