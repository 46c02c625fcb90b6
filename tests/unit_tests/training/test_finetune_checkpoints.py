"""A finetuning run never writes over the checkpoint it starts from, nor over another run's.

- `--finetune` with `--load` the `--save` directory, however spelled, is refused before
  anything starts, on every rank.
- `--finetune` into a `--save` directory that holds checkpoints (a restart of a `--finetune`
  job) is refused on every rank: the run would start again at iteration 0 and replace them.
- `--pretrained-checkpoint` (Megatron-LM's flag) makes a job that restarts itself: it
  finetunes from the pretrained checkpoint while `--load` holds none, then resumes from
  `--load`, bitwise as the uninterrupted finetuning run.
In each case the directories involved are byte-identical afterwards, or only gain checkpoints.
"""

from __future__ import annotations

import os
import shutil

import pytest

from megatron.training.checkpoint_layout import TRACKER_FILENAME, CheckpointError
from megatron.training.flag_errors import InvalidFlagsError
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    ZERO3,
    assert_histories_equal,
    directory_hashes,
    main,
    main_error,
    read_tracker_text,
    resumed_part,
)
from tests.unit_tests.training.flag_checks import validated

FLAGS = [*RUN, *ZERO3]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    """A --save directory of 3 ZeRO-3 iterations on 2 ranks (checkpoint of iteration 3)."""
    root = str(tmp_path_factory.mktemp("pretrained"))
    run_distributed(main, 2, [*FLAGS, "--exit-interval", "3", "--save", root])
    assert read_tracker_text(root) == "3\n"
    return root


def test_finetune_into_its_own_load_directory_is_refused_on_every_rank(pretrained):
    before = directory_hashes(pretrained)
    flags = [*FLAGS, "--load", pretrained, "--save", pretrained + "/", "--finetune"]
    for kind, message in run_distributed(main_error, 2, flags):
        assert kind == InvalidFlagsError.__name__, message
        assert f"--finetune with --load {pretrained} as --save" in message, message
        assert "Pass a new --save directory" in message, message
        assert f"--pretrained-checkpoint {pretrained} --load NEW --save NEW" in message, message
    assert directory_hashes(pretrained) == before


def test_finetune_into_a_directory_holding_checkpoints_is_refused_on_every_rank(
    pretrained, tmp_path
):
    """As a restarted `--finetune` job would: it would replace its own earlier checkpoints."""
    save = str(tmp_path / "finetuned")
    shutil.copytree(pretrained, save)  # a checkpoint of iteration 3, as a first attempt left
    before = directory_hashes(pretrained), directory_hashes(save)
    flags = [*FLAGS, "--load", pretrained, "--save", save, "--finetune"]
    for kind, message in run_distributed(main_error, 2, flags):
        assert kind == CheckpointError.__name__, message
        assert f"--save {save} holds checkpoints already (iterations [3])" in message, message
        assert f"--pretrained-checkpoint {pretrained} --load {save} --save {save}" in message
    assert (directory_hashes(pretrained), directory_hashes(save)) == before


def test_pretrained_checkpoint_finetunes_then_a_restart_resumes(pretrained, tmp_path):
    before = directory_hashes(pretrained)
    straight = run_distributed(main, 2, [*FLAGS, "--load", pretrained, "--finetune"])[0]
    save = str(tmp_path / "finetuned")
    job = [*FLAGS, "--pretrained-checkpoint", pretrained, "--load", save, "--save", save]
    first = run_distributed(main, 2, [*job, "--exit-interval", "3"])[0]
    # Finetuned from the pretrained weights: the straight finetuning run's first iterations.
    assert first.start_iteration == 0 and first.losses == straight.losses[:3]
    assert read_tracker_text(save) == "3\n"
    # The same command again (a restart) resumes from --save, bitwise.
    second = run_distributed(main, 2, job)[0]
    assert_histories_equal(second, resumed_part(straight, 3))
    assert sorted(os.listdir(save)) == ["iter_0000003", "iter_0000006", TRACKER_FILENAME]
    assert read_tracker_text(save) == "6\n"
    assert directory_hashes(pretrained) == before


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--finetune", "--load", "{dir}/a", "--save", "{dir}/a/../a"],
            "--finetune with --load {dir}/a as --save",
        ),
        (
            ["--finetune", "--load", "{dir}/link", "--save", "{dir}/a"],
            "--finetune with --load {dir}/link as --save",
        ),
        (
            ["--pretrained-checkpoint", "{dir}/a", "--save", "{dir}/b"],
            "--pretrained-checkpoint needs --load: the directory a restarted job resumes",
        ),
        (
            ["--pretrained-checkpoint", "{dir}/a", "--load", "{dir}/b", "--save", "{dir}/link"],
            "--pretrained-checkpoint {dir}/a is the --save directory",
        ),
    ],
)
def test_finetuning_into_its_source_is_refused(flags, message, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError) as error:
        validated(*(flag.format(dir=tmp_path) for flag in flags))
    assert message.format(dir=tmp_path) in str(error.value)


def test_finetuning_into_another_directory_is_accepted(tmp_path):
    validated("--finetune", "--load", f"{tmp_path}/a", "--save", f"{tmp_path}/b")
    args = validated(
        "--pretrained-checkpoint",
        f"{tmp_path}/a",
        "--load",
        f"{tmp_path}/b",
        "--save",
        f"{tmp_path}/b",
    )
    assert args.pretrained_checkpoint == f"{tmp_path}/a"


def test_a_model_flag_that_changes_what_the_weights_mean_must_match(pretrained, tmp_path):
    """A norm epsilon other than the checkpoint's would load silently and compute another
    function: every rank refuses, naming the flag and both values."""
    flags = [*FLAGS, "--load", pretrained, "--save", str(tmp_path / "ft"), "--finetune"]
    flags += ["--norm-epsilon", "1e-6"]
    for kind, message in run_distributed(main_error, 2, flags):
        assert kind == CheckpointError.__name__, message
        assert "--norm-epsilon 1e-05 (here 1e-06)" in message, message
