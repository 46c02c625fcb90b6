"""The GPT under context parallelism trains as one process running the whole sequences: at CP 2
x DP 2 (every Megatron-FSDP strategy, hybrid sharding and the DDP engine), CP 4, TP 2 x CP 2
(sequence parallel) and, for a Mixture-of-Experts GPT with its load-balancing and z losses,
EP 2 x CP 2, with each `--cp-comm-type`, the losses, global gradient norms and every global
weight after two SGD-with-momentum steps of two microbatches equal those of a single-process
GPT (TP 1, CP 1) on the same global batches. The loss mask drops a quarter of the tokens, so
the loss must be averaged over the unmasked tokens of whole sequences (not each rank's share),
and `--calculate-per-token-loss` too. The training step is the project's: the batch split by
`get_batch_on_this_cp_rank`, `forward_backward` with `pretrain_gpt.loss_func`. 4 gloo ranks.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from megatron.core import parallel_state
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.training.loss_reduction import average_loss_dicts, divide_gradients_by_tokens
from megatron.training.schedules import forward_backward
from tests.unit_tests.distributed.moe_training import Engine, RunResult, global_state
from tests.unit_tests.distributed.tp_training import PlainOptimizer, optimizer_config
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import VOCAB_SIZE, tiny_gpt_config
from tests.unit_tests.models.test_gpt_moe import MOE

WORLD, SEQ, STEPS, MICROBATCHES, MICRO_BATCH = 4, 16, 2, 2, 2
DENSE = dict(
    num_attention_heads=4,
    num_query_groups=2,
    gated_linear_unit=True,
    activation_func=F.silu,
    normalization="RMSNorm",
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Parallel sizes of a run (dp = world / (tp x cp)) and its options."""

    tp: int = 1
    cp: int = 2
    ep: int = 1
    comm: str = "p2p"
    moe: bool = False
    per_token: bool = False


def build_gpt(layout: Layout, groups: ProcessGroupCollection | None) -> GPTModel:
    """The GPT of `layout` over `groups` (None: one process at TP 1, CP 1)."""
    whole = groups is None
    fields = dict(DENSE, **MOE) if layout.moe else DENSE
    config = tiny_gpt_config(
        tensor_model_parallel_size=1 if whole else layout.tp,
        sequence_parallel=not whole and layout.tp > 1,
        context_parallel_size=1 if whole else layout.cp,
        cp_comm_type=layout.comm,
        expert_model_parallel_size=1 if whole else layout.ep,
        seq_length=SEQ,
        calculate_per_token_loss=layout.per_token,
        **fields,
    )
    tp_rank = 0 if whole else groups.tp.rank()
    model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, device_type="cpu")
    return GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        pg_collection=groups,
    )


def global_batches(dp: int) -> list[dict[str, torch.Tensor]]:
    """`STEPS` global batches for `dp` data-parallel ranks: tokens, labels and a loss mask
    with about a quarter of the tokens dropped (each sequence keeps one at least)."""
    generator = torch.Generator().manual_seed(0)
    size = dp * MICROBATCHES * MICRO_BATCH
    batches = []
    for _ in range(STEPS):
        data = torch.randint(0, VOCAB_SIZE, (size, SEQ + 1), generator=generator)
        loss_mask = (torch.rand(size, SEQ, generator=generator) > 0.25).float()
        loss_mask[:, 0] = 1.0
        batches.append({"tokens": data[:, :-1], "labels": data[:, 1:], "loss_mask": loss_mask})
    return batches


def shards(batch: dict[str, torch.Tensor], dp: int) -> list[list[dict[str, torch.Tensor]]]:
    """[microbatch][dp rank] -> that rank's samples of that microbatch."""
    micro = {key: value.chunk(MICROBATCHES) for key, value in batch.items()}
    return [
        [{key: micro[key][m].chunk(dp)[r] for key in batch} for r in range(dp)]
        for m in range(MICROBATCHES)
    ]


def reference_run(layout: Layout, dp: int) -> RunResult:
    """Plain PyTorch on one process, whole sequences: each data-parallel rank's micro-batch
    loss is the mean over its unmasked tokens, averaged over ranks and microbatches (with
    `per_token`: the global batch's sum over its unmasked tokens), as Megatron-LM trains."""
    model = build_gpt(layout, None)
    optimizer = PlainOptimizer(model, "sgd")
    # The auxiliary losses weigh as much as each micro-batch's main loss.
    scale = 1.0 if layout.per_token else 1 / (MICROBATCHES * dp)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))
    result = RunResult()
    for batch in global_batches(dp):
        optimizer.zero_grad()
        total, count = torch.zeros(()), torch.zeros(())
        for micro in shards(batch, dp):
            for part in micro:
                losses = model(part["tokens"], labels=part["labels"])
                loss_sum, tokens = (losses * part["loss_mask"]).sum(), part["loss_mask"].sum()
                loss = loss_sum if layout.per_token else loss_sum / tokens / (MICROBATCHES * dp)
                loss.backward()
                total, count = total + loss_sum.detach(), count + tokens
        if layout.per_token:
            for param in optimizer.params:
                param.grad /= count
        _, grad_norm, _ = optimizer.step()
        result.losses.append(float(total / count))
        result.grad_norms.append(grad_norm)
    result.weights = global_state(model.state_dict())
    return result


def wrap(model: GPTModel, engine: Engine, groups: ProcessGroupCollection) -> torch.nn.Module:
    """`model` under `engine`, its own config (the per-token flag included)."""
    if engine.kind == "ddp":
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=engine.distributed_optimizer
        )
        return DistributedDataParallel(model.config, ddp_config, model, pg_collection=groups)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=engine.strategy,
        num_distributed_optimizer_instances=engine.replicas,
    )
    return FullyShardedDataParallel(
        model.config,
        ddp_config,
        model,
        fsdp_unit_modules=[TransformerLayer],
        pg_collection=groups,
    )


def _forward_step(cp_group, data_iterator, model):
    batch = get_batch_on_this_cp_rank(next(data_iterator), cp_group)
    losses = model(batch["tokens"], labels=batch["labels"])
    return losses, functools.partial(pretrain_gpt.loss_func, batch["loss_mask"])


def engine_run(layout: Layout, engine: Engine) -> RunResult:
    parallel_state.initialize_model_parallel(
        layout.tp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        num_distributed_optimizer_instances=engine.replicas,
    )
    try:
        groups = ProcessGroupCollection.use_mpu_process_groups()
        model = wrap(build_gpt(layout, groups), engine, groups)
        optimizer = get_megatron_optimizer(optimizer_config("sgd"), model)
        dp, dp_rank = groups.dp.size(), groups.dp.rank()
        scale = 1.0 if layout.per_token else layout.cp / MICROBATCHES  # the training loop's
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))
        result = RunResult()
        for batch in global_batches(dp):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            mine = iter([micro[dp_rank] for micro in shards(batch, dp)])
            loss_dicts, num_tokens = forward_backward(
                functools.partial(_forward_step, groups.cp),
                mine,
                model,
                MICROBATCHES,
                calculate_per_token_loss=layout.per_token,
                cp_group=groups.cp,
            )
            model.finish_grad_sync()
            if layout.per_token:
                divide_gradients_by_tokens(model, num_tokens)
            _, grad_norm, _ = optimizer.step()
            result.losses.append(average_loss_dicts(loss_dicts).read()["lm loss"])
            result.grad_norms.append(grad_norm)
        result.weights = global_state(model.state_dict())
        return result
    finally:
        parallel_state.destroy_model_parallel()


ZERO3 = Engine("fsdp", "optim_grads_params")
DDP = Engine("ddp")
CASES = {
    "zero3": (Layout(), ZERO3),
    "optim_grads": (Layout(), Engine("fsdp", "optim_grads")),
    "optim": (Layout(), Engine("fsdp", "optim")),
    "no_shard": (Layout(), Engine("fsdp", "no_shard")),
    "hsdp_zero3": (Layout(), Engine("fsdp", "optim_grads_params", replicas=2)),
    "ddp": (Layout(), DDP),
    "ddp_distopt": (Layout(), Engine("ddp", distributed_optimizer=True)),
    "per_token_zero3": (Layout(per_token=True), ZERO3),
    "allgather_zero3": (Layout(comm="allgather"), ZERO3),
    "a2a_ddp": (Layout(comm="a2a"), DDP),
    "cp4_zero3": (Layout(cp=4), ZERO3),
    "cp4_a2a_ddp": (Layout(cp=4, comm="a2a"), DDP),
    "tp2_cp2_zero3": (Layout(tp=2), ZERO3),
    "tp2_cp2_a2a_ddp": (Layout(tp=2, comm="a2a"), DDP),
    "moe_ep2_cp2_zero3": (Layout(ep=2, moe=True), ZERO3),
    "moe_ep2_cp2_ddp": (Layout(ep=2, moe=True), DDP),
    "moe_ep2_cp2_per_token_zero3": (Layout(ep=2, moe=True, per_token=True), ZERO3),
}


@pytest.mark.parametrize("layout, engine", CASES.values(), ids=CASES.keys())
def test_context_parallel_gpt_trains_as_one_process(layout, engine):
    expected = reference_run(layout, WORLD // (layout.tp * layout.cp))
    results = run_distributed(engine_run, WORLD, layout, engine)
    for rank, actual in enumerate(results):
        actual.assert_matches(expected, f"rank {rank}")
