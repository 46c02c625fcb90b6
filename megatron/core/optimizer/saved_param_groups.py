"""Whether a checkpoint's optimizer parameter groups fit an optimizer, before anything loads:
the same parameters in the same groups (`--decoupled-lr` makes groups of its own), and the
same kind of optimizer. `MegatronOptimizer.check_param_groups` asks here.

A checkpoint's groups are the whole model's; under pipeline parallelism a stage's optimizer
steps part of the model, and `stage_param_groups` gives the part of the groups it loads."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from megatron.core.optimizer_param_scheduler import GROUP_BOUND_FLAGS

IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""Parameter-group entries that say how this process steps, not what: kept on loading."""

_FRESH = "or pass --no-load-optim to load the weights with a fresh optimizer and schedule"


def loadable_param_groups(
    optimizer: torch.optim.Optimizer,
    name_of: Callable[[torch.Tensor], str],
    held: list[torch.Tensor],
    saved_groups: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The saved groups as `optimizer.load_state_dict()` takes them.

    Args:
        optimizer: the torch optimizer the groups load into.
        name_of: the parameter name of each tensor `optimizer` steps.
        held: the tensors `optimizer` steps, in the order the saved states index them.
        saved_groups: the groups a checkpoint saved, their parameters by name.

    Returns:
        Per group: the saved hyperparameters, this optimizer's parameters (by index in
        `held`), implementation switches (`fused`, ...: how this process steps, not what)
        and learning-rate bounds (`max_lr`, `min_lr`: the schedule's, which
        `OptimizerParamScheduler` checks against the checkpoint's and replaces with them
        where told to).

    Raises:
        ValueError: the groups hold other parameters (the word embeddings and output layer
            in groups of their own in one only: --decoupled-lr), there are more or fewer of
            them, or they are another kind of optimizer's (other hyperparameters).
    """
    check_decoupled_groups(optimizer.param_groups, saved_groups)
    index = {name_of(tensor): i for i, tensor in enumerate(held)}
    ignored = {"params", *IMPLEMENTATION_KEYS}
    bounds = GROUP_BOUND_FLAGS.keys()
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        current = [name_of(p) for p in group["params"]]
        saved = set(saved_groups[i]["params"]) if i < len(saved_groups) else set()
        if saved != set(current):
            differ = sorted(saved.symmetric_difference(current))
            raise ValueError(
                f"The checkpoint's optimizer has {len(saved_groups)} parameter group(s) "
                f"and this one {len(optimizer.param_groups)}; group {i} holds other "
                f"parameters (in one of them only: {differ[:3]}). Load it into the model "
                "it was saved from, or pass --no-load-optim."
            )
        saved_keys = saved_groups[i].keys() - ignored - bounds
        own_keys = group.keys() - ignored - bounds
        if saved_keys - own_keys and own_keys - saved_keys:
            # Another kind of optimizer (Adam's betas against SGD's momentum): its
            # hyperparameters and states mean nothing to this one.
            raise ValueError(
                f"The checkpoint's optimizer is of another kind: its parameter groups have "
                f"{sorted(saved_keys - own_keys)}, this {type(optimizer).__name__}'s "
                f"{sorted(own_keys - saved_keys)}. Build the optimizer it was saved with "
                "(--optimizer), or pass --no-load-optim."
            )
        # The saved hyperparameters win; keys only this one has (added to torch since the
        # save) keep their values here, as torch's `__setstate__` defaults them. The bounds
        # stay the flags': which schedule resumes is the scheduler's choice.
        hyperparameters = {
            **{k: v for k, v in group.items() if k != "params"},
            **{k: v for k, v in saved_groups[i].items() if k not in ignored | bounds},
        }
        groups.append({**hyperparameters, "params": [index[name] for name in current]})
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
            f"{len(groups)}: load it into the model it was saved from, or pass "
            "--no-load-optim."
        )
    return groups


def stage_param_groups(
    optimizer: torch.optim.Optimizer,
    name_of: Callable[[torch.Tensor], str],
    saved_groups: list[dict[str, Any]],
    elsewhere: Collection[str],
) -> list[dict[str, Any]]:
    """The saved groups of the whole model as this stage's optimizer holds them: less the
    parameters that only other pipeline stages hold (`elsewhere`), less the groups left empty,
    in the order of `optimizer`'s groups (each where the first parameter of one of them is; the
    others after them). With one stage (`elsewhere` empty) and the same model, they are the
    saved groups themselves.

    Args:
        optimizer: this stage's torch optimizer.
        name_of: the parameter name of each tensor `optimizer` steps.
        saved_groups: the groups a checkpoint saved, their parameters by name.
        elsewhere: names of the parameters of the whole model this stage does not hold.
    """
    projected = [
        {**group, "params": [name for name in group["params"] if name not in elsewhere]}
        for group in saved_groups
    ]
    projected = [group for group in projected if group["params"]]
    first_names = [
        name_of(group["params"][0]) for group in optimizer.param_groups if group["params"]
    ]

    def position(group: dict[str, Any]) -> int:
        held = set(group["params"])
        return next((i for i, name in enumerate(first_names) if name in held), len(first_names))

    return sorted(projected, key=position)


def check_decoupled_groups(
    own_groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]
) -> None:
    """Raises a ValueError naming --decoupled-lr when it put the word embeddings and output
    layer into groups of their own (groups with a `max_lr`) in the checkpoint or in this
    optimizer, but not in both: the groups then hold other parameters, and only the flag can
    make them fit."""
    saved = next((group for group in saved_groups if "max_lr" in group), None)
    own = next((group for group in own_groups if "max_lr" in group), None)
    if (saved is None) == (own is None):
        return
    if saved is not None:
        flags = f"--decoupled-lr {saved['max_lr']}"
        if "min_lr" in saved:
            flags += f" --decoupled-min-lr {saved['min_lr']}"
        raise ValueError(
            f"The checkpoint was saved with {flags}: its optimizer holds the word embeddings "
            "and output layer in parameter groups of their own, which this run, without "
            f"--decoupled-lr, does not have. Pass {flags} to resume it, {_FRESH}."
        )
    raise ValueError(
        f"This run has --decoupled-lr {own['max_lr']}, but the checkpoint was saved without "
        "it: its optimizer holds the word embeddings and output layer in the groups of the "
        f"other parameters. Drop --decoupled-lr (and --decoupled-min-lr) to resume it, "
        f"{_FRESH}."
    )
