"""Flags of upstream features this project does not build: each parses, and setting one is an
error naming the feature and the flags; the performance hints are accepted; checkpoint-loading
strictness; a bad flag ends a script with one short message."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args
from megatron.training.flag_groups.unbuilt import PERFORMANCE_HINTS, TOKENIZER_UNBUILT, UNBUILT
from tests.unit_tests.program_launcher import run_program
from tests.unit_tests.training.flag_checks import BASE, validated

ROOT = Path(__file__).resolve().parents[3]


def test_no_unbuilt_flag_is_set_by_default():
    validated()  # raises if any default counted as "set"


@pytest.mark.parametrize("unbuilt", UNBUILT + TOKENIZER_UNBUILT, ids=lambda u: u.feature)
def test_every_flag_of_an_unbuilt_feature_is_refused_naming_it(unbuilt):
    # Tensor parallelism is asked for too, where sequence parallelism needs it to mean anything.
    tp = ["--tensor-model-parallel-size", "2"] if "tensor" in unbuilt.feature else []
    for flag in unbuilt.switches:
        message = re.escape(f"{flag}: {unbuilt.feature} is not built")
        with pytest.raises(ValueError, match=message):
            validated(flag, *tp)
    for flag in unbuilt.valued:
        message = re.escape(f"{flag} 3: {unbuilt.feature} is not built")
        with pytest.raises(ValueError, match=message):
            validated(flag, "3", *tp)
    for flag, values in unbuilt.values:
        for value in values:
            message = re.escape(f"{flag} {value}: {unbuilt.feature} is not built")
            with pytest.raises(ValueError, match=message):
                validated(flag, value, *tp)


def test_the_flex_dispatchers_backend_is_read_only_with_the_flex_dispatcher():
    """As upstream: another dispatcher does not read it (ncclep is refused without flex, as
    upstream refuses it, in `test_every_flag_of_an_unbuilt_feature_...`); without experts it is
    refused as the other MoE flags are."""
    args = validated(
        *"--num-experts 4 --moe-token-dispatcher-type alltoall".split(),
        *"--moe-flex-dispatcher-backend hybridep".split(),
    )
    assert (args.moe_token_dispatcher_type, args.moe_flex_dispatcher_backend) == (
        "alltoall",
        "hybridep",
    )
    with pytest.raises(ValueError, match="--moe-flex-dispatcher-backend hybridep: MoE flags"):
        validated("--moe-flex-dispatcher-backend", "hybridep")


def test_sequence_parallel_without_tensor_parallelism_is_off_as_upstream():
    assert validated("--sequence-parallel").sequence_parallel is False


def test_all_the_flags_of_a_feature_are_named_together():
    with pytest.raises(ValueError) as error:
        validated("--moe-paged-stash", "--moe-paged-stash-page-size", "8")
    message = str(error.value)
    for given in ("--moe-paged-stash", "--moe-paged-stash-page-size 8"):
        assert given in message
    assert "the MoE paged stash is not built" in message


def test_values_upstream_writes_as_lists_parse():
    assert parse_args(args=[*BASE, "--mamba-state-dim", "16"]).mamba_state_dim == ["16"]


def test_performance_hints_are_accepted_and_documented_as_no_ops():
    flags_doc = (ROOT / "docs" / "flags.md").read_text()
    args = validated(*(flag for flag, _ in PERFORMANCE_HINTS))
    for flag, dest in PERFORMANCE_HINTS:
        assert getattr(args, dest) is True
        assert f"`{flag}`" in flags_doc


@pytest.mark.parametrize(
    "strictness",
    [
        "assume_ok_unexpected",
        "raise_unexpected",
        "raise_all",
        "log_unexpected",
        "log_all",
        "ignore_all",
    ],
)
def test_checkpoint_strictness_that_loading_honours_is_accepted(strictness):
    assert validated("--dist-ckpt-strictness", strictness).dist_ckpt_strictness == strictness


@pytest.mark.parametrize("strictness", ["return_unexpected", "return_all"])
def test_returning_checkpoint_strictness_is_refused(strictness):
    with pytest.raises(ValueError, match=f"--dist-ckpt-strictness {strictness} returns the"):
        validated("--dist-ckpt-strictness", strictness)


def test_a_bad_flag_ends_pretrain_gpt_with_one_message_and_exit_code_2():
    done = run_program(
        "pretrain_gpt.py", [*BASE, "--mtp-hybrid-override-pattern", "MM"], cwd=ROOT, timeout=300
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --mtp-hybrid-override-pattern MM: multi-token prediction variants (standalone "
        "stages, one repeated layer, detached heads, hidden-state mixing, hybrid patterns) is not "
        "built in this project; drop these flags: --mtp-num-layers builds one layer per depth, "
        "trained with the model."
    ]


def test_rope_type_rope_is_accepted_and_yarn_refused_without_mla():
    assert validated("--rope-type", "rope").rope_type == "rope"
    with pytest.raises(ValueError, match="--rope-type yarn: these set multi-latent attention"):
        validated("--rope-type", "yarn")
    assert validated("--rope-type", "yarn", "--multi-latent-attention").rope_type == "yarn"


def test_a_torchrun_job_prints_rank_0s_errors_once(tmp_path):
    """Every flag error of a job, an unbuilt flag's among them, is printed once, by rank 0.
    Rank 1 alone finds them at once (rank 0 is held back, as a slow start would): it waits for
    rank 0's message instead of ending the job before it is printed."""
    slow_rank_0 = tmp_path / "slow_rank_0.py"
    slow_rank_0.write_text(
        "import os, runpy, sys, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    time.sleep(5)\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    bad = ["--mtp-hybrid-override-pattern", "MM", "--attention-dropout", "1.5"]
    bad += ["--global-batch-size", "7"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = run_program(slow_rank_0, ["pretrain_gpt.py", *BASE, *bad], nproc=2, env=env, cwd=ROOT)
    assert done.returncode != 0
    assert done.stderr.count("error: 3 flag errors:") == 1, done.stderr
    assert done.stderr.count("--mtp-hybrid-override-pattern MM: multi-token") == 1
    for given in ("--attention-dropout 1.5", "--global-batch-size 7"):
        assert done.stderr.count(given) == 1, done.stderr
