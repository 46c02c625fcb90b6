"""The GPT's parts that see positions or whole sequences, under context parallelism: at CP 2
(and 4), each rank's per-token losses are its chunks of the single-process GPT's, and the
gradients summed over the ranks are the single-process GPT's, for multi-latent attention (its own
YaRN angles), multi-token prediction (tokens, labels and positions shifted across the chunks'
borders; its losses averaged over whole sequences), learned absolute positions, and sliding
windows with learnable softmax sinks under all-to-all attention. Ring and all-gather attention
refuse windows, sinks and attention dropout by name. gloo ranks."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.context_parallel import get_batch_on_this_cp_rank, split_sequence
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from tests.unit_tests.distributed_harness import run_distributed

SEQ, BATCH, VOCAB = 16, 2, 64
COMMON = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    normalization="RMSNorm",
    gated_linear_unit=True,
    activation_func=F.silu,
    seq_length=SEQ,
)
MLA = dict(
    q_lora_rank=12,
    kv_lora_rank=8,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    qk_layernorm=True,
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=4,
    mscale=0.9,
    mscale_all_dim=0.6,
)


@dataclasses.dataclass(frozen=True)
class Case:
    comm: str
    fields: dict = dataclasses.field(default_factory=dict)
    mla: bool = False
    positions: str = "rope"


CASES = {
    "mla_p2p": Case("p2p", MLA, mla=True),
    "mla_a2a": Case("a2a", MLA, mla=True),
    "mtp_p2p": Case("p2p", dict(mtp_num_layers=2, num_query_groups=2)),
    "mtp_learned_positions_a2a": Case("a2a", dict(mtp_num_layers=1), positions="learned_absolute"),
    "learned_positions_allgather": Case("allgather", positions="learned_absolute"),
    "window_and_sinks_a2a": Case(
        "a2a", dict(window_size=(5, 0), window_attn_skip_freq=2, softmax_type="learnable")
    ),
}


def build(case: Case, cp: int) -> GPTModel:
    config_class = MLATransformerConfig if case.mla else TransformerConfig
    config = config_class(**COMMON, **case.fields, context_parallel_size=cp, cp_comm_type=case.comm)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    torch.manual_seed(1234)
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type=case.positions,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    loss_mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.3).float()
    weights = torch.rand(BATCH, SEQ, generator=generator)
    return dict(tokens=data[:, :-1], labels=data[:, 1:], loss_mask=loss_mask, weights=weights)


def losses_and_grads(model: GPTModel, data: dict[str, torch.Tensor]):
    """Per-token losses, and the gradients of their weighted sum (multi-token prediction's
    losses joining in backward)."""
    losses = model(data["tokens"], labels=data["labels"], loss_mask=data["loss_mask"])
    (losses * data["weights"]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return losses.detach(), grads


def _context_parallel_run(case: Case, cp: int):
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    group = parallel_state.get_context_parallel_group()
    local = get_batch_on_this_cp_rank(batch(), group)
    losses, grads = losses_and_grads(build(case, cp), local)
    for grad in grads.values():
        dist.all_reduce(grad, group=group)
    return losses, grads


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gpt_at_cp2_matches_one_process(case):
    _check(case, 2)


def test_multi_token_prediction_at_cp4_matches_one_process():
    _check(CASES["mtp_p2p"], 4)


def _check(case: Case, cp: int):
    expected_losses, expected_grads = losses_and_grads(build(case, 1), batch())
    for rank, (losses, grads) in enumerate(run_distributed(_context_parallel_run, cp, case, cp)):
        torch.testing.assert_close(losses, split_sequence(expected_losses, 1, rank, cp))
        assert grads.keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("comm", ["p2p", "allgather"])
@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(attention_dropout=0.1), "attention_dropout=0.1"),
        (dict(window_size=(5, 0)), "window_size=(5, 0)"),
        (dict(softmax_type="off-by-one"), "softmax_type='off-by-one'"),
    ],
)
def test_ring_and_all_gather_refuse_what_their_kernels_lack(comm, fields, named):
    expected = rf"{re.escape(named)} \(--[a-z-]+\) with context_parallel_size=2 .*cp_comm_type a2a"
    with pytest.raises(ValueError, match=expected):
        TransformerConfig(**dict(COMMON, **fields), context_parallel_size=2, cp_comm_type=comm)


def test_unknown_and_hierarchical_comm_types_are_refused():
    with pytest.raises(ValueError, match="a2a\\+p2p .*hierarchical-context-parallel-sizes"):
        TransformerConfig(**COMMON, context_parallel_size=2, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        TransformerConfig(**COMMON, cp_comm_type="ring")
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size 4"):
        TransformerConfig(**dict(COMMON, seq_length=12), context_parallel_size=4)
