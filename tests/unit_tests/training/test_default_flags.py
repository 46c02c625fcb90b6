"""Upstream Megatron-LM's defaults and meanings for the flags both parsers share, and the audit
tool that compares them (`tools/compare_flag_defaults.py`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.training import data_iterators
from megatron.training.arguments import (
    core_transformer_config_from_args,
    get_megatron_ddp_config,
    parse_args,
    validate_args,
)
from tools import compare_flag_defaults

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "flags.md"
UPSTREAM_GIT_DIR = Path(os.environ.get("MEGATRON_LM_GIT_DIR", "/nonexistent"))
"""Upstream Megatron-LM's git directory (a clone's `.git`), from `MEGATRON_LM_GIT_DIR`: the audit
reads its `arguments.py` and config dataclasses."""

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --vocab-size 128 "
    "--distributed-backend gloo"
).split()


def validated(*flags: str, world_size: int = 2):
    return validate_args(parse_args(args=[*BASE, *flags]), world_size=world_size)


def test_megatron_fsdp_shards_optim_grads_params_by_default():
    args = validated("--use-megatron-fsdp")
    assert args.data_parallel_sharding_strategy == "optim_grads_params"
    assert get_megatron_ddp_config(args).data_parallel_sharding_strategy == "optim_grads_params"


def test_ddp_engine_gets_no_sharding_from_the_parser_default():
    config = get_megatron_ddp_config(validated())
    assert config.use_megatron_fsdp is False
    assert config.data_parallel_sharding_strategy == "no_shard"


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_sharding_strategy_without_megatron_fsdp_is_refused(strategy):
    with pytest.raises(ValueError, match=f"--data-parallel-sharding-strategy {strategy} needs"):
        validated("--data-parallel-sharding-strategy", strategy)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_explicit_sharding_strategy_reaches_the_config(strategy):
    args = validated("--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy)
    assert get_megatron_ddp_config(args).data_parallel_sharding_strategy == strategy


def test_eval_interval_defaults_to_none_and_sizes_one_final_evaluation():
    args = validated("--eval-iters", "3", "--train-iters", "2000")
    assert args.eval_interval is None
    # Megatron-LM without --eval-interval: no evaluation during training (see the loop), one at
    # the end; 1000 (the old default) would have asked for three evaluations' samples.
    requested = []

    def provider(num_samples):
        requested.append(num_samples)
        raise StopIteration

    with pytest.raises(StopIteration):
        data_iterators.build_train_valid_test_data_iterators(provider, args)
    assert requested == [[2000 * 4, 3 * 4, 3 * 4]]


def test_group_query_attention_defaults_to_one_query_group():
    """Upstream's --num-query-groups default is 1: --group-query-attention alone is MQA."""
    args = validated("--group-query-attention")
    assert args.num_query_groups == 1
    assert core_transformer_config_from_args(args).num_query_groups == 1


@pytest.mark.parametrize("flags", [(), ("--num-query-groups", "2")])
def test_num_query_groups_without_group_query_attention_is_one_per_head(flags):
    """Upstream reads --num-query-groups only with --group-query-attention."""
    args = validated(*flags)
    assert core_transformer_config_from_args(args).num_query_groups == 4


def test_norm_epsilon_has_upstreams_destination():
    args = validated("--norm-epsilon", "1e-6")
    assert args.layernorm_epsilon == 1e-6 and not hasattr(args, "norm_epsilon")
    assert core_transformer_config_from_args(args).layernorm_epsilon == 1e-6


def test_split_is_accepted_with_mock_data():
    assert validated("--split", "90,5,5").split == "90,5,5"


def test_split_defaults_to_none_and_data_path_takes_the_legacy_split(tmp_path):
    assert parse_args(args=BASE).split is None
    prefix = _tiny_indexed_dataset(tmp_path)
    flags = [f for f in BASE if f not in ("--mock-data",)]
    flags += ["--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer"]
    args = parse_args(args=flags)
    validate_args(args, world_size=1)
    assert args.split == "969,30,1"


def _tiny_indexed_dataset(tmp_path: Path) -> str:
    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for length in (40, 50):
        builder.add_document(torch.arange(length, dtype=torch.int32), [length])
    builder.finalize(prefix + ".idx")
    return prefix


# The audit tool, on a synthetic upstream: literal add_argument calls and a dataclass factory.
SYNTHETIC_ARGUMENTS = textwrap.dedent(
    """
    def _add_things(parser):
        group = parser.add_argument_group(title='x')
        group.add_argument('--lr', type=float, default=None, help='.')
        group.add_argument('--eval-iters', type=int, default=7, help='.')
        group.add_argument('--no-such-flag-here', action='store_true')
        excluded = ['skipped_field']
        factory = ArgumentGroupFactory(SyntheticConfig, exclude=excluded)
        return parser
    """
)
SYNTHETIC_CONFIG = textwrap.dedent(
    """
    from dataclasses import dataclass, field
    from typing import Literal

    @dataclass
    class SyntheticConfig:
        skipped_field: int = 3
        lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = (
            "linear"
        )
        check_for_nan_in_loss_and_grad: bool = True
        layernorm_epsilon: float = field(
            default=1e-5, metadata={"argparse_meta": {"arg_names": ["--norm-epsilon"]}}
        )
        num_query_groups: int | None = field(
            default=None, metadata={"argparse_meta": {"default": 1}}
        )
        derived: int | None = field(init=False, default=None)
    """
)


def test_audit_tool_reads_literal_flags_and_dataclass_factories(tmp_path):
    arguments, config = tmp_path / "arguments.py", tmp_path / "config.py"
    arguments.write_text(SYNTHETIC_ARGUMENTS)
    config.write_text(SYNTHETIC_CONFIG)
    sources = compare_flag_defaults.ConfigSources([config], None, "HEAD")
    flags, unresolved = compare_flag_defaults.upstream_flags(arguments, sources)
    by_name = {flag.names[0]: flag for flag in flags}
    assert unresolved == []
    assert set(by_name) == {
        "--lr",
        "--eval-iters",
        "--no-such-flag-here",
        "--lr-decay-style",
        "--no-check-for-nan-in-loss-and-grad",
        "--norm-epsilon",
        "--num-query-groups",
    }
    assert by_name["--eval-iters"].default == 7
    assert by_name["--lr-decay-style"].choices[:2] == ("constant", "linear")
    assert by_name["--no-check-for-nan-in-loss-and-grad"].action == "store_false"
    assert by_name["--norm-epsilon"].dest == "layernorm_epsilon"
    assert by_name["--num-query-groups"].default == 1

    differences, missing = compare_flag_defaults.compare(flags, compare_flag_defaults.our_flags())
    # This parser: --eval-iters defaults to 100, so that (and only that) differs.
    assert differences == ["--eval-iters: default upstream=7 here=100"]
    assert missing == ["--no-such-flag-here"]


@pytest.mark.skipif(
    not UPSTREAM_GIT_DIR.exists(), reason="set MEGATRON_LM_GIT_DIR to upstream's git directory"
)
def test_every_remaining_difference_from_upstream_is_documented(tmp_path):
    upstream_arguments = tmp_path / "arguments.py"
    upstream_arguments.write_bytes(
        subprocess.run(
            ["git", f"--git-dir={UPSTREAM_GIT_DIR}", "show", "HEAD:megatron/training/arguments.py"],
            capture_output=True,
            check=True,
        ).stdout
    )
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "compare_flag_defaults.py"),
            str(upstream_arguments),
            "--git-dir",
            str(UPSTREAM_GIT_DIR),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode in (0, 1), result.stderr
    lines = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    section = DOCS.read_text().split("## Where this departs from Megatron-LM", 1)[1]
    undocumented = sorted(
        {line.split(":")[0] for line in lines} - set(re.findall(r"`(--[a-z0-9-]+)", section))
    )
    assert not undocumented, f"differences not in docs/flags.md: {undocumented}\n{result.stdout}"
