"""A multi-latent attention GPT under tensor parallelism and the data-parallel engines: at TP 2 x
DP 2 (with sequence parallelism and without, Megatron-FSDP ZeRO-3 and the DDP engine, the
up-projections recomputed) and at TP 1 x DP 4 it trains exactly as one process running the whole
global batch at TP 1: losses, global gradient norms and every global weight after two SGD steps
of two microbatches each. At TP 2 every rank's heads read the one rotated key, whose gradient
must be summed over the ranks. A tiny DeepSeek-V3 (MLA, a dense layer then an MoE layer with a
shared expert, sigmoid routing with the expert bias moved each step, group-limited top-k, one
multi-token prediction depth) trains so at TP 2 and at EP 2, under the DDP engine and every
Megatron-FSDP strategy. 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import MLATransformerConfig
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
from tests.unit_tests.model_builders import SEQ_LENGTH, VOCAB_SIZE

WORLD = 4
MLA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    q_lora_rank=12,
    kv_lora_rank=10,
    qk_head_dim=6,
    qk_pos_emb_head_dim=4,
    v_head_dim=5,
    qk_layernorm=True,
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=4,
    mscale=0.9,
    mscale_all_dim=0.6,
    gated_linear_unit=True,
    activation_func=F.silu,
)
"""Every width different; YaRN past its original length with a concentration factor."""
DEEPSEEK_V3 = dict(
    MLA,
    num_moe_experts=8,
    moe_ffn_hidden_size=16,
    moe_router_topk=2,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5,
    moe_shared_expert_intermediate_size=16,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=0.01,
    moe_z_loss_coeff=0.001,
    moe_layer_freq=[0, 1],
    moe_router_load_balancing_type="none",
    expert_tensor_parallel_size=1,
    add_bias_linear=False,
    mtp_num_layers=1,
    mtp_loss_scaling_factor=0.3,
)
"""A dense first layer, then an MoE layer with a shared expert and DeepSeek-V3's routing (sigmoid
scores, the top 2 experts of the best 2 of 4 groups, scaled, an expert bias whose step moves
the second step's choices), its experts whole (expert tensor parallelism 1); one multi-token
prediction depth. The load-balancing loss is off: data parallelism changes it."""
RECOMPUTE_UP_PROJ = dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"])


def build_mla_gpt(fields: dict, groups: ProcessGroupCollection | None) -> GPTLosses:
    """The MLA GPT of `fields` split as `groups` say (None: one process, TP 1 and EP 1), with its
    multi-token prediction depths where `fields` has `mtp_num_layers`."""
    tp = 1 if groups is None or groups.tp is None else groups.tp.size()
    ep = 1 if groups is None or groups.ep is None else groups.ep.size()
    fields = dict(fields)
    sequence_parallel = fields.pop("sequence_parallel", True)
    config = MLATransformerConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1 and sequence_parallel,
        expert_model_parallel_size=ep,
        seq_length=SEQ_LENGTH,
        **fields,
    )
    tp_rank = 0 if tp == 1 else groups.tp.rank()
    model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, device_type="cpu")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    gpt = GPTModel(
        config,
        spec,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        position_embedding_type="rope",
        pg_collection=groups,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )
    return GPTLosses(gpt)


def _train(fields: dict, engine: Engine, tp: int, ep: int = 1) -> RunResult:
    if ep == 1:
        return _run(fields, engine, tp_process_groups(tp))
    # Experts split over ep ranks at TP 1: parallel_state's groups.
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        return _run(fields, engine, ProcessGroupCollection.use_mpu_process_groups())
    finally:
        parallel_state.destroy_model_parallel()


def _run(fields: dict, engine: Engine, groups: ProcessGroupCollection) -> RunResult:
    model = wrap(build_mla_gpt(fields, groups), engine, TransformerLayer, pg_collection=groups)
    optimizer = get_megatron_optimizer(optimizer_config("sgd"), model)
    result = RunResult()
    dp = groups.dp_cp
    train_steps(model, optimizer, gpt_batches(dp.size()), result, dp.rank(), dp.size(), dp)
    result.weights = global_state(model.state_dict())
    return result


def _reference(fields: dict, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> RunResult:
    model = build_mla_gpt(fields, None)
    result = RunResult()
    train_steps(model, PlainOptimizer(model, "sgd"), batches, result)
    result.weights = global_state(model.state_dict())
    return result


ZERO3 = Engine("fsdp", "optim_grads_params")


@pytest.mark.parametrize(
    "fields, engine, tp, ep",
    [
        (dict(MLA, **RECOMPUTE_UP_PROJ), ZERO3, 2, 1),
        (dict(MLA, sequence_parallel=False), Engine("ddp"), 2, 1),
        (dict(MLA, q_lora_rank=None), Engine("ddp", gradient_accumulation_fusion=True), 2, 1),
        (MLA, ZERO3, 1, 1),
        (DEEPSEEK_V3, ZERO3, 2, 1),
        (DEEPSEEK_V3, Engine("fsdp", "optim"), 2, 1),
        (DEEPSEEK_V3, Engine("ddp"), 1, 2),
        (DEEPSEEK_V3, Engine("fsdp", "no_shard"), 1, 2),
        (DEEPSEEK_V3, Engine("fsdp", "optim_grads"), 1, 2),
    ],
    ids=[
        "tp2_sp_zero3_mla_up_proj",
        "tp2_no_sp_ddp",
        "tp2_sp_ddp_gradient_accumulation_fusion_no_q_lora",
        "tp1_dp4_zero3",
        "deepseek_v3_tp2_sp_zero3",
        "deepseek_v3_tp2_sp_optim",
        "deepseek_v3_ep2_ddp",
        "deepseek_v3_ep2_no_shard",
        "deepseek_v3_ep2_optim_grads",
    ],
)
def test_mla_gpt_trains_as_one_process(fields, engine, tp, ep):
    expected = _reference(fields, gpt_batches(WORLD // tp))
    results = run_distributed(_train, WORLD, fields, engine, tp, ep)
    for rank, actual in enumerate(results):
        actual.assert_matches(expected, f"rank {rank}")
