"""Every flag of upstream Megatron-LM's parser is known here (implemented, a documented no-op, or
refused by name), takes a value exactly where upstream's does, and a command line's refused and
invalid flags are reported together in one message; the flags implemented for that: the
`--use-rotary-position-embeddings` alias, `--deterministic-mode`, `--rerun-mode disabled`."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron.training import determinism, global_vars
from megatron.training.arguments import add_megatron_arguments, parse_args
from megatron.training.flag_errors import FlagErrors
from megatron.training.flag_groups.unbuilt import PERFORMANCE_HINTS, VALUED_HINTS
from megatron.training.initialize import destroy_megatron, initialize_megatron
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.program_launcher import run_program
from tests.unit_tests.training.flag_checks import BASE, validated

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = Path(__file__).with_name("fixtures") / "upstream_flags.txt"


def _upstream_flags() -> dict[str, bool]:
    """The fixture's option strings, each with whether upstream's takes a value."""
    flags = {}
    for line in FIXTURE.read_text().splitlines():
        if line and not line.startswith("#"):
            name, kind = line.split()
            flags[name] = kind == "value"
    return flags


def test_the_fixture_names_its_upstream_commit_and_holds_upstreams_flags():
    header = FIXTURE.read_text()
    assert re.search(r"^# upstream commit: [0-9a-f]{40}$", header, re.MULTILINE)
    flags = _upstream_flags()
    # Sanity of the list itself: literal flags, dataclass-factory flags and their --no- forms.
    assert {"--lr", "--deterministic-mode", "--no-ckpt-fully-parallel-save"} <= set(flags)
    assert {"--disable-tp-comm-bulk-wgrad", "--use-rotary-position-embeddings"} <= set(flags)
    assert len(flags) > 800


def test_every_upstream_flag_is_known_and_takes_a_value_where_upstream_does():
    parser = add_megatron_arguments(argparse.ArgumentParser(add_help=False))
    known = parser._option_string_actions
    unknown = sorted(name for name in _upstream_flags() if name not in known)
    assert not unknown, f"{len(unknown)} upstream flags unknown here: {unknown}"
    misshapen = sorted(
        name
        for name, takes_value in _upstream_flags().items()
        if (known[name].nargs != 0) != takes_value
    )
    assert not misshapen, f"take a value here but not upstream, or the reverse: {misshapen}"


def test_the_listing_tool_reads_a_synthetic_upstream(tmp_path):
    """tools/list_upstream_flags.py on a git repository with a tiny upstream-shaped parser."""
    repo = tmp_path / "upstream"
    (repo / "megatron" / "training").mkdir(parents=True)
    (repo / "megatron" / "training" / "arguments.py").write_text(
        "def _add_args(parser):\n"
        "    group = parser.add_argument_group(title='x')\n"
        "    group.add_argument('--save-interval', '--persistent-save-interval', type=int)\n"
        "    group.add_argument('--switch', action='store_true')\n"
        "    factory = ArgumentGroupFactory(Config)\n"
        "    return parser\n"
    )
    (repo / "megatron" / "config.py").write_text(
        "class Config:\n    keep_it: bool = True\n    size: int = 3\n"
    )
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    done = subprocess.run(
        [sys.executable, "tools/list_upstream_flags.py", "--git-dir", str(repo / ".git")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line for line in done.stdout.splitlines() if not line.startswith("#")]
    assert lines == [
        "--disable-keep-it switch",
        "--no-keep-it switch",
        "--persistent-save-interval value",
        "--save-interval value",
        "--size value",
        "--switch switch",
    ]


def test_three_bad_flags_of_different_kinds_are_named_in_one_message():
    with pytest.raises(FlagErrors) as error:
        validated(
            "--mtp-hsm",  # not built
            "--attention-dropout", "1.5",  # out of range
            "--global-batch-size", "7",  # not a multiple of micro x data-parallel (2 x 2)
        )  # fmt: skip
    message = str(error.value)
    assert message.startswith("3 flag errors:\n")
    assert "--mtp-hsm: multi-token prediction variants" in message
    assert "--attention-dropout 1.5 must be" in message
    assert "--global-batch-size 7 is not divisible by --micro-batch-size 2" in message


def test_every_refused_feature_and_every_range_error_is_named():
    with pytest.raises(FlagErrors) as error:
        validated(
            "--mtp-hsm", "--cache-mla-latents", "--save-retain-interval", "5",
            "--hidden-dropout", "2", "--attention-dropout", "-1",
        )  # fmt: skip
    assert len(error.value.messages) == 5, error.value.messages


def test_a_check_that_needs_a_bad_value_is_skipped_not_repeated():
    """A missing --num-layers stops the model checks that read it; the data check still runs."""
    at = BASE.index("--num-layers")
    base = [flag for flag in BASE[:at] + BASE[at + 2 :] if flag != "--mock-data"]
    with pytest.raises(FlagErrors) as error:
        validated(base=tuple(base))
    assert error.value.messages == [
        "--num-layers is required; pass it on the command line.",
        error.value.messages[1],
    ]
    assert error.value.messages[1].startswith("No training data")


def test_one_error_keeps_its_own_message():
    with pytest.raises(ValueError) as error:
        validated("--mtp-hsm")
    assert str(error.value) == (
        "--mtp-hsm: multi-token prediction variants (standalone stages, one repeated layer, "
        "detached heads, hidden-state mixing, hybrid patterns) is not built in this project; drop "
        "these flags: --mtp-num-layers builds one layer per depth, trained with the model."
    )


def test_pretrain_gpt_prints_every_error_once_and_exits_2():
    bad = ["--mtp-hsm", "--attention-dropout", "1.5", "--global-batch-size", "7"]
    done = run_program(ROOT / "pretrain_gpt.py", [*BASE, *bad], cwd=ROOT)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "error: 3 flag errors:"
    assert len(lines) == 4 and lines[1].startswith("  - --mtp-hsm: multi-token")
    assert done.stderr.count("--attention-dropout 1.5") == 1


def test_use_rotary_position_embeddings_builds_the_model_rope_builds():
    alias = validated("--use-rotary-position-embeddings")
    rope = validated("--position-embedding-type", "rope")
    assert alias.position_embedding_type == "rope"
    assert vars(alias) == vars(rope)
    models = []
    for args in (alias, rope, validated()):
        global_vars.set_args(args)
        torch.manual_seed(0)
        models.append(pretrain_gpt.model_provider().eval())  # no dropout
    global_vars.set_args(None)
    tokens = torch.randint(0, 100, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    alias_out, rope_out, learned_out = (model(tokens, positions, None) for model in models)
    names = [name for name, _ in models[0].named_parameters()]
    assert not any("position_embeddings" in name for name in names)
    assert any("position_embeddings" in name for name, _ in models[2].named_parameters())
    torch.testing.assert_close(alias_out, rope_out, rtol=0, atol=0)
    assert not torch.equal(alias_out, learned_out)


def test_persistent_save_interval_is_save_interval():
    args = parse_args(args=[*BASE, "--persistent-save-interval", "7"])
    assert args.save_interval == 7


def test_rerun_mode_disabled_is_accepted_and_the_others_refused():
    assert validated("--rerun-mode", "disabled").rerun_mode == "disabled"
    for mode in ("validate_results", "report_stats"):
        with pytest.raises(ValueError, match=f"--rerun-mode {mode}: the rerun state machine"):
            validated("--rerun-mode", mode)


def test_the_no_ops_are_accepted_and_documented():
    doc = (ROOT / "docs" / "flags.md").read_text()
    values = {str: "x", int: "0"}
    flags = [flag for flag, _ in PERFORMANCE_HINTS]
    for flag, _, kind in VALUED_HINTS:
        flags += [flag, values[kind]]
    validated(*flags)
    for flag in [flag for flag, _ in PERFORMANCE_HINTS] + [flag for flag, _, _ in VALUED_HINTS]:
        assert f"`{flag}`" in doc, flag


@pytest.fixture
def clean_determinism(monkeypatch):
    for name in determinism.ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    yield
    determinism.restore_nondeterministic_mode()


@pytest.mark.usefixtures("clean_determinism")
def test_deterministic_mode_sets_torch_and_the_environment_and_is_undone():
    assert not torch.are_deterministic_algorithms_enabled()
    determinism.apply_deterministic_mode()
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["NCCL_ALGO"] == "Ring"
    determinism.restore_nondeterministic_mode()
    assert not torch.are_deterministic_algorithms_enabled()
    assert "NCCL_ALGO" not in os.environ


@pytest.mark.usefixtures("clean_determinism")
def test_deterministic_mode_keeps_a_launchers_deterministic_setting(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    validated("--deterministic-mode")
    determinism.apply_deterministic_mode()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.usefixtures("clean_determinism")
def test_deterministic_mode_refuses_what_breaks_it(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(ValueError) as error:
        validated("--deterministic-mode", "--cross-entropy-loss-fusion")
    message = str(error.value)
    assert "--cross-entropy-loss-fusion (drop it)" in message and "NCCL_ALGO=Tree" in message
    validated("--cross-entropy-loss-fusion")  # without --deterministic-mode: fine


def _deterministic_job(flags: list[str]) -> tuple[bool, str | None, bool, str | None]:
    """(deterministic during the job, NCCL_ALGO then, after it, NCCL_ALGO after) on this rank."""
    initialize_megatron(argv=[*flags, "--distributed-backend", "gloo"])
    during = (torch.are_deterministic_algorithms_enabled(), os.environ.get("NCCL_ALGO"))
    destroy_megatron(destroy_default_group=False)
    return (*during, torch.are_deterministic_algorithms_enabled(), os.environ.get("NCCL_ALGO"))


def test_a_deterministic_job_starts_deterministic_and_ends_as_it_was():
    if "NCCL_ALGO" in os.environ:
        pytest.skip("the environment sets NCCL_ALGO")
    flags = [*BASE, "--deterministic-mode"]
    for result in run_distributed(_deterministic_job, 2, flags):
        assert result == (True, "Ring", False, None)
