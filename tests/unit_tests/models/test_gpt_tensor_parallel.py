"""The GPT split over tensor-parallel (and sequence-parallel) ranks computes what the whole model
computes: on 4 gloo ranks, at TP 2 and 4, with and without sequence parallelism, the per-token
losses, the logits and the full gradients (gathered from the tp parts by their layouts) equal
those of a TP 1 model built from the same seed. Covered: grouped-query attention, SwiGLU, QK
norms, biases, tied and untied output layers, RoPE and learned positions; dropout in tp regions
replayed by activation recompute; also the errors for sizes that do not divide and for the
Transformer Engine layers, which are not split."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.extensions.transformer_engine import refuse_tensor_parallel
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    TensorParallelLayout,
    model_parallel_cuda_manual_seed,
    named_tensor_parallel_layouts,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed_harness import run_distributed

WORLD = 4
VOCAB = 64
SEQ = 8
BATCH = 2

VARIANTS = {
    # Grouped-query attention (8 heads, 4 groups), SwiGLU (fc1 of stride 2), RMSNorm, RoPE, an
    # untied output layer, no biases.
    "gqa_swiglu_rope_untied": dict(
        config=dict(
            num_attention_heads=8,
            num_query_groups=4,
            ffn_hidden_size=48,
            gated_linear_unit=True,
            activation_func=F.silu,
            normalization="RMSNorm",
            add_bias_linear=False,
        ),
        model=dict(position_embedding_type="rope", share_embeddings_and_output_weights=False),
    ),
    # Multi-head attention with QK layer norms, LayerNorm and linear biases, learned positions
    # and the output tied to the word embeddings.
    "qknorm_bias_learned_tied": dict(
        config=dict(num_attention_heads=4, qk_layernorm=True, add_bias_linear=True),
        model=dict(
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=True,
        ),
    ),
}


def _config(tp: int, sequence_parallel: bool, **overrides) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        seq_length=SEQ,
        **overrides,
    )


def _build(config: TransformerConfig, variant: dict, **kwargs) -> GPTModel:
    torch.manual_seed(1234)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        **variant["model"],
        **kwargs,
    )


def _tp_group(tp: int) -> dist.ProcessGroup:
    """This rank's group of `tp` consecutive ranks (every rank creates every group)."""
    mine = None
    for start in range(0, WORLD, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= dist.get_rank() < start + tp:
            mine = group
    return mine


def _gather_full(local: torch.Tensor, layout: TensorParallelLayout, group) -> torch.Tensor:
    """The global tensor whose tp parts (per `layout`) the ranks of `group` hold."""
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim, stride = layout.partition_dim, layout.partition_stride
    blocks = [part.chunk(stride, dim) for part in parts]
    return torch.cat([blocks[t][b] for b in range(stride) for t in range(len(parts))], dim)


def _check_against_reference(variant_name: str, tp: int, sequence_parallel: bool) -> None:
    variant = VARIANTS[variant_name]
    group = _tp_group(tp)
    model_parallel_cuda_manual_seed(1234, tp_rank=group.rank())
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[0, 0] = -100  # an ignored position: loss 0 on every rank as at TP 1

    reference = _build(_config(1, False, **variant["config"]), variant)
    pgs = ProcessGroupCollection(tp=group)
    config = _config(tp, sequence_parallel, **variant["config"])
    model = _build(config, variant, pg_collection=pgs)
    whole_logits_model = _build(config, variant, pg_collection=pgs, parallel_output=False)

    expected_loss = reference(tokens, labels=labels)
    loss = model(tokens, labels=labels)
    torch.testing.assert_close(loss, expected_loss)
    expected_loss.sum().backward()
    loss.sum().backward()

    layouts = named_tensor_parallel_layouts(model)
    reference_params = dict(reference.named_parameters())
    assert reference_params.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        grad, weight = param.grad, param.detach()
        if name in layouts:
            grad = _gather_full(grad, layouts[name], group)
            weight = _gather_full(weight, layouts[name], group)
        torch.testing.assert_close(weight, reference_params[name].detach(), msg=name)
        torch.testing.assert_close(grad, reference_params[name].grad, msg=name)

    with torch.no_grad():
        expected_logits = reference(tokens)
        torch.testing.assert_close(whole_logits_model(tokens), expected_logits)
        local = expected_logits.chunk(tp, dim=-1)[group.rank()]
        torch.testing.assert_close(model(tokens), local)


@pytest.mark.parametrize("variant_name", sorted(VARIANTS))
def test_gpt_tensor_parallel_matches_tp1(variant_name):
    for tp in (2, 4):
        for sequence_parallel in (False, True):
            run_distributed(_check_against_reference, WORLD, variant_name, tp, sequence_parallel)


def _refusals() -> list[str]:
    group = _tp_group(2)
    config = _config(2, False, num_attention_heads=4)
    with pytest.raises(ValueError, match="vocab_size .63. must be divisible") as vocab:
        GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=63,
            max_sequence_length=SEQ,
            pg_collection=ProcessGroupCollection(tp=group),
        )
    with pytest.raises(ValueError, match="TELinear with tensor parallelism") as te:
        refuse_tensor_parallel("TELinear", group)
    refuse_tensor_parallel("TELinear", None)  # no tp group: nothing to refuse
    return [str(vocab.value), str(te.value)]


def test_vocab_size_not_divisible_and_te_layers_are_refused_on_every_rank():
    for vocab, te in run_distributed(_refusals, WORLD):
        assert "pad the vocabulary" in vocab
        assert "use the local spec" in te


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_attention_heads=6, tensor_model_parallel_size=4), "num_attention_heads"),
        (
            dict(num_attention_heads=8, num_query_groups=2, tensor_model_parallel_size=4),
            "num_query_groups",
        ),
        (dict(ffn_hidden_size=30, tensor_model_parallel_size=4), "ffn_hidden_size"),
        (
            dict(
                num_moe_experts=4,
                moe_shared_expert_intermediate_size=30,
                add_bias_linear=False,
                tensor_model_parallel_size=4,
                sequence_parallel=True,
            ),
            "moe_shared_expert_intermediate_size",
        ),
        (dict(seq_length=6, tensor_model_parallel_size=4, sequence_parallel=True), "seq_length"),
    ],
)
def test_sizes_not_divisible_by_tp_are_refused(overrides, field):
    fields = dict(num_layers=2, hidden_size=48, num_attention_heads=8)
    fields.update(overrides)
    with pytest.raises(ValueError, match=field) as info:
        TransformerConfig(**fields)
    assert "tensor_model_parallel_size" in str(info.value)


def test_tp_config_that_divides_is_accepted():
    config = TransformerConfig(
        num_layers=2,
        hidden_size=48,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=96,
        tensor_model_parallel_size=4,
        sequence_parallel=True,
        seq_length=8,
    )
    assert dataclasses.replace(config, tensor_model_parallel_size=2).num_query_groups == 4


def _dropout_replayed_by_recompute(sequence_parallel: bool) -> torch.Tensor:
    group = _tp_group(2)
    variant = VARIANTS["gqa_swiglu_rope_untied"]
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    config = dataclasses.replace(
        _config(2, sequence_parallel, **variant["config"]),
        hidden_dropout=0.2,
        attention_dropout=0.2,
    )
    grads = []
    for recompute in (None, "full"):
        model = _build(
            dataclasses.replace(config, recompute_granularity=recompute),
            variant,
            pg_collection=ProcessGroupCollection(tp=group),
        )
        model_parallel_cuda_manual_seed(7, tp_rank=group.rank())
        loss = model(tokens, labels=tokens)
        loss.sum().backward()
        grads.append([param.grad for param in model.parameters()])
    for stored, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, stored)
    # The dropout is on: a second run continues the generators and draws other masks.
    assert not torch.equal(loss, model(tokens, labels=tokens))
    return loss.detach()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_in_tp_regions_is_replayed_by_recompute(sequence_parallel):
    losses = run_distributed(_dropout_replayed_by_recompute, WORLD, sequence_parallel)
    # The loss is one value per tp group, whatever rank computes it.
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(losses[2], losses[3])
