"""The configs the flags describe: every `DistributedDataParallelConfig` and `TransformerConfig`
field a flag sets, the keyword arguments of `initialize_model_parallel()`, and a GPT model built
from the flags."""

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.activations import quick_gelu
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel_config import (
    SPEED_ONLY_FIELDS,
    UNBUILT_FIELDS,
)
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.training.arguments import (
    core_transformer_config_from_args,
    get_megatron_ddp_config,
    get_parallel_state_kwargs,
)
from tests.unit_tests.training.flag_checks import FSDP, HFSDP, ZERO3
from tests.unit_tests.training.flag_checks import validated as validated_on


def validated(*flags: str):
    return validated_on(*flags, world_size=4)


DDP_CONFIG_CASES = [
    (FSDP, "use_megatron_fsdp", True),
    (ZERO3, "data_parallel_sharding_strategy", "optim_grads_params"),
    (HFSDP, "outer_dp_sharding_strategy", "optim"),
    (f"{FSDP} --num-distributed-optimizer-instances 2", "num_distributed_optimizer_instances", 2),
    (
        f"{FSDP} --no-fsdp-all-gather-in-start-param-sync",
        "fsdp_all_gather_in_start_param_sync",
        False,
    ),
    (f"{FSDP} --use-symm-mem --distributed-backend nccl", "use_symm_mem", True),
    (f"{FSDP} --overlap-param-gather", "overlap_param_gather", True),
    (
        f"{FSDP} --suggested-communication-unit-size 1000000",
        "suggested_communication_unit_size",
        1000000,
    ),
    ("--overlap-grad-reduce", "overlap_grad_reduce", True),
    ("--grad-reduce-in-fp32", "grad_reduce_in_fp32", True),
    (
        f"{FSDP} --megatron-fsdp-main-params-dtype bf16",
        "megatron_fsdp_main_params_dtype",
        torch.bfloat16,
    ),
    (f"{FSDP} --megatron-fsdp-main-params-dtype auto", "megatron_fsdp_main_params_dtype", None),
    (
        f"{FSDP} --megatron-fsdp-main-grads-dtype bf16",
        "megatron_fsdp_main_grads_dtype",
        torch.bfloat16,
    ),
    (
        f"{FSDP} --megatron-fsdp-main-grads-dtype fp32",
        "megatron_fsdp_main_grads_dtype",
        torch.float32,
    ),
    (
        f"{FSDP} --megatron-fsdp-grad-comm-dtype fp16",
        "megatron_fsdp_grad_comm_dtype",
        torch.float16,
    ),
    (
        f"{ZERO3} --megatron-fsdp-keep-unsharded-params",
        "megatron_fsdp_keep_unsharded_params",
        True,
    ),
    (
        f"{FSDP} --megatron-fsdp-accumulate-unsharded-grads",
        "megatron_fsdp_accumulate_unsharded_grads",
        True,
    ),
    ("--ddp-bucket-size 1000", "bucket_size", 1000),
    ("--ddp-average-in-collective", "average_in_collective", True),
    ("--use-distributed-optimizer", "use_distributed_optimizer", True),
]
"""(flags, DistributedDataParallelConfig field, value the flags give it)."""


@pytest.mark.parametrize("flags, field, value", DDP_CONFIG_CASES)
def test_flag_reaches_ddp_config(cuda_available, flags, field, value):
    config = get_megatron_ddp_config(validated(*flags.split()))
    assert getattr(config, field) == value
    baseline = get_megatron_ddp_config(validated())
    assert getattr(baseline, field) != value, "the flags must change the field"


def test_every_ddp_config_field_has_a_flag():
    # check_for_nan_in_grad stays off: the training loop checks the global grad norm instead.
    # Megatron-core's fields with no effect or of unbuilt features, for library code: most have
    # no flag here (those that do are documented no-ops or refused by name), and the flags
    # leave them at their defaults.
    covered = (
        {field for _, field, _ in DDP_CONFIG_CASES}
        | {"check_for_nan_in_grad", "fp8_param_gather", "keep_fp8_transpose_cache"}
        | SPEED_ONLY_FIELDS
        | set(UNBUILT_FIELDS)
    )
    assert covered == {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}


@pytest.mark.parametrize("engine", [FSDP, "--use-distributed-optimizer"])
def test_fp8_param_gather_reaches_ddp_config(cuda_unavailable, engine):
    """On CPU: FP8 flags check the GPU's compute capability where CUDA is present."""
    flags = f"{engine} --bf16 --fp8-format hybrid --fp8-param-gather".split()
    assert get_megatron_ddp_config(validated(*flags)).fp8_param_gather
    assert not get_megatron_ddp_config(validated(*flags[:-1])).fp8_param_gather


def test_keep_fp8_transpose_cache_reaches_ddp_config(cuda_unavailable):
    flags = f"{FSDP} --bf16 --fp8-format hybrid --fp8-param-gather".split()
    kept = get_megatron_ddp_config(validated(*flags, "--keep-fp8-transpose-cache"))
    assert kept.keep_fp8_transpose_cache and kept.fp8_param_gather
    assert not get_megatron_ddp_config(validated(*flags)).keep_fp8_transpose_cache


@pytest.mark.parametrize("flag", ["--check-for-nan-in-loss-and-grad", ""])
def test_nan_check_flag_leaves_the_ddp_engine_check_off(flag):
    """The DDP engine's check raises on one rank while the others hang in the all-reduce."""
    assert get_megatron_ddp_config(validated(*flag.split())).check_for_nan_in_grad is False


_GROUPS = "--moe-router-num-groups 2 --moe-router-group-topk 1"
_EXPERT_BIAS = "--moe-router-score-function sigmoid --moe-router-enable-expert-bias"
_PAD = "--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity"
_SHARED = "--disable-bias-linear --moe-shared-expert-intermediate-size 32"
_YARN = "--position-embedding-type yarn"

PP2 = "--pipeline-model-parallel-size 2 --num-layers 4"
TRANSFORMER_CONFIG_CASES = [
    ("--num-layers 3", "num_layers", 3),
    ("--swiglu", "bias_activation_fusion", True),  # --no-bias-swiglu-fusion: test_model_flags
    (
        "--pipeline-model-parallel-size 2 --num-layers 4 --num-virtual-stages-per-pipeline-rank 2 "
        "--global-batch-size 8",
        "virtual_pipeline_model_parallel_size",
        2,
    ),
    (  # on by default with virtual stages (upstream's), off without
        "--pipeline-model-parallel-size 2 --num-layers 4 --num-virtual-stages-per-pipeline-rank 2 "
        "--global-batch-size 8",
        "overlap_p2p_comm",
        True,
    ),
    (f"{PP2} --decoder-first-pipeline-num-layers 1", "num_layers_in_first_pipeline_stage", 1),
    (f"{PP2} --decoder-last-pipeline-num-layers 1", "num_layers_in_last_pipeline_stage", 1),
    (
        "--pipeline-model-parallel-size 2 --num-layers 3 --account-for-embedding-in-pipeline-split",
        "account_for_embedding_in_pipeline_split",
        True,
    ),
    (
        "--pipeline-model-parallel-size 2 --num-layers 3 --account-for-loss-in-pipeline-split",
        "account_for_loss_in_pipeline_split",
        True,
    ),
    ("--hidden-size 96", "hidden_size", 96),
    ("--num-attention-heads 8", "num_attention_heads", 8),
    ("--group-query-attention --num-query-groups 2", "num_query_groups", 2),
    ("--ffn-hidden-size 100", "ffn_hidden_size", 100),
    ("--kv-channels 8", "kv_channels", 8),
    # Its own fields: tests/unit_tests/training/test_mla_flags.py.
    ("--multi-latent-attention", "multi_latent_attention", True),
    ("--hidden-dropout 0.0", "hidden_dropout", 0.0),
    ("--attention-dropout 0.2", "attention_dropout", 0.2),
    ("--norm-epsilon 1e-6", "layernorm_epsilon", 1e-6),
    ("--normalization RMSNorm", "normalization", "RMSNorm"),
    ("--swiglu", "gated_linear_unit", True),
    ("--swiglu", "activation_func", F.silu),
    ("--disable-bias-linear", "add_bias_linear", False),
    ("--add-qkv-bias", "add_qkv_bias", True),
    ("--init-method-std 0.01", "init_method_std", 0.01),
    (
        "--apply-residual-connection-post-layernorm",
        "apply_residual_connection_post_layernorm",
        True,
    ),
    ("--recompute-granularity selective", "recompute_granularity", "selective"),
    (
        "--recompute-granularity full --recompute-method block --recompute-num-layers 1",
        "recompute_granularity",
        "full",
    ),
    (
        "--recompute-granularity full --recompute-method block --recompute-num-layers 1",
        "recompute_method",
        "block",
    ),
    (
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
        "recompute_num_layers",
        2,
    ),
    (
        "--recompute-granularity selective --recompute-modules mlp layernorm",
        "recompute_modules",
        ["mlp", "layernorm"],
    ),
    ("--apply-layernorm-1p", "layernorm_zero_centered_gamma", True),
    ("--qk-layernorm", "qk_layernorm", True),
    ("--qk-l2-norm", "qk_l2_norm", True),
    ("--position-embedding-type rope --rotary-interleaved", "rotary_interleaved", True),
    ("--no-rope-fusion", "apply_rope_fusion", False),
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", False),
    ("--apply-query-key-layer-scaling", "apply_query_key_layer_scaling", True),
    # Megatron-LM's flag defaults to off although the config field defaults to on.
    ("--attention-softmax-in-fp32", "attention_softmax_in_fp32", True),
    ("--attention-backend local", "attention_backend", AttnBackend.local),
    ("--cross-entropy-loss-fusion", "cross_entropy_loss_fusion", True),
    ("--cross-entropy-fusion-impl te", "cross_entropy_fusion_impl", "te"),
    ("--compile-layers", "compile_layers", True),
    ("--compile-layers --compile-backend aot_eager", "compile_backend", "aot_eager"),
    ("--compile-layers --no-compile-cpp-wrapper", "compile_cpp_wrapper", False),
    ("--seq-length 16", "seq_length", 16),
    ("--bf16", "bf16", True),
    ("--bf16", "params_dtype", torch.bfloat16),
    ("--fp16", "fp16", True),
    ("--calculate-per-token-loss", "calculate_per_token_loss", True),
    *(
        (f"--num-experts 4 {flags}".strip(), field, value)
        for flags, field, value in [
            ("", "num_moe_experts", 4),
            ("--expert-model-parallel-size 2", "expert_model_parallel_size", 2),
            ("--expert-tensor-parallel-size 2", "expert_tensor_parallel_size", 2),
            ("--moe-ffn-hidden-size 48", "moe_ffn_hidden_size", 48),
            ("--moe-router-topk 3", "moe_router_topk", 3),
            ("--moe-router-score-function sigmoid", "moe_router_score_function", "sigmoid"),
            ("--moe-router-pre-softmax", "moe_router_pre_softmax", True),
            ("--moe-router-topk-scaling-factor 2.5", "moe_router_topk_scaling_factor", 2.5),
            ("--moe-router-dtype fp32", "moe_router_dtype", "fp32"),
            (_GROUPS, "moe_router_num_groups", 2),
            (_GROUPS, "moe_router_group_topk", 1),
            (_EXPERT_BIAS, "moe_router_enable_expert_bias", True),
            ("--moe-router-bias-update-rate 1e-2", "moe_router_bias_update_rate", 1e-2),
            (
                "--moe-router-load-balancing-type seq_aux_loss",
                "moe_router_load_balancing_type",
                "seq_aux_loss",
            ),
            ("--moe-aux-loss-coeff 1e-2", "moe_aux_loss_coeff", 1e-2),
            ("--moe-z-loss-coeff 1e-3", "moe_z_loss_coeff", 1e-3),
            ("--moe-input-jitter-eps 0.1", "moe_input_jitter_eps", 0.1),
            ("--moe-router-force-load-balancing", "moe_router_force_load_balancing", True),
            ("--moe-token-dispatcher-type alltoall", "moe_token_dispatcher_type", "alltoall"),
            ("--moe-expert-capacity-factor 1.5", "moe_expert_capacity_factor", 1.5),
            ("--moe-token-drop-policy position", "moe_token_drop_policy", "position"),
            (_PAD, "moe_pad_expert_input_to_capacity", True),
            (
                "--moe-grouped-gemm --moe-pad-dispatch-to-worst-case",
                "moe_pad_dispatch_to_worst_case",
                True,
            ),
            ("--moe-grouped-gemm", "moe_grouped_gemm", True),
            (_SHARED, "moe_shared_expert_intermediate_size", 32),
            (f"{_SHARED} --moe-shared-expert-gate", "moe_shared_expert_gate", True),
            ("--moe-layer-freq [0,1]", "moe_layer_freq", [0, 1]),
            ("--moe-per-layer-logging", "moe_per_layer_logging", True),
        ]
    ),
    ("--window-size 7,0", "window_size", (7, 0)),
    ("--window-size (7,-1) --window-attn-skip-freq 2", "window_attn_skip_freq", 2),
    ("--window-size 7,0 --window-attn-skip-freq [1,0]", "window_attn_skip_freq", [1, 0]),
    ("--softmax-type learnable", "softmax_type", "learnable"),
    ("--softmax-type off-by-one", "softmax_type", "off-by-one"),
    ("--quick-geglu", "activation_func", quick_gelu),
    ("--quick-geglu", "gated_linear_unit", True),
    ("--quick-geglu --glu-linear-offset 1.0", "glu_linear_offset", 1.0),
    ("--swiglu --activation-func-clamp-value 7", "activation_func_clamp_value", 7.0),
    ("--fp8-format hybrid", "fp8", "hybrid"),
    ("--fp8-format e4m3 --fp8-recipe tensorwise", "fp8_recipe", "tensorwise"),
    ("--fp8-format e4m3 --fp8-margin 1", "fp8_margin", 1),
    ("--fp8-format e4m3 --fp8-interval 2", "fp8_interval", 2),  # warns, as upstream
    ("--fp8-format e4m3 --fp8-amax-history-len 16", "fp8_amax_history_len", 16),
    ("--fp8-format e4m3 --fp8-amax-compute-algo max", "fp8_amax_compute_algo", "max"),
    ("--fp8-format e4m3 --no-fp8-wgrad", "fp8_wgrad", False),
    (
        "--fp8-format e4m3 --fp8-recipe tensorwise --first-last-layers-bf16",
        "first_last_layers_bf16",
        True,
    ),
    (
        "--fp8-format e4m3 --fp8-recipe tensorwise --first-last-layers-bf16 "
        "--num-layers-at-start-in-bf16 2",
        "num_layers_at_start_in_bf16",
        2,
    ),
    (
        "--fp8-format e4m3 --fp8-recipe tensorwise --first-last-layers-bf16 "
        "--num-layers-at-end-in-bf16 0",
        "num_layers_at_end_in_bf16",
        0,
    ),
    ("--mtp-num-layers 2", "mtp_num_layers", 2),
    ("--cp-comm-type a2a", "cp_comm_type", "a2a"),
    ("--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3", "mtp_loss_scaling_factor", 0.3),
    *(
        (f"{_YARN} {flags}", field, value)
        for flags, field, value in [
            ("--rotary-scaling-factor 4", "yarn_rotary_scaling_factor", 4.0),
            (
                "--yarn-original-max-position-embeddings 16",
                "yarn_original_max_position_embeddings",
                16,
            ),
            ("--yarn-beta-fast 8", "yarn_beta_fast", 8.0),
            ("--yarn-beta-slow 2", "yarn_beta_slow", 2.0),
            ("--mscale 0.5", "yarn_mscale", 0.5),
            ("--mscale-all-dim 0.5", "yarn_mscale_all_dim", 0.5),
            (
                "--no-yarn-correction-range-round-to-int",
                "yarn_correction_range_round_to_int",
                False,
            ),
        ]
    ),
]
"""(flags, TransformerConfig field, value the flags give it)."""
# Set from the flags only at their single supported value, or derived by TransformerConfig.
_NOT_FROM_A_FLAG = {
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "sequence_parallel",
    "moe_shared_expert_overlap",  # its flag is refused (not built)
    "init_method",
    "output_layer_init_method",
    # Megatron-core's fields for library code: no flag upstream (softmax_scale), flags that
    # change nothing here or are refused (not built), or no effect.
    "softmax_scale",
    "masked_softmax_fusion",
    "bias_dropout_fusion",
    "persist_layer_norm",
    "memory_efficient_layer_norm",
    "fp32_residual_connection",
    "perform_initialization",
    "use_cpu_initialization",
    "pipeline_dtype",
    # Its flag is refused (not built): the training loop runs groups of the pipeline size.
    "microbatch_group_size_per_vp_stage",
    # Its flags need CUDA to validate: `test_cuda_graph_flags.py` checks that they reach it.
    "cuda_graph_impl",
}


@pytest.mark.parametrize("flags, field, value", TRANSFORMER_CONFIG_CASES)
def test_flag_reaches_transformer_config(flags, field, value):
    config = core_transformer_config_from_args(validated(*flags.split()))
    assert getattr(config, field) == value
    baseline = core_transformer_config_from_args(validated())
    assert getattr(baseline, field) != value, "the flags must change the field"


def test_an_unknown_compile_backend_names_the_flag_value_and_the_choices():
    with pytest.raises(ValueError, match=r"compile_backend 'inductr' is not .*'inductor'"):
        validated("--compile-layers", "--compile-backend", "inductr")


def test_every_transformer_config_field_has_a_flag():
    covered = {field for _, field, _ in TRANSFORMER_CONFIG_CASES} | _NOT_FROM_A_FLAG
    assert covered == {f.name for f in dataclasses.fields(TransformerConfig)}


def test_parallel_state_kwargs_match_initialize_model_parallel():
    flags = (
        f"{FSDP} --num-distributed-optimizer-instances 2 --create-all-gather-group "
        "--distributed-timeout-minutes 5"
    )
    args = validated(*flags.split())
    kwargs = get_parallel_state_kwargs(args)
    assert kwargs == dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        # Unset, it is the tensor-parallel size (upstream's default).
        expert_tensor_parallel_size=1,
        num_distributed_optimizer_instances=2,
        create_all_gather_group=True,
        distributed_timeout_minutes=5,
    )
    inspect.signature(parallel_state.initialize_model_parallel).bind(**kwargs)


def test_args_build_a_gpt_model():
    args = validated("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights")
    model = GPTModel(
        core_transformer_config_from_args(args),
        get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
    )
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length))
    assert model(tokens).shape == (args.micro_batch_size, args.seq_length, 128)


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--mtp-num-layers 0", "--mtp-num-layers must be an integer >= 1, got 0"),
        ("--mtp-num-layers -1", "--mtp-num-layers must be an integer >= 1, got -1"),
    ],
)
def test_multi_token_prediction_config_errors_name_the_flags(flags, message):
    with pytest.raises(ValueError, match=message):
        validated(*flags.split())
