"""The model-option flags: upstream names, defaults and dests, aliases, no-ops, refusals, and
what they build."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import squared_relu
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnBackend
from megatron.training.arguments import (
    core_transformer_config_from_args,
    parse_args,
    validate_args,
)
from megatron.training.flag_groups.training import FUSION_TOGGLES
from tests.unit_tests.training.flag_checks import BASE
from tests.unit_tests.training.flag_checks import validated as validated_on
from tests.unit_tests.training.log_capture import capture_training_log


def validated(*flags: str):
    return validated_on(*flags, world_size=4)


def test_upstream_defaults_and_dests():
    args = parse_args(args=list(BASE))
    expected = dict(
        layernorm_zero_centered_gamma=False,
        qk_layernorm=False,
        qk_l2_norm=False,
        rotary_interleaved=False,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=False,
        attention_backend=AttnBackend.auto,
        use_flash_attn=False,
        recompute_activations=False,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        recompute_modules=None,
        cross_entropy_loss_fusion=False,
        cross_entropy_fusion_impl="native",
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        rotary_seq_len_interpolation_factor=None,
        add_position_embedding=True,
        squared_relu=False,
        deprecated_use_mcore_models=False,
        make_vocab_size_divisible_by=128,
        apply_rope_fusion=True,
        bias_swiglu_fusion=True,
        gradient_accumulation_fusion=True,
        **{dest: True for _, dest in FUSION_TOGGLES},
    )
    assert {name: getattr(args, name) for name in expected} == expected


def test_fusion_toggles_and_mcore_models_are_no_ops():
    flags = [flag for flag, _ in FUSION_TOGGLES] + ["--use-mcore-models"]
    args = validated(*flags)
    assert not any(getattr(args, dest) for _, dest in FUSION_TOGGLES)
    assert args.deprecated_use_mcore_models
    # Every config field the same (the init partials compare by identity: compare their std).
    given, default = (
        dataclasses.asdict(core_transformer_config_from_args(a)) for a in (args, validated())
    )
    for name in ("init_method", "output_layer_init_method"):
        assert given.pop(name).keywords == default.pop(name).keywords
    assert given == default


@pytest.mark.parametrize(
    "flags, fused",
    [
        (("--swiglu",), True),
        (("--swiglu", "--no-bias-swiglu-fusion"), False),
        ((), False),  # GELU: one PyTorch kernel per direction already
        (("--quick-geglu",), False),
    ],
)
def test_bias_swiglu_fusion_reaches_the_config(flags, fused):
    args = validated(*flags)
    assert core_transformer_config_from_args(args).bias_activation_fusion is fused


def test_recompute_activations_is_selective():
    args = validated("--recompute-activations")
    assert args.recompute_granularity == "selective"
    config = core_transformer_config_from_args(args)
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ["core_attn"]
    validated("--recompute-activations", "--recompute-granularity", "selective")


def test_squared_relu_reaches_the_config():
    assert core_transformer_config_from_args(validated("--squared-relu")).activation_func is (
        squared_relu
    )
    assert core_transformer_config_from_args(validated()).activation_func is F.gelu


@pytest.mark.parametrize("backend", ["local", "unfused", "auto"])
def test_cpu_backends_accepted(backend):
    config = core_transformer_config_from_args(validated("--attention-backend", backend))
    assert config.attention_backend == AttnBackend[backend]


def test_unknown_backend_is_a_parse_error():
    with pytest.raises(SystemExit):
        parse_args(args=[*BASE, "--attention-backend", "xformers"])


@pytest.mark.parametrize(
    "flags",
    ["--attention-backend flash", "--attention-backend fused", "--use-flash-attn"],
)
def test_gpu_backends_without_cuda(flags, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=f"{flags} needs a CUDA GPU.*--attention-backend auto"):
        validated(*flags.split())


def test_gpu_backends_on_gloo_ranks(monkeypatch):
    """GPUs present, but gloo ranks compute on CPU tensors, where the kernels do not exist
    (before: accepted, then SDPA's "no viable backend" at the first forward)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    message = "--attention-backend fused needs a CUDA GPU, and --distributed-backend gloo computes"
    with pytest.raises(ValueError, match=message):
        validated("--attention-backend", "fused")


def test_flash_needs_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    nccl = ("--distributed-backend", "nccl")
    with pytest.raises(ValueError, match="--attention-backend flash: .* add --bf16"):
        validated("--attention-backend", "flash", *nccl)
    for precision in ("--bf16", "--fp16"):  # the kernel's two half-precision dtypes
        assert validated("--attention-backend", "flash", precision, *nccl).attention_backend == (
            AttnBackend.flash
        )
    with pytest.raises(ValueError, match="--use-flash-attn: .* no attention mask"):
        validated("--use-flash-attn", "--bf16", "--reset-attention-mask", *nccl)


BAD = [
    ("--use-flash-attn --attention-backend local", "--use-flash-attn .* --attention-backend local"),
    (
        "--recompute-activations --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1",
        "--recompute-activations means --recompute-granularity selective",
    ),
    ("--recompute-granularity full", "--recompute-granularity full needs --recompute-method"),
    ("--recompute-modules mlp", "--recompute-modules applies to --recompute-granularity selective"),
    (
        "--recompute-granularity selective --recompute-modules moe_act",
        "--recompute-modules moe_act is not built",
    ),
    ("--recompute-granularity selective --recompute-modules attn", "--recompute-modules attn is"),
    (
        "--recompute-granularity selective --recompute-method uniform",
        "--recompute-method applies to --recompute-granularity full",
    ),
    ("--rotary-interleaved", "--rotary-interleaved applies to --position-embedding-type rope"),
    ("--use-rope-scaling", "--use-rope-scaling applies to --position-embedding-type rope"),
    (
        "--rotary-seq-len-interpolation-factor 2",
        "--rotary-seq-len-interpolation-factor applies to",
    ),
    ("--position-embedding-type rope --rope-scaling-factor 0", "--rope-scaling-factor 0.0 must"),
    ("--position-embedding-type mrope", "--position-embedding-type mrope: .* not built"),
    ("--position-embedding-type relative", "--position-embedding-type relative: .* not built"),
    ("--no-position-embedding", "--no-position-embedding is deprecated; use"),
    ("--swiglu --squared-relu", "--swiglu and --squared-relu"),
    (
        "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te",
        "--cross-entropy-fusion-impl te is refused",
    ),
]


@pytest.mark.parametrize("flags, match", BAD)
def test_bad_combinations(flags, match):
    with pytest.raises(ValueError, match=match):
        validated(*flags.split())


def test_validation_is_idempotent_with_aliases():
    args = validated("--recompute-activations", "--position-embedding-type", "rope")
    validate_args(args, world_size=4)
    assert args.recompute_granularity == "selective"


def test_model_built_from_rope_flags():
    """pretrain_gpt's model_provider passes the RoPE flags: Llama-3 scaling and interpolation
    reach RotaryEmbedding; --no-position-embedding is accepted with rope."""
    import pretrain_gpt
    from megatron.training import global_vars

    args = validated(
        *"--position-embedding-type rope --use-rope-scaling --rope-scaling-factor 16 "
        "--rotary-seq-len-interpolation-factor 2 --rotary-interleaved --no-position-embedding "
        "--qk-layernorm --apply-layernorm-1p --cross-entropy-loss-fusion".split()
    )
    global_vars.set_args(args)
    try:
        model = pretrain_gpt.model_provider()
    finally:
        global_vars.set_args(None)
    assert isinstance(model, GPTModel)
    rope = model.rotary_pos_emb
    assert (rope.rope_scaling, rope.rope_scaling_factor) == (True, 16.0)
    assert rope.seq_len_interpolation_factor == 2 and rope.rotary_interleaved
    assert model.decoder.layers[0].self_attention.q_layernorm is not None
    assert model.config.cross_entropy_loss_fusion
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_length))
    assert model(tokens, labels=tokens).shape == (2, args.seq_length)
    # The same model without the flags is a different function of the same tokens.
    plain = GPTModel(
        core_transformer_config_from_args(validated("--position-embedding-type", "rope")),
        get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type="rope",
    )
    assert plain.decoder.layers[0].self_attention.q_layernorm is None


def test_both_qk_norms_warn_and_build_the_l2_norm():
    with capture_training_log() as messages:
        config = core_transformer_config_from_args(validated("--qk-layernorm", "--qk-l2-norm"))
    assert config.qk_l2_norm and config.qk_layernorm
    assert any("the QK norm is --qk-l2-norm's" in message for message in messages)
