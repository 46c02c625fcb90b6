"""The tensor-parallel GPT under the data-parallel engines: at TP 2 x DP 2 (sequence parallel,
GQA, SwiGLU, RoPE, untied output; and a Mixture-of-Experts GPT at EP 2 and 1, with experts whole
or split by expert tensor parallelism, also at TP 1) it trains exactly as one process running the
whole global batch at TP 1: losses, global gradient norms and every global weight after two
SGD-with-momentum steps of two microbatches each (the MoE GPT with a z-loss and no
load-balancing loss, which depends on how the batch is split). 4 gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.unit_tests.distributed.moe_training import (
    MICRO_BATCH,
    MICROBATCHES,
    Engine,
    RunResult,
    global_state,
    train_steps,
    wrap,
)
from tests.unit_tests.distributed.tp_training import (
    PlainOptimizer,
    optimizer_config,
    tp_process_groups,
)
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import SEQ_LENGTH, VOCAB_SIZE, tiny_gpt_config
from tests.unit_tests.models.test_gpt_moe import MOE

WORLD, TP, STEPS = 4, 2, 2
DENSE = dict(
    num_attention_heads=4,
    num_query_groups=2,
    gated_linear_unit=True,
    activation_func=F.silu,
    normalization="RMSNorm",
)


class GPTLosses(torch.nn.Module):
    """A GPT taking the engine tests' `(tokens, labels)`, returning per-sample mean losses."""

    def __init__(self, gpt: GPTModel):
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens, labels=labels).mean(dim=1)


def build_gpt(moe: bool, groups: ProcessGroupCollection | None) -> GPTLosses:
    """The (MoE) GPT split as `groups` say (None: one process, TP 1)."""
    tp = 1 if groups is None else groups.tp.size()
    # The load-balancing loss of a micro-batch is not the mean of its parts' (unlike the z-loss),
    # so it is off: data parallelism changes it, as in the EP engine tests.
    moe_fields = dict(MOE, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    fields = dict(DENSE, **moe_fields) if moe else DENSE
    config = tiny_gpt_config(
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        expert_model_parallel_size=_size(groups, "ep"),
        expert_tensor_parallel_size=_size(groups, "expt_tp"),
        seq_length=SEQ_LENGTH,
        **fields,
    )
    # CPU tensors, on the reference's process (no group) as on the gloo ranks.
    tp_rank = 0 if groups is None else groups.tp.rank()
    model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, device_type="cpu")
    gpt = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        position_embedding_type="rope",
        pg_collection=groups,
    )
    return GPTLosses(gpt)


def _size(groups: ProcessGroupCollection | None, name: str) -> int:
    group = None if groups is None else getattr(groups, name)
    return 1 if group is None else group.size()


def gpt_batches(dp: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of (tokens, labels) for `dp` data-parallel ranks."""
    generator = torch.Generator().manual_seed(0)
    size = dp * MICROBATCHES * MICRO_BATCH
    data = [
        torch.randint(0, VOCAB_SIZE, (size, SEQ_LENGTH + 1), generator=generator)
        for _ in range(steps)
    ]
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _train(moe: bool, engine: Engine, ep: int, etp: int | None, tp: int) -> RunResult:
    if etp is None:
        # Experts whole (expert tensor parallelism 1), groups made by hand once per process.
        groups = tp_process_groups(TP, engine.replicas)
        if ep > 1:
            # Upstream's expert order etp-ep-dp with etp 1: the ep groups are the tp groups'
            # ranks and the expert data-parallel groups the dense ones.
            fields = {f.name: getattr(groups, f.name) for f in dataclasses.fields(groups)}
            groups = ProcessGroupCollection(**dict(fields, ep=groups.tp, expt_dp=groups.dp_cp))
        return _run(moe, engine, groups)
    parallel_state.initialize_model_parallel(
        tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        num_distributed_optimizer_instances=engine.replicas,
    )
    try:
        return _run(moe, engine, ProcessGroupCollection.use_mpu_process_groups())
    finally:
        parallel_state.destroy_model_parallel()


def _run(moe: bool, engine: Engine, groups: ProcessGroupCollection) -> RunResult:
    model = wrap(build_gpt(moe, groups), engine, TransformerLayer, pg_collection=groups)
    optimizer = get_megatron_optimizer(optimizer_config("sgd"), model)
    result = RunResult()
    dp = groups.dp_cp
    train_steps(model, optimizer, gpt_batches(dp.size()), result, dp.rank(), dp.size(), dp)
    result.weights = global_state(model.state_dict())
    return result


def reference_gpt_run(moe: bool, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> RunResult:
    """The GPT at TP 1 on one process, trained by plain PyTorch on `batches`."""
    model = build_gpt(moe, None)
    result = RunResult()
    train_steps(model, PlainOptimizer(model, "sgd"), batches, result)
    result.weights = global_state(model.state_dict())
    return result


ZERO3 = Engine("fsdp", "optim_grads_params")


@pytest.mark.parametrize(
    "moe, engine, ep, etp, tp",
    [
        (False, ZERO3, 1, None, TP),
        (False, Engine("fsdp", "optim_grads"), 1, None, TP),
        (False, Engine("fsdp", "no_shard"), 1, None, TP),
        (False, Engine("ddp", distributed_optimizer=True), 1, None, TP),
        (False, Engine("ddp", gradient_accumulation_fusion=True), 1, None, TP),
        (True, ZERO3, 2, None, TP),
        (True, ZERO3, 1, None, TP),
        (True, Engine("ddp"), 2, None, TP),
        (True, Engine("ddp", gradient_accumulation_fusion=True), 2, None, TP),
        # Experts split over expt_tp (the tp ranks here) and ep: mesh (expt_tp, ep, expt_dp).
        (True, ZERO3, 2, 2, TP),
        (True, Engine("ddp", distributed_optimizer=True), 2, 2, TP),
        # At EP 1 with expt_tp the tp group, experts are dense parameters split over tp.
        (True, Engine("fsdp", "optim_grads"), 1, 2, TP),
        # Dense data parallelism over all 4 ranks, experts split over 2 x 2.
        (True, ZERO3, 2, 2, 1),
        (True, Engine("ddp"), 1, 2, 1),
    ],
    ids=[
        "zero3",
        "optim_grads",
        "no_shard",
        "ddp_distopt",
        "ddp_gradient_accumulation_fusion",
        "moe_ep2_zero3",
        "moe_ep1_zero3",
        "moe_ep2_ddp",
        "moe_ep2_ddp_gradient_accumulation_fusion",
        "moe_etp2_ep2_zero3",
        "moe_etp2_ep2_ddp_distopt",
        "moe_etp2_ep1_optim_grads",
        "moe_tp1_etp2_ep2_zero3",
        "moe_tp1_etp2_ep1_ddp",
    ],
)
def test_tensor_parallel_gpt_trains_as_one_process(moe, engine, ep, etp, tp):
    expected = reference_gpt_run(moe, gpt_batches(WORLD // tp))
    results = run_distributed(_train, WORLD, moe, engine, ep, etp, tp)
    for rank, actual in enumerate(results):
        actual.assert_matches(expected, f"rank {rank}")
