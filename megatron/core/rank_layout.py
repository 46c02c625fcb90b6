"""The rank layout of `parallel_state`'s process groups: which global ranks form each group.

Pure functions of the parallel sizes (no torch.distributed), so the layout can be checked for any
world size without starting ranks. `megatron.core.parallel_state` creates communicators over the
groups `rank_groups()` returns; its module docstring shows the layout with an example.

Ranks follow Megatron-LM's orders: tp-cp-ep-dp-pp for the dense part (tp fastest; ep is 1 there)
and etp-ep-dp-pp for the experts. A group over some dimensions is the
set of ranks that share every other coordinate; its ranks are listed in increasing order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Partition = list[list[int]]
"""Every group of one name: each rank lies in exactly one of them."""

DERIVED_GROUPS = ("mp", "tp_cp", "tp_dp", "tp_dp_cp", "embd", "expt_tp", "tp_ep", "intra_dist_opt")
"""Groups that often coincide with another group (e.g. `mp` is `tp` without pipeline
parallelism); `rank_groups()` reports such a coincidence as an alias, so that no second
communicator is created over the same ranks."""


def _contiguous(ranks: list[int], size: int) -> Partition:
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


def _strided(ranks: list[int], stride: int) -> Partition:
    return [ranks[i::stride] for i in range(stride)]


def _shards(groups: Partition, instances: int) -> Partition:
    """Each group cut into `instances` contiguous chunks (the intra groups)."""
    return [chunk for g in groups for chunk in _contiguous(g, len(g) // instances)]


def _replicas(groups: Partition, instances: int) -> Partition:
    """The ranks at the same position of each chunk (the inter groups)."""
    return [same for g in groups for same in _strided(g, len(g) // instances)]


def orthogonal_groups(order: Sequence[tuple[str, int]], dims: Sequence[str]) -> Partition:
    """The groups over `dims` of a grid of ranks laid out in `order` (first dimension fastest).

    Args:
        order: (dimension name, size) pairs; the world size is the product of the sizes.
        dims: the dimensions a group spans; ranks that share every other coordinate form one
            group.

    Returns:
        The groups, ordered by their smallest rank, each in increasing rank order.
    """
    world_size = math.prod(size for _, size in order)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        key, rest = [], rank
        for name, size in order:
            rest, coordinate = divmod(rest, size)
            if name not in dims:
                key.append(coordinate)
        groups.setdefault(tuple(key), []).append(rank)
    return list(groups.values())


def rank_groups(
    world_size: int,
    tp: int,
    cp: int,
    ep: int,
    instances: int,
    all_gather: bool,
    etp: int,
    pp: int = 1,
) -> tuple[dict[str, Partition], dict[str, str]]:
    """Every group of each name, in creation order, and the names that alias another name.

    Args:
        world_size: number of ranks; a multiple of tp x cp and of etp x ep.
        tp: tensor-parallel size.
        cp: context-parallel size.
        ep: expert-model-parallel size.
        instances: distributed optimizer instances R (HSDP outer replicas); divides the
            dp x cp size (world / tp) and the expert data-parallel size (world / (etp x ep)).
        all_gather: also lay out the `*_ag` all-gather groups.
        etp: expert tensor-parallel size.
        pp: pipeline-parallel size (the slowest dimension: stage s holds ranks
            s * W/pp .. (s+1) * W/pp - 1).

    Returns:
        (layout, aliases): `layout` maps each name with its own communicators to its partition;
        `aliases` maps each other name to the layout name whose groups it shares.
    """
    stage = world_size // pp
    dense = (("tp", tp), ("cp", cp), ("dp", stage // (tp * cp)), ("pp", pp))
    expert = (("etp", etp), ("ep", ep), ("edp", stage // (etp * ep)), ("pp", pp))
    ranks = list(range(world_size))
    layout = {
        "dp_cp": orthogonal_groups(dense, ("cp", "dp")),
        "dp": orthogonal_groups(dense, ("dp",)),
        "cp": orthogonal_groups(dense, ("cp",)),
        "tp": orthogonal_groups(dense, ("tp",)),
        "pp": orthogonal_groups(dense, ("pp",)),
        "ep": orthogonal_groups(expert, ("ep",)),
        "expt_dp": orthogonal_groups(expert, ("edp",)),
    }
    layout["inter_dist_opt"] = _replicas(layout["dp_cp"], instances)
    # Splitting the expert groups yields the same inter groups (ranks r, r + W/R, ...), so
    # experts share inter_dist_opt, as in Megatron-LM.
    assert sorted(_replicas(layout["expt_dp"], instances)) == sorted(layout["inter_dist_opt"])
    aliases = {}
    for base in ("dp_cp", "expt_dp"):
        if instances > 1:
            layout[f"intra_{base}"] = _shards(layout[base], instances)
        else:
            aliases[f"intra_{base}"] = base
    derived = {
        # The model-parallel group is tensor x pipeline (the tensor-parallel one with one
        # stage); the embedding group holds the first and last stage of each pipeline (each
        # rank alone with one stage).
        "mp": orthogonal_groups(dense, ("tp", "pp")),
        "tp_cp": orthogonal_groups(dense, ("tp", "cp")),
        "tp_dp": orthogonal_groups(dense, ("tp", "dp")),
        "tp_dp_cp": orthogonal_groups(dense, ("tp", "cp", "dp")),
        "embd": [sorted({g[0], g[-1]}) for g in layout["pp"]],
        "expt_tp": orthogonal_groups(expert, ("etp",)),
        "tp_ep": orthogonal_groups(expert, ("etp", "ep")),
        # An optimizer instance: the contiguous ranks of the tp x ep groups of one chunk of the
        # expert data-parallel group (Megatron-LM's definition), tp peers included, in one
        # pipeline stage.
        "intra_dist_opt": _contiguous(ranks, stage // instances),
    }
    for name in DERIVED_GROUPS:
        partition = derived[name]
        same = [known for known, groups in layout.items() if sorted(groups) == sorted(partition)]
        if same:
            aliases[name] = same[0]
        else:
            layout[name] = partition
    if all_gather:
        for base in ("dp_cp", "expt_dp"):
            layout[f"{base}_ag"] = layout[f"intra_{base}" if instances > 1 else base]
    return layout, aliases
