"""gpt-oss's flags through `pretrain_gpt.py` (2 gloo ranks): upstream's set validates and trains
(its preset's YaRN positions, sliding windows on alternate layers, learnable sinks, clamped
quick-GELU GLU with offset, MoE at EP 2);
Megatron-FSDP ZeRO-3 built on the meta device trains as the DDP engine; training resumed from a
ZeRO-3 checkpoint is bitwise the uninterrupted run; a checkpoint of another window does not
load, nor exports as a Llama; bad values and unbuilt flags are refused by name."""

from __future__ import annotations

import os
import shutil

import pytest

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.checkpointing import CheckpointError
from megatron.training.hf_conversion.config import LLAMA_FAMILY_ARGS, check_llama_family
from megatron.training.hf_conversion.config_fields import HFConversionError
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    ZERO3,
    assert_histories_equal,
    main,
    main_error,
    resumed_part,
)
from tests.unit_tests.training.flag_checks import validated
from tests.unit_tests.training.test_pretrain_gpt import _assert_fsdp_matches_ddp

GPT_OSS = (
    "--group-query-attention --num-query-groups 2 --normalization RMSNorm "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
    "--window-size 3,0 --window-attn-skip-freq 2 --softmax-type learnable "
    "--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 "
    "--export-force-local-attention --enable-gpt-oss "
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-grouped-gemm "
    "--moe-token-dispatcher-type alltoall --moe-router-dtype fp32 --moe-z-loss-coeff 1e-3 "
    "--moe-aux-loss-coeff 1e-3 --expert-model-parallel-size 2"
).split()
"""Upstream's gpt-oss model flags (examples/gptoss/02_train.sh), on the tiny `RUN` (dropout on:
the CPU computes windows and sinks from dense scores, which have it), the experts split over the
2 ranks."""


def test_gpt_oss_flags_reach_the_config():
    config = core_transformer_config_from_args(validated(*GPT_OSS))
    assert isinstance(config, TransformerConfig)
    assert (config.window_size, config.window_attn_skip_freq) == ((3, 0), 2)
    assert config.softmax_type == "learnable" and config.gated_linear_unit
    assert (config.glu_linear_offset, config.activation_func_clamp_value) == (1.0, 7.0)
    assert config.activation_func.__name__ == "quick_gelu"
    assert (config.yarn_rotary_scaling_factor, config.yarn_correction_range_round_to_int) == (
        32.0,
        False,
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--window-size 127,1", "--window-size's right side 1: the decoder is causal"),
        ("--window-size 127", "--window-size must be two ints"),
        ("--window-attn-skip-freq 2", "no --window-size is set"),
        ("--window-size 3,0 --window-attn-skip-freq [1,0,1]", "one 1 (sliding window) or 0"),
        ("--glu-linear-offset 1.0", "--glu-linear-offset 1.0 applies to the gated MLP only"),
        ("--activation-func-clamp-value 0", "--activation-func-clamp-value 0.0 must be > 0"),
        ("--quick-geglu --swiglu", "--swiglu and --quick-geglu are MLP activations"),
        ("--softmax-type learnable --attention-backend unfused", "pins an SDPA kernel"),
    ],
)
def test_bad_gpt_oss_flags_are_refused_by_name(flags, message):
    with pytest.raises(ValueError) as error:
        validated(*flags.split())
    assert message in str(error.value)


def test_every_refusal_is_named_in_one_message():
    with pytest.raises(ValueError) as error:
        validated("--enable-gpt-oss", "--yarn-beta-slow", "2", "--quick-geglu", "--squared-relu")
    assert "which --yarn-beta-slow 2.0 contradict" in str(error.value)
    assert "--squared-relu and --quick-geglu" in str(error.value)


@pytest.mark.parametrize(
    "name, value",
    [("window_size", (127, 0)), ("softmax_type", "learnable"), ("quick_geglu", True)],
)
def test_a_gpt_oss_checkpoint_is_not_exported_as_a_llama(name, value):
    check_llama_family(LLAMA_FAMILY_ARGS)
    with pytest.raises(HFConversionError, match=f"--{name.replace('_', '-')} "):
        check_llama_family({**LLAMA_FAMILY_ARGS, name: value})


def test_export_force_local_attention_is_a_no_op():
    args = validated("--export-force-local-attention")
    assert args.export_force_local_attention is True


def test_gpt_oss_zero3_built_on_the_meta_device_trains_as_ddp():
    """The sinks' `reset_parameters()` materialises them as the eager build draws them."""
    _assert_fsdp_matches_ddp(2, [*ZERO3, "--init-model-with-meta-device"], tuple(GPT_OSS))


@pytest.fixture(scope="module")
def straight_run():
    histories = run_distributed(main, 2, [*RUN, *GPT_OSS, *ZERO3])
    assert histories[0].losses == histories[1].losses
    return histories[0]


def test_gpt_oss_resumes_bitwise_under_zero3(tmp_path, straight_run):
    root = str(tmp_path / "ckpt")
    flags = [*RUN, *GPT_OSS, *ZERO3, "--save", root, "--save-interval", "3"]
    first = run_distributed(main, 2, [*flags, "--exit-interval", "3"])[0]
    assert first.losses == straight_run.losses[:3]
    resumed = run_distributed(main, 2, [*flags, "--load", root])
    assert resumed[0].start_iteration == 3
    assert_histories_equal(resumed[0], resumed_part(straight_run, 3))
    assert_histories_equal(resumed[1], resumed[0])

    # The same weights with another window (or none): another model.
    other = str(tmp_path / "other")
    shutil.copytree(root, other)
    changed = [*RUN, *GPT_OSS, *ZERO3, "--window-size", "5,0", "--load", other]
    for kind, message in run_distributed(main_error, 2, changed):
        assert kind == CheckpointError.__name__, message
        assert "--window-size (3, 0) (here (5, 0))" in message
    assert sorted(os.listdir(other)) == sorted(os.listdir(root))
