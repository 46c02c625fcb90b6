"""Decoupled learning rates (`--decoupled-lr`, `--decoupled-min-lr`): the groups they make,
the schedule between their bounds, both engines, and resuming with other values (refused
unless --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler says which)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_param_groups
from megatron.training.training import get_optimizer_param_scheduler
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import build_tiny_gpt, wrap_for_engine
from tests.unit_tests.training.schedule_checks import TINY, ParamGroups, validated


def test_decoupled_groups_hold_the_embedding_and_output_layer():
    model = build_tiny_gpt(share_embeddings_and_output_weights=False)
    groups = get_param_groups(model, 0.1, decoupled_lr=0.5, decoupled_min_lr=0.05)
    names = {id(param): name for name, param in model.named_parameters()}
    decoupled = [
        names[id(param)] for group in groups if "max_lr" in group for param in group["params"]
    ]
    assert sorted(decoupled) == ["embedding.word_embeddings.weight", "output_layer.weight"]
    assert all(
        group["max_lr"] == 0.5 and group["min_lr"] == 0.05 for group in groups if "max_lr" in group
    )
    plain = get_param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in plain) == sum(len(g["params"]) for g in groups)
    assert all("max_lr" not in group for group in plain)


@pytest.mark.parametrize("decoupled_min_lr", [None, 0.05])
def test_decoupled_lr_follows_the_schedule_between_its_bounds(decoupled_min_lr):
    """Upstream's get_lr(param_group): the group's max_lr/min_lr in the same formula."""
    flags = "--train-iters 10 --lr-warmup-iters 2 --lr-decay-style linear --min-lr 1e-3"
    args = validated(*flags.split(), "--global-batch-size", "8")
    decoupled = {"max_lr": 0.5} | ({} if decoupled_min_lr is None else {"min_lr": decoupled_min_lr})
    groups = ParamGroups({"wd_mult": 1.0}, {"wd_mult": 1.0, **decoupled})
    scheduler = get_optimizer_param_scheduler(groups, args)
    group_min = 1e-3 if decoupled_min_lr is None else decoupled_min_lr
    for iteration in range(1, 12):
        scheduler.step(8)
        for group, (peak, floor) in zip(groups.param_groups, [(1e-2, 1e-3), (0.5, group_min)]):
            if iteration <= 2:
                expected = peak * iteration / 2
            elif iteration > 10:
                expected = floor
            else:
                expected = floor + (1 - (iteration - 2) / 8) * (peak - floor)
            assert group["lr"] == pytest.approx(expected, rel=1e-12)


def _decoupled_groups_of_engine(engine: str) -> list[tuple[int, float | None]]:
    """(elements held, max_lr) of each optimizer group on this rank."""
    model = build_tiny_gpt(share_embeddings_and_output_weights=False)
    wrapped = wrap_for_engine(model, engine)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, decoupled_lr=0.5), wrapped)
    return [
        (sum(p.numel() for p in group["params"]), group.get("max_lr"))
        for group in optimizer.param_groups
    ]


@pytest.mark.parametrize("engine", ["ddp", "optim_grads_params"])
def test_engines_give_the_decoupled_group_its_rate(engine):
    """Under either engine the word embeddings and output layer (2 x vocab 64 x hidden 32
    elements, sharded over 2 ranks by Megatron-FSDP) are held in the decoupled group."""
    expected = 2 * 64 * 32 // (1 if engine == "ddp" else 2)
    for held in run_distributed(_decoupled_groups_of_engine, 2, engine):
        assert [max_lr for _, max_lr in held] == [None, None, 0.5]
        assert held[2][0] == expected


def _decoupled_optimizer(decoupled_lr: float | None, decoupled_min_lr: float | None = None):
    model = build_tiny_gpt(share_embeddings_and_output_weights=False)
    config = OptimizerConfig(lr=1e-2, decoupled_lr=decoupled_lr, decoupled_min_lr=decoupled_min_lr)
    return get_megatron_optimizer(config, model)


@pytest.mark.parametrize(
    "saved, here, fragments",
    [
        (
            (0.02, 0.002),
            (None, None),
            [
                "saved with --decoupled-lr 0.02 --decoupled-min-lr 0.002",
                "without --decoupled-lr",
                "Pass --decoupled-lr 0.02 --decoupled-min-lr 0.002 to resume it",
                "--no-load-optim",
            ],
        ),
        (
            (None, None),
            (0.05, None),
            ["This run has --decoupled-lr 0.05", "saved without it", "Drop --decoupled-lr"],
        ),
    ],
)
def test_decoupled_lr_dropped_or_added_on_resume_is_named(saved, here, fragments):
    """The groups then hold other parameters: the message names the flag, not another model."""
    saved_groups = _decoupled_optimizer(*saved).sharded_state_dict()["param_groups"]
    with pytest.raises(ValueError) as error:
        _decoupled_optimizer(*here).check_param_groups(saved_groups)
    for fragment in fragments:
        assert fragment in str(error.value)
    assert "model it was saved from" not in str(error.value)


def test_decoupled_bounds_of_the_saved_groups_are_left_to_the_scheduler():
    """`check_param_groups` keeps this optimizer's `max_lr` / `min_lr` (the flags'): the
    scheduler checks them against the checkpoint's and replaces them where told to."""
    saved_groups = _decoupled_optimizer(0.02, 0.002).sharded_state_dict()["param_groups"]
    optimizer = _decoupled_optimizer(0.05)
    groups = optimizer.check_param_groups(saved_groups)
    assert [(g.get("max_lr"), g.get("min_lr")) for g in groups] == [
        (g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups
    ]
    assert [g.get("max_lr") for g in groups] == [None, None, 0.05]


DECOUPLED_RESUME = [
    *TINY,
    *"--global-batch-size 4 --train-iters 6 --lr-decay-style constant --min-lr 1e-3".split(),
]


def _decoupled_group(root: Path, iteration: int) -> tuple[float, float, float | None]:
    """(lr, max_lr, min_lr) of the decoupled group the checkpoint of `iteration` saved."""
    common = torch.load(root / f"iter_{iteration:07d}" / "common.pt", weights_only=False)
    (group,) = [g for g in common["param_groups"] if "max_lr" in g]
    return group["lr"], group["max_lr"], group.get("min_lr")


def _main_error(flags: list[str]) -> str | None:
    try:
        pretrain_gpt.main(flags)
    except Exception as error:  # noqa: BLE001 - the test checks the message
        return f"{type(error).__name__}: {error}"
    return None


def test_resume_with_another_decoupled_lr_needs_a_choice(tmp_path):
    """As a changed --lr: refused naming the flag and both rates;
    --override-opt_param-scheduler trains at the flag's rate, --use-checkpoint-opt_param-scheduler
    at the checkpoint's (read back from the next checkpoint's parameter groups). Dropped, the
    refusal names the flag to pass."""
    first = tmp_path / "first"
    flags = [*DECOUPLED_RESUME, "--decoupled-lr", "0.02"]
    run_distributed(pretrain_gpt.main, 2, [*flags, "--save", str(first), "--exit-interval", "3"])
    assert _decoupled_group(first, 3) == (0.02, 0.02, None)
    changed = [*DECOUPLED_RESUME, "--decoupled-lr", "0.05", "--load", str(first)]
    for error in run_distributed(_main_error, 2, changed):
        assert error is not None and error.startswith("CheckpointError"), error
        assert "--decoupled-lr: 0.05 here, 0.02 in the checkpoint" in error, error
        assert "--override-opt_param-scheduler" in error, error
    dropped = [*DECOUPLED_RESUME, "--load", str(first)]
    for error in run_distributed(_main_error, 2, dropped):
        assert error is not None and "Pass --decoupled-lr 0.02 to resume it" in error, error
    for option, expected in [
        ("--override-opt_param-scheduler", 0.05),
        ("--use-checkpoint-opt_param-scheduler", 0.02),
    ]:
        save = tmp_path / option.strip("-")
        run_distributed(pretrain_gpt.main, 2, [*changed, option, "--save", str(save)])
        assert _decoupled_group(save, 6) == (expected, expected, None), option
    # A --decoupled-min-lr equal to the --min-lr the checkpoint's group followed is no change.
    same = [*flags, "--decoupled-min-lr", "1e-3", "--load", str(first)]
    run_distributed(pretrain_gpt.main, 2, [*same, "--save", str(tmp_path / "same")])
    assert _decoupled_group(tmp_path / "same", 6) == (0.02, 0.02, 1e-3)
