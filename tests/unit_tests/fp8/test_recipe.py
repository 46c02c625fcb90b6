"""The config's FP8 fields: the recipes built and refused, the checks of the delayed-scaling and
bf16-layer fields, and Megatron-LM's rule for which layers stay in high precision."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.recipe import Fp8Recipe, is_first_last_bf16_layer, recipe_from_config
from tests.unit_tests.model_builders import tiny_gpt_config


def test_a_config_describes_its_recipe():
    config = tiny_gpt_config(
        fp8="hybrid", fp8_amax_history_len=1024, fp8_amax_compute_algo="max", fp8_wgrad=False
    )
    recipe = recipe_from_config(config)
    assert recipe == Fp8Recipe("hybrid", "delayed", 0, 1024, "max", wgrad=False)
    assert recipe.describe() == (
        "hybrid format, delayed scaling (amax history 1024, max, margin 0), weight gradients "
        "in high precision"
    )
    assert recipe_from_config(tiny_gpt_config()) is None


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(fp8_recipe="tensorwise"), "fp8_recipe='tensorwise' applies to FP8 training only"),
        (dict(fp8_wgrad=False), "fp8_wgrad=False applies to FP8 training only"),
        (dict(fp8="e5m2"), "fp8='e5m2' is not an FP8 format"),
        (
            dict(fp8="hybrid", fp8_recipe="blockwise"),
            "fp8_recipe='blockwise' with fp8='hybrid': torch's blockwise-scaled GEMM multiplies "
            "E4M3 operands only",
        ),
        (
            dict(fp8="e4m3", fp8_recipe="blockwise", num_moe_experts=4),
            "fp8_recipe='blockwise' with num_moe_experts=4: blockwise FP8 experts are not built",
        ),
        (
            dict(fp8="e4m3", fp8_recipe="blockwise", fp8_margin=1),
            "fp8_margin=1 applies to delayed scaling only, not to fp8_recipe='blockwise'",
        ),
        (dict(fp8="hybrid", fp8_recipe="mxfp8"), "Device compute capability 10.0 or higher"),
        (dict(fp8="hybrid", fp8_recipe="custom"), "quantizer factories"),
        (
            dict(fp8="e4m3", fp8_recipe="tensorwise", fp8_amax_history_len=16),
            "fp8_amax_history_len=16 applies to delayed scaling only",
        ),
        (dict(fp8="e4m3", fp8_amax_history_len=0), "fp8_amax_history_len=0 must be"),
        (dict(fp8="e4m3", fp8_margin=-1), "fp8_margin=-1 must be"),
        (dict(fp8="e4m3", fp8_amax_compute_algo="mean"), "fp8_amax_compute_algo='mean'"),
        (
            dict(fp8="e4m3", first_last_layers_bf16=True),
            "Delayed scaling does not support first / last layer in BF16",
        ),
        (
            dict(fp8="e4m3", fp8_recipe="tensorwise", num_layers_at_start_in_bf16=2),
            "num_layers_at_start_in_bf16=2 applies with first_last_layers_bf16 only",
        ),
        (
            dict(
                fp8="e4m3",
                fp8_recipe="tensorwise",
                first_last_layers_bf16=True,
                num_layers_at_end_in_bf16=3,
            ),
            r"num_layers_at_end_in_bf16=3 must be between 0 and .* \(2\)",
        ),
    ],
)
def test_bad_or_unbuilt_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_gpt_config(**fields)


def test_the_blockwise_recipe_is_built_in_e4m3():
    recipe = recipe_from_config(tiny_gpt_config(fp8="e4m3", fp8_recipe="blockwise"))
    assert recipe.blockwise and not recipe.delayed and not recipe.fprop_fast_accum
    assert recipe.backward_dtype == recipe.forward_dtype == torch.float8_e4m3fn
    assert recipe.describe() == (
        "e4m3 format, blockwise scaling (1x128 activations and gradients, 128x128 weights)"
    )


def test_fp8_interval_warns_as_upstream():
    with pytest.warns(UserWarning, match="fp8_interval is deprecated and ignored"):
        tiny_gpt_config(fp8="hybrid", fp8_interval=2)


def test_first_and_last_layers_follow_megatrons_rule():
    config = tiny_gpt_config(
        num_layers=5,
        fp8="hybrid",
        fp8_recipe="tensorwise",
        first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=2,
        num_layers_at_end_in_bf16=0,
    )
    assert [is_first_last_bf16_layer(config, n) for n in range(5)] == [True, True] + [False] * 3
    assert not is_first_last_bf16_layer(config, -1)
