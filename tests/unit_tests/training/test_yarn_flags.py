"""YaRN's flags for standard attention and upstream's gpt-oss preset, against what upstream's
source says (`fixtures/upstream_gpt_oss_preset.json`, made from it by
`fixtures/make_upstream_gpt_oss_preset.py`): each YaRN flag sets the config field upstream's
training script sets, with its default; `--enable-gpt-oss` sets what upstream's builder sets and
nothing else, takes upstream's example's `--position-embedding-type rope`, and refuses a flag
that contradicts it; YaRN flags in a run without YaRN, and RoPE options YaRN ignores, are refused
by name; a checkpoint records the YaRN flags and loading checks them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron.training import checkpointing
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.checkpoint_layout import CheckpointError
from megatron.training.flag_groups.yarn import YARN_CONFIG_FIELDS
from megatron.training.flag_spelling import given
from tests.unit_tests.training.flag_checks import validated

UPSTREAM = json.loads(
    (Path(__file__).with_name("fixtures") / "upstream_gpt_oss_preset.json").read_text()
)
YARN = ("--position-embedding-type", "yarn")


def test_the_fixture_names_its_upstream_commit():
    assert len(UPSTREAM["upstream_commit"]) == 40
    assert UPSTREAM["preset_config_sets"]["position_embedding_type"] == "yarn"
    assert len(UPSTREAM["yarn_flags"]) == 7


@pytest.mark.parametrize("flag", UPSTREAM["yarn_flags"], ids=lambda flag: flag["dest"])
def test_each_yarn_flag_sets_upstreams_field_with_upstreams_default(flag):
    assert YARN_CONFIG_FIELDS[flag["dest"]] == flag["field"]
    left_out = core_transformer_config_from_args(validated(*YARN))
    assert getattr(left_out, flag["field"]) == flag["default"]
    default = flag["default"]
    value = (not default) if isinstance(default, bool) else default * 2 + 1
    flags = given(flag["dest"], value).split()
    config = core_transformer_config_from_args(validated(*YARN, *flags))
    assert getattr(config, flag["field"]) == value


def _preset_flags() -> list[str]:
    """Upstream's preset spelled as this project's flags."""
    sets = dict(UPSTREAM["preset_config_sets"])
    flags = ["--position-embedding-type", sets.pop("position_embedding_type")]
    dests = {field: dest for dest, field in YARN_CONFIG_FIELDS.items()}
    for field, value in sets.items():
        flags += given(dests[field], value).split()
    return flags


def test_enable_gpt_oss_sets_what_upstream_sets_and_nothing_else():
    args = validated("--enable-gpt-oss")
    config = core_transformer_config_from_args(args)
    sets = dict(UPSTREAM["preset_config_sets"])
    assert args.position_embedding_type == sets.pop("position_embedding_type")
    for field, value in sets.items():
        assert getattr(config, field) == value, field
    explicit = validated(*_preset_flags())
    assert {**vars(explicit), "enable_gpt_oss": True} == vars(args)


@pytest.mark.parametrize(
    "flags",
    [
        # Upstream's gpt-oss example script passes both: the preset makes that RoPE YaRN.
        ("--position-embedding-type", "rope"),
        ("--use-rotary-position-embeddings",),
        ("--position-embedding-type", "yarn", "--rotary-scaling-factor", "32"),
        ("--no-yarn-correction-range-round-to-int", "--mscale", "1.0"),
    ],
    ids=str,
)
def test_enable_gpt_oss_takes_flags_that_agree_with_it(flags):
    assert vars(validated("--enable-gpt-oss", *flags)) == vars(validated("--enable-gpt-oss"))


def test_enable_gpt_oss_says_what_it_sets_and_validates_again_unchanged(caplog):
    # Attached to the training logger itself: once a training run in this process has set up
    # its stdout handler, that logger no longer propagates to the root logger caplog watches.
    # Not propagating while attached, so each record is caught once whether or not one has.
    training_logger = logging.getLogger("megatron.training")
    training_logger.addHandler(caplog.handler)
    propagate, training_logger.propagate = training_logger.propagate, False
    try:
        with caplog.at_level(logging.INFO, logger=training_logger.name):
            args = validated("--enable-gpt-oss", "--position-embedding-type", "rope")
    finally:
        training_logger.propagate = propagate
        training_logger.removeHandler(caplog.handler)
    said = [record.getMessage() for record in caplog.records if "--enable-gpt-oss" in record.msg]
    assert said == [
        "> --enable-gpt-oss (upstream's gpt-oss preset) sets --position-embedding-type yarn "
        "--rotary-scaling-factor 32.0 --yarn-original-max-position-embeddings 131072 "
        "--yarn-beta-fast 32.0 --yarn-beta-slow 1.0 --mscale 1.0 --mscale-all-dim 0.0 "
        "--no-yarn-correction-range-round-to-int"
    ]
    before = dict(vars(args))
    from megatron.training.arguments import validate_args

    assert vars(validate_args(args, world_size=2)) == before


@pytest.mark.parametrize(
    "flags, contradicting",
    [
        ("--position-embedding-type learned_absolute", "learned_absolute contradict"),
        ("--position-embedding-type none", "--position-embedding-type none"),
        ("--rotary-scaling-factor 1", "--rotary-scaling-factor 1.0"),
        ("--yarn-original-max-position-embeddings 4096", "--yarn-original-max-position-embeddings"),
        ("--yarn-beta-slow 2", "--yarn-beta-slow 2.0"),
        ("--mscale-all-dim 1", "--mscale-all-dim 1.0"),
        ("--yarn-correction-range-round-to-int", "--yarn-correction-range-round-to-int contra"),
    ],
)
def test_a_flag_that_contradicts_enable_gpt_oss_is_refused(flags, contradicting):
    with pytest.raises(ValueError) as error:
        validated("--enable-gpt-oss", *flags.split())
    message = str(error.value)
    assert message.startswith("--enable-gpt-oss sets --position-embedding-type yarn ")
    assert contradicting in message


def test_enable_gpt_oss_is_not_multi_latent_attentions():
    with pytest.raises(ValueError, match="--enable-gpt-oss with --multi-latent-attention"):
        validated("--enable-gpt-oss", "--multi-latent-attention")


def test_yarn_flags_without_yarn_are_refused_together():
    with pytest.raises(ValueError) as error:
        validated(
            "--position-embedding-type", "rope", "--rotary-scaling-factor", "4",
            "--yarn-beta-fast", "8", "--no-yarn-correction-range-round-to-int",
        )  # fmt: skip
    message = str(error.value)
    assert message.startswith(
        "--rotary-scaling-factor 4.0, --yarn-beta-fast 8.0, "
        "--no-yarn-correction-range-round-to-int: these set YaRN, which this run does not use "
        "(its positions are --position-embedding-type rope)"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--rotary-percent", "0.5"),
            "--rotary-percent 0.5 applies to --position-embedding-type rope; YaRN rotates every",
        ),
        (("--rotary-interleaved",), "--rotary-interleaved applies to --position-embedding-type"),
        (("--use-rope-scaling",), "--use-rope-scaling applies to --position-embedding-type rope"),
        (
            ("--rotary-seq-len-interpolation-factor", "2"),
            "--rotary-seq-len-interpolation-factor applies to --position-embedding-type rope",
        ),
        (
            ("--rotary-scaling-factor", "40", "--mscale-all-dim", "-20"),
            "--mscale-all-dim -20.0 with --rotary-scaling-factor 40.0 gives a YaRN scale",
        ),
    ],
)
def test_what_yarn_does_not_combine_with_is_refused_by_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        validated(*YARN, *flags)


def test_a_checkpoint_of_other_yarn_values_does_not_load():
    saved = validated(*YARN, "--yarn-beta-fast", "16")
    common = {"checkpoint_version": checkpointing.CHECKPOINT_VERSION, "args": vars(saved)}
    checkpointing._check_arguments(common, "ckpt", validated(*YARN, "--yarn-beta-fast", "16"))
    with pytest.raises(CheckpointError, match=r"--yarn-beta-fast 16.0 \(here 32.0\)"):
        checkpointing._check_arguments(common, "ckpt", validated(*YARN))
    rope = validated("--position-embedding-type", "rope")
    with pytest.raises(CheckpointError, match=r"--position-embedding-type yarn \(here rope\)"):
        checkpointing._check_arguments(common, "ckpt", rope)
