"""TransformerConfig / ModelParallelConfig: derived defaults and rejection of bad inputs."""

import dataclasses
import math
import pickle

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)


def test_derived_defaults():
    config = TransformerConfig(**BASE)
    assert config.ffn_hidden_size == 128
    assert config.kv_channels == 8
    assert config.num_query_groups == 4
    assert config.params_dtype == torch.float32


def test_explicit_kv_channels_lift_the_divisibility_requirement():
    config = TransformerConfig(num_layers=1, hidden_size=30, num_attention_heads=4, kv_channels=8)
    assert config.kv_channels == 8


def test_default_init_methods_follow_megatron():
    torch.manual_seed(0)
    config = TransformerConfig(**BASE, init_method_std=0.05)
    weight = torch.empty(400, 400)
    config.init_method(weight)
    assert weight.std().item() == pytest.approx(0.05, rel=0.03)
    config.output_layer_init_method(weight)
    assert weight.std().item() == pytest.approx(0.05 / math.sqrt(2 * 2), rel=0.03)


def test_replace_rederives_default_init_methods_but_keeps_custom_ones():
    torch.manual_seed(0)
    deeper = dataclasses.replace(TransformerConfig(**BASE), num_layers=8)
    weight = torch.empty(400, 400)
    deeper.output_layer_init_method(weight)
    assert weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.03)
    custom = TransformerConfig(**BASE, init_method=torch.nn.init.zeros_)
    assert dataclasses.replace(custom, num_layers=8).init_method is torch.nn.init.zeros_


def test_config_survives_pickling():
    # Spawned ranks receive configs by pickle; a lambda init method would break that.
    config = pickle.loads(pickle.dumps(TransformerConfig(**BASE)))
    weight = torch.empty(300, 300)
    config.init_method(weight)
    assert weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(hidden_size=30), "kv_channels"),
        (dict(num_query_groups=3), "num_query_groups"),
        (dict(ffn_hidden_size=0), "ffn_hidden_size"),
        (dict(normalization="BatchNorm"), "normalization"),
        (dict(hidden_dropout=1.0), "hidden_dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(layernorm_epsilon=0.0), "layernorm_epsilon"),
        (dict(recompute_granularity="partial"), "recompute_granularity"),
        (dict(init_method_std=0.0), "init_method_std"),
        (dict(seq_length=0), "seq_length"),
        (dict(tensor_model_parallel_size=2), "tensor_model_parallel_size"),
        (dict(pipeline_model_parallel_size=2), "pipeline_model_parallel_size"),
        (dict(context_parallel_size=0), "context_parallel_size"),
        (dict(expert_model_parallel_size=0), "expert_model_parallel_size"),
        (dict(sequence_parallel=True), "sequence_parallel"),
        (dict(fp16=True, bf16=True), "fp16 and bf16"),
        (dict(bf16=True, params_dtype=torch.float16), "params_dtype"),
        (dict(params_dtype=torch.int32), "params_dtype"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{**BASE, **overrides})


def test_model_parallel_config_alone_validates():
    assert ModelParallelConfig(bf16=True, params_dtype=torch.bfloat16).bf16
    with pytest.raises(ValueError, match="not supported yet"):
        ModelParallelConfig(tensor_model_parallel_size=4)
