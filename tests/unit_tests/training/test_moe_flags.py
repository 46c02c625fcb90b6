"""The MoE and expert-parallel flags: `--moe-layer-freq`'s safe parser, the defaults against
`TransformerConfig`'s, the mapping onto the config and the process groups, the refusals (MoE
flags on a dense model, unbuilt values, sizes that do not divide), each naming the flags, and
the comparison of a checkpoint's MoE flags with a resumed run's (values, not spellings)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import (
    core_transformer_config_from_args,
    get_parallel_state_kwargs,
    parse_args,
    validate_args,
)
from megatron.training.checkpoint_layout import CHECKPOINT_VERSION, CheckpointError
from megatron.training.checkpointing import _check_arguments
from megatron.training.flag_groups.moe import DEFAULTS, KERNEL_TOGGLES, moe_layer_freq_type
from tests.unit_tests.training.flag_checks import BASE, validated

ROOT = Path(__file__).resolve().parents[3]
MOE = ("--num-experts", "4")


@pytest.mark.parametrize(
    "text", ["([1]*3+[0]*1)*3", "[0]+[1]*23", "([1]*3+[0]*2)*2", "[1, 0]*2", "2*[0,1]"]
)
def test_layer_freq_expressions_give_what_python_gives(text):
    assert moe_layer_freq_type(text) == eval(text)  # the reference: upstream evaluates it


def test_layer_freq_int():
    assert moe_layer_freq_type("3") == 3


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "[1]*10**9",  # ** is not allowed
        "[1]*1000001",  # longer than any model
        "[[1]]",
        "[1]+1",
        "[1]*[2]",
        "[1.0]",
        "[1",
        "three",
    ],
)
def test_layer_freq_refuses_anything_else(text):
    with pytest.raises(argparse.ArgumentTypeError):
        moe_layer_freq_type(text)


def test_a_bad_layer_freq_is_an_argparse_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(args=[*BASE, "--moe-layer-freq", "[1]*x"])
    assert "--moe-layer-freq" in capsys.readouterr().err


def test_defaults_are_the_configs():
    """Each built MoE flag defaults to its `TransformerConfig` field's default (upstream's)."""
    fields = {field.name: field.default for field in dataclasses.fields(TransformerConfig)}
    assert fields["num_moe_experts"] == DEFAULTS["num_experts"]
    for dest, default in DEFAULTS.items():
        if dest != "num_experts":
            assert fields[dest] == default, dest


def test_expert_parallel_size_reaches_the_process_groups():
    """(Each MoE flag's `TransformerConfig` field: `test_configs_from_args.py`.)"""
    kwargs = get_parallel_state_kwargs(validated(*MOE, "--expert-model-parallel-size", "2"))
    assert kwargs["expert_model_parallel_size"] == 2
    inspect.signature(parallel_state.initialize_model_parallel).bind(**kwargs)


def test_one_element_lists_become_their_element():
    flags = "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3"
    config = core_transformer_config_from_args(validated(*MOE, *flags.split()))
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == (
        "seq_aux_loss",
        1e-3,
    )


def test_moe_ffn_width_defaults_to_the_ffn_width_and_zero_experts_is_dense():
    config = core_transformer_config_from_args(validated(*MOE, "--ffn-hidden-size", "96"))
    assert config.moe_ffn_hidden_size == 96
    dense = core_transformer_config_from_args(validated("--num-experts", "0"))
    assert dense.num_moe_experts is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            "--moe-router-topk 4 --moe-grouped-gemm --moe-permute-fusion",
            "--moe-router-topk, --moe-grouped-gemm, --moe-permute-fusion: MoE flags without "
            "--num-experts",
        ),
        ("--moe-layer-freq [1,0]", "--moe-layer-freq: MoE flags without --num-experts"),
        ("--expert-model-parallel-size 2", "--expert-model-parallel-size 2 needs MoE layers"),
        (
            "--expert-tensor-parallel-size 2",
            "--expert-tensor-parallel-size 2: MoE flags without --num-experts",
        ),
        ("--num-experts 4 --moe-aux-loss-coeff nan", "--moe-aux-loss-coeff nan must be >= 0"),
        (
            "--num-experts 4 --moe-router-topk-scaling-factor 0",
            "--moe-router-topk-scaling-factor 0.0 must be > 0",
        ),
        (
            "--num-experts 4 --moe-router-topk-scaling-factor nan",
            "--moe-router-topk-scaling-factor nan must be > 0",
        ),
        (
            "--num-experts 4 --moe-expert-capacity-factor inf",
            "--moe-expert-capacity-factor inf must be finite",
        ),
        (
            "--num-experts 4 --expert-model-parallel-size 4",
            "--expert-model-parallel-size 4 does not divide the world size 2",
        ),
        (
            "--num-experts 6 --expert-model-parallel-size 4",
            "--expert-model-parallel-size 4 does not divide the world size 2",
        ),
        (
            "--num-experts 3 --expert-model-parallel-size 2",
            "--num-experts (3) must be divisible by --expert-model-parallel-size (2)",
        ),
        (
            "--num-experts 4 --expert-tensor-parallel-size 2 --expert-model-parallel-size 2",
            "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 2 does not divide "
            "the world size 2",
        ),
        (
            "--num-experts 4 --moe-router-load-balancing-type aux_loss seq_aux_loss",
            "--moe-router-load-balancing-type aux_loss seq_aux_loss: combining several",
        ),
        ("--num-experts 4 --moe-router-topk 5", "--moe-router-topk (5) exceeds --num-experts"),
        (
            "--num-experts 4 --moe-token-dispatcher-type flex",
            "--moe-token-dispatcher-type flex: the flex token dispatcher (DeepEP / HybridEP / "
            "NCCL EP) is not built",
        ),
        (
            "--num-experts 4 --moe-pad-dispatch-to-worst-case",
            "--moe-pad-dispatch-to-worst-case spares the host read of the token counts, but the "
            "experts without --moe-grouped-gemm read them on the host anyway",
        ),
        (
            "--num-experts 4 --moe-router-score-function sqrtsoftplus",
            "--moe-router-score-function sqrtsoftplus (the sqrt-softplus score function) is not",
        ),
        (
            "--num-experts 4 --moe-layer-freq [1,0,1]",
            "--moe-layer-freq as a list needs one 0 (dense) or 1 (MoE) per layer (2)",
        ),
    ],
)
def test_bad_moe_flags_are_refused_naming_them(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validated(*flags.split())


def test_expert_sizes_between_one_and_the_tensor_parallel_size_are_refused_naming_the_flags():
    flags = "--tensor-model-parallel-size 4 --sequence-parallel --expert-tensor-parallel-size 2"
    with pytest.raises(ValueError) as error:
        validated(*MOE, *flags.split(), world_size=4)
    assert (
        "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 1 with "
        "--tensor-model-parallel-size 4 is not built"
    ) in str(error.value)
    assert "_size" not in str(error.value)  # no config field names


def test_expert_tensor_parallel_size_of_a_dense_model_may_be_the_tensor_parallel_size():
    """Unset, it resolves to the tensor-parallel size: given as that, it asks for nothing else
    (and a validated namespace validates again)."""
    flags = "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2"
    args = validated(*flags.split())
    assert args.expert_tensor_parallel_size == 2
    validate_args(args, world_size=2)


def test_expert_data_parallel_size_must_take_the_replicas():
    flags = "--use-megatron-fsdp --num-distributed-optimizer-instances 2"
    with pytest.raises(ValueError, match="does not divide the expert data-parallel size 1"):
        validated(*MOE, *flags.split(), "--expert-model-parallel-size", "4", world_size=4)


def test_every_moe_flag_and_kernel_toggle_is_documented():
    docs = "".join(path.read_text() for path in (ROOT / "docs").glob("flags*.md"))
    for dest in [*DEFAULTS, *(dest for _, dest in KERNEL_TOGGLES)]:
        assert f"`--{dest.replace('_', '-')}`" in docs, dest


def _checkpoint_of(flags: str) -> dict:
    """The `common.pt` a run with `MOE` and `flags` saves (its validated arguments)."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "args": vars(validated(*MOE, *flags.split()))}


SAME_MODEL = [
    # (saved with, loaded with): two spellings of one model
    ("--ffn-hidden-size 64", "--ffn-hidden-size 64 --moe-ffn-hidden-size 64"),
    ("--ffn-hidden-size 64 --moe-ffn-hidden-size 64", "--ffn-hidden-size 64"),
    ("--moe-layer-freq 1", "--moe-layer-freq [1,1]"),
    ("--moe-layer-freq [1,0]", "--moe-layer-freq 2"),
    ("", "--moe-router-topk-scaling-factor 1"),
]


@pytest.mark.parametrize(("saved", "loaded"), SAME_MODEL)
def test_a_checkpoint_loads_into_the_same_model_spelled_otherwise(saved, loaded):
    _check_arguments(_checkpoint_of(saved), "ckpt", validated(*MOE, *loaded.split()))


OTHER_MODEL = [
    # (saved with, loaded with, the difference named)
    ("", "--moe-ffn-hidden-size 64", "--moe-ffn-hidden-size 256 (here 64)"),
    ("--moe-layer-freq 2", "--moe-layer-freq [1,1]", "--moe-layer-freq [1, 0] (here [1, 1])"),
    (
        "",
        "--moe-router-topk-scaling-factor 2",
        "--moe-router-topk-scaling-factor 1.0 (here 2.0)",
    ),
]


@pytest.mark.parametrize(("saved", "loaded", "difference"), OTHER_MODEL)
def test_a_checkpoint_of_another_moe_model_is_refused_naming_the_difference(
    saved, loaded, difference
):
    with pytest.raises(CheckpointError, match=re.escape(f"it was saved with {difference}")):
        _check_arguments(_checkpoint_of(saved), "ckpt", validated(*MOE, *loaded.split()))
