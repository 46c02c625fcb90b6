"""A tiny gpt-oss-style GPT (sliding windows on alternate layers, learnable softmax sinks, MoE
experts with gpt-oss's clamped quick-GELU GLU, biases in every linear layer and the router,
grouped-query attention, RoPE) on 2 gloo ranks trains exactly as one process running the whole
global batch at TP 1 and EP 1, plain PyTorch: losses, global gradient norms and every global
weight after two SGD-with-momentum steps of two microbatches, at TP 2 (the sinks split by head,
sequence parallel), at EP 2 and at DP 2, under the DDP engine and every Megatron-FSDP
strategy."""

from __future__ import annotations

import pytest

from megatron.core import parallel_state
from megatron.core.activations import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.unit_tests.distributed.moe_training import (
    Engine,
    RunResult,
    global_state,
    train_steps,
    wrap,
)
from tests.unit_tests.distributed.test_gpt_tensor_parallel_engines import GPTLosses, gpt_batches
from tests.unit_tests.distributed.tp_training import (
    PlainOptimizer,
    optimizer_config,
    tp_process_groups,
)
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import SEQ_LENGTH, VOCAB_SIZE, tiny_gpt_config

WORLD = 2
GPT_OSS = dict(
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    normalization="RMSNorm",
    window_size=(2, 0),
    window_attn_skip_freq=2,
    softmax_type="learnable",
    gated_linear_unit=True,
    activation_func=quick_gelu,
    glu_linear_offset=1.0,
    activation_func_clamp_value=0.5,
    init_method_std=0.1,  # large enough for the clamp to cut
    add_bias_linear=True,
    num_moe_experts=4,
    moe_ffn_hidden_size=16,
    moe_router_topk=2,
    # The load-balancing loss of a micro-batch is not the mean of its parts' (data
    # parallelism changes it, as in the other engine tests); the z-loss is.
    moe_router_load_balancing_type="none",
    moe_z_loss_coeff=1e-3,
)


def build_gpt_oss(groups: ProcessGroupCollection | None) -> GPTLosses:
    """The gpt-oss-style GPT split as `groups` say (None: one process, TP 1 and EP 1)."""
    tp = 1 if groups is None or groups.tp is None else groups.tp.size()
    # Each expert whole (expert tensor parallelism 1), on every rank or split over ep.
    config = tiny_gpt_config(
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        expert_model_parallel_size=1 if groups is None or groups.ep is None else groups.ep.size(),
        expert_tensor_parallel_size=1,
        seq_length=SEQ_LENGTH,
        **GPT_OSS,
    )
    tp_rank = 0 if tp == 1 else groups.tp.rank()
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


def _train(engine: Engine, tp: int, ep: int) -> RunResult:
    if ep == 1:
        return _run(engine, tp_process_groups(tp))
    # Experts split over ep ranks at TP 1: parallel_state's groups.
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        return _run(engine, ProcessGroupCollection.use_mpu_process_groups())
    finally:
        parallel_state.destroy_model_parallel()


def _run(engine: Engine, groups: ProcessGroupCollection) -> RunResult:
    model = wrap(build_gpt_oss(groups), engine, TransformerLayer, pg_collection=groups)
    optimizer = get_megatron_optimizer(optimizer_config("sgd"), model)
    result = RunResult()
    dp = groups.dp_cp
    train_steps(model, optimizer, gpt_batches(dp.size()), result, dp.rank(), dp.size(), dp)
    result.weights = global_state(model.state_dict())
    return result


def _reference(dp: int) -> RunResult:
    model = build_gpt_oss(None)
    result = RunResult()
    train_steps(model, PlainOptimizer(model, "sgd"), gpt_batches(dp), result)
    result.weights = global_state(model.state_dict())
    return result


ZERO3 = Engine("fsdp", "optim_grads_params")


@pytest.mark.parametrize(
    "engine, tp, ep",
    [
        (Engine("ddp"), 2, 1),
        (ZERO3, 2, 1),
        (Engine("fsdp", "optim_grads"), 2, 1),
        (ZERO3, 1, 1),
        (Engine("ddp", distributed_optimizer=True), 1, 2),
        (Engine("fsdp", "no_shard"), 1, 2),
        (Engine("fsdp", "optim"), 1, 2),
    ],
    ids=[
        "tp2_ddp",
        "tp2_zero3",
        "tp2_optim_grads",
        "dp2_zero3",
        "ep2_ddp_distopt",
        "ep2_no_shard",
        "ep2_optim",
    ],
)
def test_gpt_oss_trains_as_one_process(engine, tp, ep):
    expected = _reference(WORLD // tp)
    sinks = [name for name in expected.weights if name.endswith("softmax_offset")]
    assert len(sinks) == 2
    biases = [name for name in expected.weights if name.endswith("bias")]
    # qkv, proj, router, fc1, fc2 of each layer (expert_bias is not a bias of a linear layer).
    assert len([name for name in biases if "expert_bias" not in name]) == 10, biases
    results = run_distributed(_train, WORLD, engine, tp, ep)
    for rank, actual in enumerate(results):
        actual.assert_matches(expected, f"rank {rank}")
