"""The GPT with MoE layers (router, all-to-all dispatch, stacked experts) under the data-parallel
engines: at EP 1, 2 and 4 on 4 gloo ranks, under the DDP engine and the Megatron-FSDP strategies,
it trains exactly as one process running the whole global batch with every expert local (losses,
gradient norms, global weights after SGD steps with gradient accumulation), also with grouped
GEMMs and the padded worst-case exchange (no host read of the token counts); in FP8 it trains
alike at EP 1 and 2. Built on the `meta` device and materialised by Megatron-FSDP, it starts from
the eager build's weights, bit for bit, and trains as it does."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.unit_tests.distributed.moe_training import (
    MICRO_BATCH,
    MICROBATCHES,
    STEPS,
    Engine,
    RunResult,
    engine_run,
    global_state,
    init_groups,
    optimizer_config,
    reference_run,
    train_steps,
    wrap,
)
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    MOE_STATE_VARIANTS,
    SEQ_LENGTH,
    VOCAB_SIZE,
    tiny_gpt_config,
)

WORLD = 4
NUM_EXPERTS = 4


class GPTLosses(torch.nn.Module):
    """A GPT whose forward takes the engine tests' `(inputs, labels, route)` and returns the
    per-sample mean loss (the GPT routes tokens itself: `route` is unused)."""

    def __init__(self, gpt: GPTModel):
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, route: torch.Tensor):
        return self.gpt(tokens, labels=labels).mean(dim=1)


def build_gpt_moe(
    ep_group: dist.ProcessGroup | None, dispatcher: str, device: str = "cpu", **overrides
) -> GPTLosses:
    """A 2-layer GPT whose second layer is MoE (4 experts, top-2, SwiGLU, a z-loss; `overrides`
    of its config fields), the same global weights at every EP size."""
    fields = dict(
        num_moe_experts=NUM_EXPERTS,
        moe_ffn_hidden_size=24,
        moe_router_topk=2,
        moe_layer_freq=[0, 1],
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="none",
        moe_z_loss_coeff=1e-2,
        gated_linear_unit=True,
        activation_func=F.silu,
        expert_model_parallel_size=1 if ep_group is None else ep_group.size(),
    )
    config = tiny_gpt_config(**{**fields, **overrides})
    torch.manual_seed(1234)
    with torch.device(device):
        gpt = GPTModel(
            config,
            get_gpt_decoder_block_spec(config, use_transformer_engine=False),
            vocab_size=VOCAB_SIZE,
            max_sequence_length=SEQ_LENGTH,
            position_embedding_type="rope",
        )
    return GPTLosses(gpt)


def token_batches() -> list[tuple[torch.Tensor, ...]]:
    """(tokens, labels, unused route) global batches."""
    generator = torch.Generator().manual_seed(0)
    size = WORLD * MICROBATCHES * MICRO_BATCH
    batches = []
    for _ in range(STEPS):
        data = torch.randint(0, VOCAB_SIZE, (size, SEQ_LENGTH + 1), generator=generator)
        batches.append((data[:, :-1], data[:, 1:], torch.zeros(size, dtype=torch.long)))
    return batches


def _compare(
    engine: Engine, ep_sizes: tuple[int, ...], dispatcher: str, overrides: dict | None = None
) -> None:
    batches = token_batches()
    builder = functools.partial(build_gpt_moe, dispatcher=dispatcher, **(overrides or {}))
    expected = reference_run(builder, batches)
    for ep in ep_sizes:
        actual = engine_run(builder, engine, ep, batches, layer_class=TransformerLayer)
        parallel_state.destroy_model_parallel()
        actual.assert_matches(expected, f"EP={ep}")


@pytest.mark.parametrize(
    "engine, ep_sizes, dispatcher",
    [
        (Engine("ddp"), (1, 2, 4), "alltoall"),
        (Engine("ddp", distributed_optimizer=True), (2,), "allgather"),
        (Engine("fsdp", "no_shard"), (4,), "alltoall"),
        (Engine("fsdp", "optim"), (2,), "alltoall"),
        (Engine("fsdp", "optim_grads"), (4,), "allgather"),
        (Engine("fsdp", "optim_grads_params"), (1, 2, 4), "alltoall"),
        (Engine("fsdp", "optim_grads_params", replicas=2), (2,), "alltoall"),
    ],
    ids=["ddp", "ddp_distopt", "no_shard", "optim", "optim_grads", "zero3", "hsdp"],
)
def test_gpt_moe_trains_as_one_process_at_every_ep_size(engine, ep_sizes, dispatcher):
    run_distributed(_compare, WORLD, engine, ep_sizes, dispatcher)


NO_HOST_READS = dict(moe_grouped_gemm=True, moe_pad_dispatch_to_worst_case=True)
"""Grouped GEMMs and the padded worst-case exchange: no MoE layer reads its token counts on
the host (`docs/moe.md`, "Host reads")."""


@pytest.mark.parametrize(
    "engine, ep_sizes, dispatcher",
    [
        (Engine("ddp"), (1, 2, 4), "alltoall"),
        (Engine("fsdp", "optim_grads_params"), (2,), "allgather"),
    ],
    ids=["ddp", "zero3"],
)
def test_gpt_moe_without_host_reads_trains_as_one_process(engine, ep_sizes, dispatcher):
    run_distributed(_compare, WORLD, engine, ep_sizes, dispatcher, NO_HOST_READS)


FP8 = dict(
    fp8="hybrid",
    fp8_recipe="delayed",
    fp8_amax_history_len=4,
    fp8_amax_compute_algo="max",
    moe_ffn_hidden_size=32,
)
"""The model in FP8 (expert sizes in multiples of 16); delayed scaling, whose scales are the
same on every rank (current scaling scales each rank's own tokens)."""


def _fp8_at_ep_1_and_2(engine: Engine, dispatcher: str) -> None:
    """The same run at EP 1 and EP 2: each rank's FP8 casts are the same in both (one scale per
    expert, from the histories of global-expert slots reduced over every rank), so they train
    alike. (A single process over the global batch is no reference in FP8: its output gradients
    are the ranks' / 4, and the first pass's unscaled E5M2 casts round small ones otherwise.)"""
    batches = token_batches()
    builder = functools.partial(build_gpt_moe, dispatcher=dispatcher, **FP8)
    runs = []
    for ep in (1, 2):
        runs.append(engine_run(builder, engine, ep, batches, layer_class=TransformerLayer))
        parallel_state.destroy_model_parallel()
    ep1, ep2 = runs
    torch.testing.assert_close(ep2.losses, ep1.losses)
    torch.testing.assert_close(ep2.grad_norms, ep1.grad_norms)
    assert ep2.weights.keys() == ep1.weights.keys()
    for name, weight in ep1.weights.items():
        torch.testing.assert_close(ep2.weights[name], weight, msg=name)


@pytest.mark.parametrize(
    "engine, dispatcher",
    [
        (Engine("ddp", gradient_accumulation_fusion=True), "alltoall"),
        (Engine("fsdp", "optim_grads_params"), "allgather"),
    ],
    ids=["ddp_fused", "zero3"],
)
def test_fp8_gpt_moe_trains_alike_at_ep_1_and_2(engine, dispatcher):
    run_distributed(_fp8_at_ep_1_and_2, WORLD, engine, dispatcher)


def _meta_init_matches_eager(variant: str, ep: int) -> None:
    batches = token_batches()
    builder = functools.partial(build_gpt_moe, dispatcher="alltoall", **MOE_STATE_VARIANTS[variant])
    eager_weights = global_state(builder(None).gpt.state_dict())
    expected = reference_run(builder, batches)
    init_groups(ep)
    ep_group = parallel_state.get_expert_model_parallel_group()
    model = wrap(
        builder(ep_group, device="meta"), Engine("fsdp", "optim_grads_params"), TransformerLayer
    )
    weights = global_state(model.module.gpt.state_dict())
    assert weights.keys() == eager_weights.keys()
    for name, weight in eager_weights.items():
        assert torch.equal(weights[name], weight), name
    actual = RunResult()
    optimizer = get_megatron_optimizer(optimizer_config(), model)
    train_steps(model, optimizer, batches, actual, dist.get_rank(), dist.get_world_size())
    parallel_state.destroy_model_parallel()
    torch.testing.assert_close(actual.losses, expected.losses)
    torch.testing.assert_close(actual.grad_norms, expected.grad_norms)


@pytest.mark.parametrize("variant", MOE_STATE_VARIANTS)
def test_gpt_moe_built_on_meta_starts_as_the_eager_build(variant):
    run_distributed(_meta_init_matches_eager, WORLD, variant, 2)
