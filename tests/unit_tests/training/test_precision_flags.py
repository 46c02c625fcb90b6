"""The mixed-precision flags: Megatron-LM's names, defaults and dests, where they reach the
configs, and what is refused (the FP8 flags of what is not built, FP4, FP8 config errors spelled
as flags)."""

from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import (
    core_transformer_config_from_args,
    get_megatron_ddp_config,
    get_megatron_optimizer_config,
    parse_args,
    validate_args,
)
from tests.unit_tests.training.flag_checks import BASE
from tests.unit_tests.training.flag_checks import validated as validated_on

FSDP = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"


def validated(flags: str = ""):
    return validated_on(*flags.split())


DEFAULTS = {
    "fp16": False,
    "bf16": False,
    "loss_scale": None,
    "initial_loss_scale": 2.0**32,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "accumulate_allreduce_grads_in_fp32": False,
    "grad_reduce_in_fp32": False,
    "grad_reduce_in_bf16": False,
    "fp8": None,
    "fp8_recipe": "delayed",
    "fp8_param_gather": False,
    "fp8_quantizer_factory": None,
    "fp8_margin": 0,
    "fp8_interval": 1,
    "fp8_amax_history_len": 1,
    "fp8_amax_compute_algo": "most_recent",
    "fp8_wgrad": True,
    "fp8_output_proj": False,
    "first_last_layers_bf16": False,
    "num_layers_at_start_in_bf16": 1,
    "num_layers_at_end_in_bf16": 1,
    "keep_fp8_transpose_cache": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
    "fp4": None,
    "fp4_recipe": "nvfp4",
    "fp4_param_gather": False,
    "fp4_quantizer_factory": None,
}
"""Megatron-LM's default of each dest (its `arguments.py` and `TransformerConfig`)."""


def test_defaults_are_megatrons():
    args = parse_args(args=BASE)
    assert {dest: getattr(args, dest) for dest in DEFAULTS} == DEFAULTS


@pytest.mark.parametrize(
    "flags, dest, value",
    [
        ("--fp16", "fp16", True),
        ("--bf16", "bf16", True),
        ("--bf16 --loss-scale 4096", "loss_scale", 4096.0),
        ("--fp16 --initial-loss-scale 65536", "initial_loss_scale", 65536.0),
        ("--fp16 --min-loss-scale 2", "min_loss_scale", 2.0),
        ("--fp16 --loss-scale-window 500", "loss_scale_window", 500.0),
        ("--fp16 --hysteresis 4", "hysteresis", 4),
        ("--accumulate-allreduce-grads-in-fp32", "accumulate_allreduce_grads_in_fp32", True),
        ("--grad-reduce-in-fp32", "grad_reduce_in_fp32", True),
        ("--bf16 --grad-reduce-in-bf16", "grad_reduce_in_bf16", True),
    ],
)
def test_flag_sets_its_dest(flags, dest, value):
    args = validated(flags)
    assert getattr(args, dest) == value and type(getattr(args, dest)) is type(value)


@pytest.mark.parametrize(
    "flags, dtype", [("", torch.float32), ("--bf16", torch.bfloat16), ("--fp16", torch.float16)]
)
def test_params_dtype_and_transformer_config(flags, dtype):
    args = validated(flags)
    config = core_transformer_config_from_args(args)
    assert args.params_dtype == dtype == config.params_dtype
    assert config.fp16 == (dtype == torch.float16) and config.bf16 == (dtype == torch.bfloat16)


def test_loss_scaling_flags_reach_the_optimizer_config():
    config = get_megatron_optimizer_config(
        validated(
            "--fp16 --initial-loss-scale 1024 --min-loss-scale 4 --loss-scale-window 50 "
            "--hysteresis 3"
        )
    )
    assert (config.fp16, config.bf16, config.loss_scale) == (True, False, None)
    assert (config.initial_loss_scale, config.min_loss_scale) == (1024.0, 4.0)
    assert (config.loss_scale_window, config.hysteresis) == (50.0, 3)
    assert get_megatron_optimizer_config(validated("--fp16 --loss-scale 8")).loss_scale == 8.0


@pytest.mark.parametrize(
    "flags, reduce_in_fp32",
    [
        ("", False),
        ("--fp16", False),
        ("--fp16 --accumulate-allreduce-grads-in-fp32", True),
        ("--grad-reduce-in-fp32", True),
        ("--bf16", True),  # Megatron-LM's default for bf16
        ("--bf16 --grad-reduce-in-bf16", False),
        # Megatron-LM's Megatron-FSDP takes --megatron-fsdp-main-grads-dtype (auto: the model's).
        (f"--bf16 {FSDP}", False),
        (f"--bf16 {FSDP} --megatron-fsdp-main-grads-dtype bf16", False),
        (f"--bf16 {FSDP} --accumulate-allreduce-grads-in-fp32", True),
    ],
)
def test_gradient_reduction_dtype(flags, reduce_in_fp32):
    assert get_megatron_ddp_config(validated(flags)).grad_reduce_in_fp32 is reduce_in_fp32


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--fp16 --bf16", "--fp16 and --bf16 are both given"),
        ("--loss-scale 128", "--loss-scale 128.0 applies to --fp16 or --bf16 only"),
        ("--fp16 --loss-scale 0", "--loss-scale 0.0 must be > 0"),
        ("--bf16 --initial-loss-scale 1024", "--initial-loss-scale 1024.0 applies to dynamic"),
        ("--fp16 --loss-scale 8 --hysteresis 3", "--hysteresis 3 applies to dynamic"),
        ("--min-loss-scale 2", "--min-loss-scale 2.0 applies to dynamic"),
        ("--fp16 --min-loss-scale 8 --initial-loss-scale 4", r"--min-loss-scale 8.0 must be in"),
        ("--fp16 --loss-scale-window 2.5", "--loss-scale-window 2.5 must be a whole number"),
        ("--fp16 --hysteresis 0", "--hysteresis 0 must be >= 1"),
        ("--grad-reduce-in-bf16", "--grad-reduce-in-bf16 applies to --bf16 only"),
        (
            "--bf16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32",
            "--grad-reduce-in-bf16 contradicts --accumulate-allreduce-grads-in-fp32",
        ),
        (
            f"{FSDP} --accumulate-allreduce-grads-in-fp32 --megatron-fsdp-main-grads-dtype bf16",
            "--accumulate-allreduce-grads-in-fp32 contradicts --megatron-fsdp-main-grads-dtype",
        ),
        (f"--fp16 {FSDP} --megatron-fsdp-main-params-dtype fp16", "fp16 main weights"),
        (
            "--fp8-format hybrid --fp8-param-gather",
            "--fp8-param-gather needs --use-distributed-optimizer or Megatron-FSDP",
        ),
        (f"{FSDP} --fp8-param-gather", "without --fp8-format there are none"),
        (
            f"{FSDP} --fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather",
            "^--fp8-param-gather with --fp8-recipe blockwise: the FP8 weights are gathered with "
            "one scale per tensor",
        ),
        (
            f"{FSDP} --fp8-format hybrid --keep-fp8-transpose-cache",
            "^--keep-fp8-transpose-cache keeps the transposes of the FP8 weights that "
            "--fp8-param-gather keeps, .*: add --fp8-param-gather or drop",
        ),
        (
            "--fp8-format hybrid --use-distributed-optimizer --fp8-param-gather "
            "--keep-fp8-transpose-cache",
            "^--keep-fp8-transpose-cache needs Megatron-FSDP: set --use-megatron-fsdp",
        ),
    ],
)
def test_bad_combination_names_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        validated(flags)


@pytest.mark.parametrize(
    "flags, named, unbuilt",
    [
        ("--fp8-quantizer-factory a.b", "--fp8-quantizer-factory a.b", "custom FP8 recipes"),
        ("--fp8-output-proj", "--fp8-output-proj", "the MXFP8 output projection is not built"),
        (
            "--reuse-grad-buf-for-mxfp8-param-ag",
            "--reuse-grad-buf-for-mxfp8-param-ag",
            "MXFP8 parameter all-gathers are not built",
        ),
        ("--fp4-format e2m1", "--fp4-format e2m1", "FP4 training is not built"),
        ("--fp4-recipe custom", "--fp4-recipe custom", "FP4 training is not built"),
        ("--fp4-param-gather", "--fp4-param-gather", "FP4 training is not built"),
        ("--fp4-quantizer-factory a.b", "--fp4-quantizer-factory a.b", "FP4 training"),
    ],
)
def test_unbuilt_fp8_and_fp4_flags_are_refused_by_name(flags, named, unbuilt):
    with pytest.raises(ValueError, match=f"^{named}: {unbuilt}.*; drop "):
        validated(f"--bf16 --fp8-format hybrid {flags}")


@pytest.mark.parametrize(
    "flags, field, value",
    [
        ("--fp8-format hybrid", "fp8", "hybrid"),
        ("--fp8-format e4m3 --fp8-recipe tensorwise", "fp8_recipe", "tensorwise"),
        ("--fp8-format e4m3 --fp8-recipe blockwise", "fp8_recipe", "blockwise"),
        ("--fp8-format e4m3 --fp8-margin 2", "fp8_margin", 2),
        ("--fp8-format e4m3 --fp8-amax-history-len 1024", "fp8_amax_history_len", 1024),
        ("--fp8-format e4m3 --fp8-amax-compute-algo max", "fp8_amax_compute_algo", "max"),
        ("--fp8-format e4m3 --no-fp8-wgrad", "fp8_wgrad", False),
        ("--fp8-format e4m3 --disable-fp8-wgrad", "fp8_wgrad", False),
        (
            "--fp8-format e4m3 --fp8-recipe tensorwise --first-last-layers-bf16 "
            "--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 2",
            "num_layers_at_end_in_bf16",
            2,
        ),
        ("--fp8-format hybrid --num-experts 4 --moe-grouped-gemm", "fp8", "hybrid"),
    ],
)
def test_fp8_flags_reach_the_transformer_config(flags, field, value):
    config = core_transformer_config_from_args(validated(f"--bf16 {flags}"))
    assert getattr(config, field) == value


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--fp8-recipe tensorwise", "^--fp8-recipe tensorwise applies to FP8 training only; set "),
        ("--no-fp8-wgrad", "^--no-fp8-wgrad applies to FP8 training only; set --fp8-format"),
        (
            "--fp8-format hybrid --fp8-recipe blockwise",
            "^--fp8-recipe blockwise with --fp8-format hybrid: torch's blockwise-scaled GEMM "
            "multiplies E4M3 operands only, .* use --fp8-format e4m3 ",
        ),
        (
            "--fp8-format hybrid --fp8-recipe mxfp8",
            "^--fp8-recipe mxfp8: Device compute capability 10.0 or higher required",
        ),
        ("--fp8-format hybrid --fp8-recipe custom", "^--fp8-recipe custom: custom recipes"),
        (
            "--fp8-format hybrid --fp8-recipe tensorwise --fp8-amax-history-len 1024",
            "^--fp8-amax-history-len 1024 applies to delayed scaling only",
        ),
        (
            "--fp8-format hybrid --first-last-layers-bf16",
            r"Delayed scaling does not support first / last layer in BF16 "
            r"\(--first-last-layers-bf16 with --fp8-recipe delayed\)",
        ),
        (
            "--fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16 "
            "--num-layers-at-end-in-bf16 3",
            r"^--num-layers-at-end-in-bf16 3 must be between 0 and .* \(2\)",
        ),
        ("--fp8-format e4m3 --fp8-amax-history-len 0", "^--fp8-amax-history-len 0 must be"),
    ],
)
def test_fp8_config_errors_name_the_flags(flags, message):
    with pytest.raises(ValueError, match=message):
        validated(f"--bf16 {flags}")


def test_fp8_interval_is_ignored_with_upstreams_warning():
    with pytest.warns(UserWarning, match="fp8_interval is deprecated and ignored"):
        validated("--bf16 --fp8-format hybrid --fp8-interval 2")


def test_fp8_flags_at_their_defaults_are_accepted():
    validated(
        "--bf16 --fp8-recipe delayed --fp8-amax-history-len 1 --fp8-amax-compute-algo "
        "most_recent --fp8-margin 0 --fp4-recipe nvfp4"
    )


def test_fp8_choices_are_upstreams():
    with pytest.raises(SystemExit):
        parse_args(args=[*BASE, "--fp8-format", "e5m2"])


def test_validation_is_idempotent_under_fp16():
    args = validated("--fp16 --initial-loss-scale 4096")
    assert vars(validate_args(args, world_size=2)) == vars(args)
