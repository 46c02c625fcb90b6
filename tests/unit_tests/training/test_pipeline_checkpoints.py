"""Checkpoints of pipeline stages through `pretrain_gpt.main` on 2 gloo ranks, 4 layers: a run
at PP 2 with 2 virtual stages per rank (Megatron-FSDP ZeRO-3) stopped after iteration 3 and
resumed so is bitwise the uninterrupted run. Its checkpoint holds the whole model under the
names a run without stages gives it (the same tensors, shapes and optimizer parameter groups as
a PP 1 checkpoint), and loads at PP 1 (the DDP engine, DP 2), whose checkpoint after iteration 4
loads at PP 2 without virtual stages (the DDP engine), whose checkpoint after iteration 5 loads
at PP 1 (Megatron-FSDP): each resumed run trains as the uninterrupted one."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron.training.checkpoint_layout import COMMON_FILENAME, checkpoint_dir, saved_entries
from megatron.training.checkpoint_stages import merge_param_groups
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    ZERO3,
    assert_histories_equal,
    main,
    read_tracker_text,
    resumed_part,
)
from tests.unit_tests.training.test_context_parallel_checkpoints import _assert_trains_as

# Dropout would draw other masks at another split of the work (1 stage of DP 2 against 2
# stages), so the runs are compared without it.
NO_DROPOUT = ("--attention-dropout", "0", "--hidden-dropout", "0")
FOUR_LAYERS = (*NO_DROPOUT, "--num-layers", "4")
PP2 = (*FOUR_LAYERS, "--pipeline-model-parallel-size", "2")
VIRTUAL = (*PP2, "--num-virtual-stages-per-pipeline-rank", "2")
PP1 = FOUR_LAYERS


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The uninterrupted run at PP 2 with virtual stages under Megatron-FSDP, and a --save
    directory of the same run stopped after iteration 3."""
    root = str(tmp_path_factory.mktemp("pp2-first-half"))
    first = run_distributed(
        main,
        2,
        [*RUN, *VIRTUAL, *ZERO3, "--exit-interval", "3", "--save", root, "--save-interval", "3"],
    )[0]
    assert len(first.losses) == 3
    return dict(pp2=run_distributed(main, 2, [*RUN, *VIRTUAL, *ZERO3])[0], root=root)


def test_resume_with_virtual_stages_is_bitwise_the_uninterrupted_run(runs, tmp_path):
    resume_root = str(tmp_path / "resume")
    shutil.copytree(runs["root"], resume_root)
    resumed = run_distributed(
        main, 2, [*RUN, *VIRTUAL, *ZERO3, "--load", resume_root, "--save", resume_root]
    )
    assert resumed[0].start_iteration == 3
    assert runs["pp2"].losses[-1]["lm loss"] < runs["pp2"].losses[0]["lm loss"]
    assert_histories_equal(resumed[0], resumed_part(runs["pp2"], 3))
    assert_histories_equal(resumed[1], resumed[0])
    assert read_tracker_text(resume_root) == "6\n"


def _contents(root: str, iteration: int) -> tuple[dict, list[set[str]]]:
    """A checkpoint's tensors (path -> global shape) and its optimizer's parameter groups (the
    names in each)."""
    path = checkpoint_dir(root, iteration)
    shapes = {
        key: getattr(item, "size", None)
        for key, item in saved_entries(FileSystemReader(path).read_metadata()).items()
    }
    common = torch.load(os.path.join(path, COMMON_FILENAME), weights_only=False)
    return shapes, [set(group["params"]) for group in common["param_groups"]]


def test_checkpoints_load_across_pipeline_sizes(runs, tmp_path):
    root = str(tmp_path / "across")
    shutil.copytree(runs["root"], root)
    steps = [
        (PP1, 4),  # the DDP engine at DP 2
        (PP2, 5),  # the DDP engine, 2 stages without virtual stages
        ((*PP1, *ZERO3), 6),
    ]
    start = 3
    for flags, stop in steps:
        resumed = run_distributed(
            main, 2, [*RUN, *flags, "--load", root, "--save", root, "--exit-interval", str(stop)]
        )[0]
        assert resumed.start_iteration == start
        _assert_trains_as(resumed, resumed_part(runs["pp2"], start), until=stop)
        assert read_tracker_text(root) == f"{stop}\n"
        start = stop
    # Saved at PP 2 (iterations 3 and 5) and at PP 1 (4 and 6): the same checkpoint.
    pp1 = _contents(root, 4)
    assert any(".layers.3." in key[1] for key in pp1[0] if key[0] == "model")
    for iteration in (3, 5):
        assert _contents(root, iteration) == pp1, iteration


def test_multi_token_prediction_checkpoints_load_across_pipeline_sizes(tmp_path):
    """With --mtp-num-layers the last stage holds a copy of the whole embedding (word and learned
    positions), which is not saved: the checkpoint of PP 2 (Megatron-FSDP) after iteration 1
    loads at PP 1 (the DDP engine), which trains iteration 2 as PP 2 does and saves the same
    tensors and parameter groups."""
    mtp = [*RUN, "--mtp-num-layers", "1", "--train-iters", "2", "--lr-warmup-iters", "1"]
    stages, one = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    straight = run_distributed(
        main, 2, [*mtp, *PP2, *ZERO3, "--save", stages, "--save-interval", "1"]
    )[0]
    assert "mtp_1 loss" in straight.losses[0]
    resumed = run_distributed(
        main, 2, [*mtp, *PP1, "--load", stages, "--ckpt-step", "1", "--save", one]
    )[0]
    assert resumed.start_iteration == 1
    _assert_trains_as(resumed, resumed_part(straight, 1))
    assert _contents(one, 2) == _contents(stages, 2)


FP8_DELAYED = "--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max".split()
"""FP8 with delayed scaling (in fp32): each stage's amax histories and scales are state."""


def test_fp8_state_of_each_stage_resumes(tmp_path):
    """Each stage saves its own FP8 delayed-scaling state (named by its layers), so a run at PP 2
    resumed from its checkpoint of iteration 2 is bitwise the uninterrupted run (one state name
    for both stages: one stage would resume with the other's scales)."""
    root = str(tmp_path)
    flags = [*RUN, *PP2, *ZERO3, *FP8_DELAYED]
    straight = run_distributed(main, 2, [*flags, "--save", root, "--save-interval", "2"])[0]
    resumed = run_distributed(main, 2, [*flags, "--load", root, "--ckpt-step", "2"])[0]
    assert resumed.start_iteration == 2
    assert_histories_equal(resumed, resumed_part(straight, 2))


def test_merged_param_groups_hold_each_name_once_in_first_seen_order():
    decay, no_decay = {"lr": 1e-3, "weight_decay": 0.1}, {"lr": 1e-3, "weight_decay": 0.0}
    stage_0 = [{**decay, "params": ["a.w", "b.w"]}, {**no_decay, "params": ["a.b"]}]
    stage_1 = [{**no_decay, "params": ["c.b", "a.b"]}, {**decay, "params": ["c.w", "a.w"]}]
    # Two data-parallel ranks of each stage list the same names.
    merged = merge_param_groups([stage_0, stage_0, stage_1, stage_1])
    assert merged == [
        {**decay, "params": ["a.w", "b.w", "c.w"]},
        {**no_decay, "params": ["a.b", "c.b"]},
    ]
    assert list(merged[0]) == ["lr", "weight_decay", "params"]
