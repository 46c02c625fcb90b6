"""The pipeline groups of `parallel_state`'s layout: stages are the slowest dimension (pure)."""

from __future__ import annotations

from megatron.core.rank_layout import rank_groups


def _groups(name, layout, aliases):
    return sorted(layout[aliases.get(name, name)])


def test_stages_are_the_slowest_dimension():
    # 8 ranks, TP 2, PP 2: stage 0 holds ranks 0-3, stage 1 ranks 4-7, each with DP 2.
    layout, aliases = rank_groups(8, tp=2, cp=1, ep=1, instances=1, all_gather=False, etp=2, pp=2)
    assert _groups("pp", layout, aliases) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups("tp", layout, aliases) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups("dp", layout, aliases) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _groups("mp", layout, aliases) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _groups("tp_dp_cp", layout, aliases) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Two stages: the embedding group is the pipeline group itself.
    assert aliases["embd"] == "pp"


def test_embedding_group_holds_the_first_and_last_stage():
    layout, aliases = rank_groups(8, tp=1, cp=1, ep=1, instances=1, all_gather=False, etp=1, pp=4)
    assert _groups("pp", layout, aliases) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert _groups("embd", layout, aliases) == [[0, 6], [1, 7]]
    assert _groups("dp_cp", layout, aliases) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups("intra_dist_opt", layout, aliases) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_one_stage_keeps_the_layout():
    with_pp = rank_groups(8, tp=2, cp=2, ep=2, instances=2, all_gather=True, etp=1, pp=1)
    assert with_pp == rank_groups(8, tp=2, cp=2, ep=2, instances=2, all_gather=True, etp=1)
