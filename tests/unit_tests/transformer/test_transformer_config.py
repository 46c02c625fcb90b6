"""TransformerConfig / ModelParallelConfig: derived defaults and rejection of bad inputs."""

import dataclasses
import math
import pickle

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)


def test_derived_defaults():
    config = TransformerConfig(**BASE)
    assert config.ffn_hidden_size == 128
    assert config.kv_channels == 8
    assert config.num_query_groups == 4
    assert config.params_dtype == torch.float32


def test_query_key_layer_scaling_sets_the_fp32_softmax_as_upstream():
    scaled = dict(BASE, apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False)
    assert TransformerConfig(**scaled).attention_softmax_in_fp32 is True
    assert (
        TransformerConfig(**BASE, attention_softmax_in_fp32=False).attention_softmax_in_fp32
        is False
    )


def test_megatron_cores_minimal_example_config_builds():
    """Upstream's `run_simple_mcore_train_loop.py` config (before: TypeError on its fields)."""
    config = TransformerConfig(
        num_layers=2,
        hidden_size=12,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    assert config.perform_initialization and config.masked_softmax_fusion is False


def test_fp32_residual_connection_is_refused():
    with pytest.raises(ValueError, match="fp32 residual"):
        TransformerConfig(**BASE, fp32_residual_connection=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(window_size=(8,)), "two ints"),
        (dict(window_size=(8.0, 0)), "two ints"),
        (dict(window_size=(-2, 0)), "left side -2"),
        (dict(window_size=(8, 1)), "right side 1: the decoder is causal"),
        (dict(window_attn_skip_freq=2), "no window_size is set"),
        (dict(window_size=(8, 0), window_attn_skip_freq=0), "int N >= 1"),
        (dict(window_size=(8, 0), window_attn_skip_freq=[1, 0, 1]), "per layer"),
        (dict(window_size=(8, 0), window_attn_skip_freq=[1, 2]), "per layer"),
        (dict(softmax_type="sink"), "softmax_type must be one of"),
        (dict(glu_linear_offset=1.0), "gated MLP only"),
        (dict(activation_func_clamp_value=7.0), "gated MLP only"),
        (dict(gated_linear_unit=True, activation_func_clamp_value=0.0), "clamp_value"),
        (dict(window_size=(8, 0), attention_backend=AttnBackend.flash), "pins an SDPA kernel"),
        (dict(softmax_type="learnable", attention_backend=AttnBackend.unfused), "SDPA kernel"),
    ],
)
def test_bad_window_sink_and_glu_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**BASE, **overrides)


def test_cuda_graph_impls_that_are_not_built_are_refused():
    config = TransformerConfig(**BASE, cuda_graph_impl="full_iteration")
    assert config.cuda_graph_impl == "full_iteration"
    for impl in ("local", "transformer_engine", "full"):
        with pytest.raises(ValueError, match=f"cuda_graph_impl '{impl}': only 'none' and"):
            TransformerConfig(**BASE, cuda_graph_impl=impl)


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


def test_init_methods_are_derived_only_when_none():
    # Megatron-LM semantics: once derived, an init method is an ordinary value, so replace()
    # keeps the old depth's scale unless the caller resets it to None.
    torch.manual_seed(0)
    config = TransformerConfig(**BASE)
    kept = dataclasses.replace(config, num_layers=8)
    assert kept.init_method is config.init_method
    assert kept.output_layer_init_method is config.output_layer_init_method
    rederived = dataclasses.replace(config, num_layers=8, output_layer_init_method=None)
    weight = torch.empty(400, 400)
    rederived.output_layer_init_method(weight)
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
        (dict(num_query_groups=0), "num_query_groups"),
        (dict(num_query_groups=2.0), "num_query_groups"),
        (dict(kv_channels=0), "kv_channels"),
        (dict(kv_channels=8.0), "kv_channels"),
        (dict(ffn_hidden_size=0), "ffn_hidden_size"),
        (dict(ffn_hidden_size=64.0), "ffn_hidden_size"),
        (dict(normalization="BatchNorm"), "normalization"),
        (dict(hidden_dropout=1.0), "hidden_dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(layernorm_epsilon=0.0), "layernorm_epsilon"),
        (dict(recompute_granularity="partial"), "recompute_granularity"),
        (dict(init_method_std=-0.01), "init_method_std"),
        (dict(init_method_std=math.nan), "init_method_std=nan"),
        (dict(hidden_dropout=math.nan), "hidden_dropout=nan"),
        (dict(softmax_scale=math.inf), "softmax_scale=inf"),
        (dict(seq_length=0), "seq_length"),
        (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size"),
        (dict(pipeline_model_parallel_size=0), "pipeline_model_parallel_size"),
        (dict(pipeline_model_parallel_size=2, num_layers=3), "--num-layers 3 is not divisible"),
        (dict(context_parallel_size=0), "context_parallel_size"),
        (dict(sequence_parallel=True), "sequence_parallel"),
        (dict(fp16=True, bf16=True), "fp16 and bf16"),
        (dict(bf16=True, params_dtype=torch.float16), "params_dtype"),
        (dict(bf16=True), r"bf16=True needs params_dtype=torch\.bfloat16.*torch\.float32"),
        (dict(fp16=True), r"fp16=True needs params_dtype=torch\.float16.*torch\.float32"),
        (dict(fp16=True, params_dtype=torch.bfloat16), "params_dtype"),
        (dict(params_dtype=torch.int32), "params_dtype"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{**BASE, **overrides})


def test_precision_flags_need_the_matching_params_dtype():
    # The flags are never read to pick a dtype, so a flag without its dtype must not pass.
    assert TransformerConfig(**BASE, bf16=True, params_dtype=torch.bfloat16).bf16
    assert TransformerConfig(**BASE, fp16=True, params_dtype=torch.float16).fp16
    # params_dtype alone is enough; it is not forced to agree with an unset flag.
    assert not TransformerConfig(**BASE, params_dtype=torch.bfloat16).bf16


def test_expert_model_parallel_size_needs_experts_it_divides():
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 needs MoE layers"):
        TransformerConfig(**BASE, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"num_moe_experts \(6\) must be divisible"):
        TransformerConfig(**BASE, num_moe_experts=6, expert_model_parallel_size=4)
    with pytest.raises(ValueError, match=r"moe_ffn_hidden_size \(6\) must be divisible by exp"):
        TransformerConfig(
            **BASE, num_moe_experts=4, moe_ffn_hidden_size=6, expert_tensor_parallel_size=4
        )


def test_expert_tensor_parallel_size_defaults_to_the_tensor_parallel_size():
    config = TransformerConfig(
        **BASE, num_moe_experts=4, tensor_model_parallel_size=2, sequence_parallel=True
    )
    assert config.expert_tensor_parallel_size == 2
    assert ModelParallelConfig(expert_tensor_parallel_size=4).expert_tensor_parallel_size == 4
    with pytest.raises(ValueError, match="expert_tensor_parallel_size must be an integer >= 1"):
        ModelParallelConfig(expert_tensor_parallel_size=0)


def test_model_parallel_config_alone_validates():
    assert ModelParallelConfig(bf16=True, params_dtype=torch.bfloat16).bf16
    with pytest.raises(ValueError, match="bf16=True needs params_dtype"):
        ModelParallelConfig(bf16=True)
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size needs"):
        ModelParallelConfig(virtual_pipeline_model_parallel_size=2)
    config = ModelParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True)
    assert config.sequence_parallel
