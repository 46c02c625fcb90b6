"""GPT with Mixture of Experts layers: layer placement, spec checks, recompute and EP-invariance."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import (
    GPTModel,
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import recompute as recompute_module
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    SEQ_LENGTH,
    VOCAB_SIZE,
    make_token_batches,
    tiny_gpt_config,
)

MOE = dict(
    num_moe_experts=4,
    moe_ffn_hidden_size=16,
    moe_aux_loss_coeff=0.01,
    moe_z_loss_coeff=0.001,
    add_bias_linear=False,
    gated_linear_unit=True,
    activation_func=F.silu,
)


def _config(**overrides) -> TransformerConfig:
    return tiny_gpt_config(**{"num_layers": 4, **MOE, **overrides})


def _gpt(config: TransformerConfig, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config, spec, vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH)
    return model.to(current_device())


def _moe_layers(model: GPTModel) -> list[int]:
    return [i for i, layer in enumerate(model.decoder.layers) if isinstance(layer.mlp, MoELayer)]


@pytest.mark.parametrize(
    "freq, expected", [(1, [0, 1, 2, 3]), (2, [0, 2]), (3, [0, 3]), ([0, 1, 1, 0], [1, 2])]
)
def test_moe_layer_freq_places_the_moe_layers(freq, expected):
    model = _gpt(_config(moe_layer_freq=freq, num_layers=4))
    assert _moe_layers(model) == expected
    assert [layer.mlp.layer_number for layer in model.decoder.layers if layer.is_moe_layer] == [
        i + 1 for i in expected
    ]


def test_dense_spec_with_moe_config_is_refused():
    sizes = dict(vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH)
    with pytest.raises(ValueError, match="get_gpt_decoder_block_spec"):
        GPTModel(_config(), get_gpt_layer_local_spec(), **sizes)
    dense = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="needs config.num_moe_experts"):
        GPTModel(dense, get_gpt_layer_local_spec(num_experts=4), **sizes)


def test_transformer_engine_moe_is_refused():
    with pytest.raises(ValueError, match="with Transformer Engine are not built"):
        get_gpt_decoder_block_spec(_config(), use_transformer_engine=True)
    with pytest.raises(ValueError, match="with Transformer Engine are not built"):
        get_gpt_layer_with_transformer_engine_spec(num_experts=4)


def _train_step(config: TransformerConfig) -> tuple[torch.Tensor, dict, dict]:
    destroy_moe_metrics_tracker()
    model = _gpt(config)
    tokens, labels = make_token_batches(1, 2)[0]
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    metrics = {name: values.clone() for name, values in get_moe_metrics_tracker().metrics.items()}
    counts = [
        layer.mlp.router.local_tokens_per_expert
        for layer in model.decoder.layers
        if isinstance(layer.mlp, MoELayer)
    ]
    return loss, grads, metrics | {"counts": torch.stack(counts)}


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="selective", recompute_modules=["moe"]),
        dict(recompute_granularity="selective", recompute_modules=["shared_experts", "mlp"]),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    ],
    ids=["moe", "shared_experts", "full"],
)
def test_recompute_keeps_gradients_and_records_metrics_once(recompute):
    moe = dict(
        num_layers=2,
        moe_layer_freq=[1, 0],  # a dense layer too, for the "mlp" of the shared_experts case
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=16,
        moe_input_jitter_eps=0.1,  # random: the recomputation must replay it
    )
    loss, grads, metrics = _train_step(_config(**moe))
    recomputations = []
    count = recompute_module._recomputing

    def counted():
        recomputations.append(1)
        return count()

    with mock.patch.object(recompute_module, "_recomputing", counted):
        loss_r, grads_r, metrics_r = _train_step(_config(**moe, **recompute))
    assert recomputations  # backward really ran the checkpointed modules again
    torch.testing.assert_close(loss_r, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, msg=name)
    assert metrics.keys() == metrics_r.keys() == {"z_loss", "load_balancing_loss", "counts"}
    for name, values in metrics.items():
        torch.testing.assert_close(metrics_r[name], values, msg=name)


def _ep_invariant_model(ep: int) -> None:
    config = dict(moe_token_dispatcher_type="alltoall", moe_layer_freq=[1, 0, 1, 0])
    reference = _gpt(_config(**config), seed=3)  # no groups yet: expert-parallel size 1
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model = _gpt(_config(**config, expert_model_parallel_size=ep), seed=3)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        if ".mlp.experts." in name:
            local = value.shape[0]
            assert torch.equal(value, expected[name][ep_rank * local : (ep_rank + 1) * local])
        else:
            assert torch.equal(value, expected[name]), name
    tokens, labels = make_token_batches(1, 2, seed=dist.get_rank())[0]
    tokens, labels = tokens.to(current_device()), labels.to(current_device())
    torch.testing.assert_close(model(tokens, labels=labels), reference(tokens, labels=labels))


def test_gpt_is_the_same_model_at_every_expert_parallel_size():
    run_distributed(_ep_invariant_model, 2, 2)
