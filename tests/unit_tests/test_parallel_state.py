"""parallel_state lays groups out as documented, builds real communicators and rejects bad input."""

import re

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.rank_layout import rank_groups
from tests.unit_tests.distributed_harness import current_device, run_distributed

TP, CP, EP, ETP, R, AG = (
    "tensor_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "num_distributed_optimizer_instances",
    "create_all_gather_group",
)

LAYOUTS = [
    pytest.param(4, {}, id="w4-dense"),
    pytest.param(4, {CP: 2, AG: True}, id="w4-cp2-ag"),
    pytest.param(4, {CP: 4, EP: 2}, id="w4-cp4-ep2"),
    pytest.param(4, {EP: 4, AG: True}, id="w4-ep4-ag"),
    pytest.param(4, {R: 2, AG: True}, id="w4-hsdp2-ag"),
    pytest.param(4, {CP: 2, EP: 2, R: 2, AG: True}, id="w4-cp2-ep2-hsdp2-ag"),
    pytest.param(4, {CP: 2, R: 4}, id="w4-cp2-hsdp4"),
    pytest.param(2, {CP: 2, EP: 2, AG: True}, id="w2-cp2-ep2-ag"),
    pytest.param(2, {R: 2, AG: True}, id="w2-hsdp2-ag"),
    pytest.param(4, {TP: 2, EP: 2, ETP: 1, R: 2, AG: True}, id="w4-tp2-ep2-etp1-hsdp2-ag"),
    pytest.param(4, {TP: 2, CP: 2}, id="w4-tp2-cp2"),
    pytest.param(4, {TP: 4, EP: 4, ETP: 1, AG: True}, id="w4-tp4-ep4-etp1-ag"),
    pytest.param(2, {TP: 2}, id="w2-tp2"),
    # Expert tensor parallelism: etp defaults to tp; etp-ep-dp order.
    pytest.param(4, {TP: 2, EP: 2, AG: True}, id="w4-tp2-ep2-etp2-ag"),
    pytest.param(4, {ETP: 2, R: 2, AG: True}, id="w4-etp2-hsdp2-ag"),
    pytest.param(4, {TP: 2, CP: 2, ETP: 1, EP: 2}, id="w4-tp2-cp2-ep2-etp1"),
]


def _expected_members(name: str, rank: int, world_size: int, config: dict) -> list[int]:
    """The documented layout, stated as 'ranks that share a coordinate with `rank`'.

    Dense rank r = t + tp * (c + cp * d) (tp-cp-dp order); expert rank
    r = t_e + etp * (e + ep * d_e) (etp-ep-dp order; etp defaults to tp).
    """
    tp, cp, ep = config.get(TP, 1), config.get(CP, 1), config.get(EP, 1)
    etp = config.get(ETP, tp)
    experts = etp * ep
    instance_size = world_size // config.get(R, 1)
    key = {
        "dp": lambda r: (r % tp, r // tp % cp),
        "dp_cp": lambda r: r % tp,
        "intra_dp_cp": lambda r: (r % tp, r // instance_size),
        "dp_cp_ag": lambda r: (r % tp, r // instance_size),
        "inter_dist_opt": lambda r: r % instance_size,
        "intra_dist_opt": lambda r: r // instance_size,
        "cp": lambda r: (r % tp, r // (tp * cp)),
        "tp": lambda r: r // tp,
        "mp": lambda r: r // tp,
        "tp_cp": lambda r: r // (tp * cp),
        "tp_dp": lambda r: r // tp % cp,
        "tp_dp_cp": lambda r: 0,
        "pp": lambda r: r,
        "embd": lambda r: r,
        "expt_tp": lambda r: r // etp,
        "ep": lambda r: (r % etp, r // experts),
        "tp_ep": lambda r: r // experts,
        "expt_dp": lambda r: r % experts,
        "intra_expt_dp": lambda r: (r % experts, r // instance_size),
        "expt_dp_ag": lambda r: (r % experts, r // instance_size),
    }[name]
    return [other for other in range(world_size) if key(other) == key(rank)]


def _groups_by_name() -> dict[str, dist.ProcessGroup]:
    groups = {
        "dp": ps.get_data_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "intra_dp_cp": ps.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True
        ),
        "inter_dist_opt": ps.get_inter_distributed_optimizer_instance_group(),
        "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group(),
        "cp": ps.get_context_parallel_group(),
        "tp": ps.get_tensor_model_parallel_group(),
        "mp": ps.get_model_parallel_group(),
        "tp_cp": ps.get_tensor_and_context_parallel_group(),
        "tp_dp": ps.get_tensor_and_data_parallel_group(),
        "tp_dp_cp": ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        "pp": ps.get_pipeline_model_parallel_group(),
        "embd": ps.get_embedding_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "expt_tp": ps.get_expert_tensor_parallel_group(),
        "tp_ep": ps.get_expert_tensor_and_model_parallel_group(),
        "expt_dp": ps.get_expert_data_parallel_group(),
        "intra_expt_dp": ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
    }
    if ps.has_separate_all_gather_group():
        groups["dp_cp_ag"] = ps.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True, independent_all_gather=True
        )
        groups["expt_dp_ag"] = ps.get_expert_data_parallel_group(
            partial_expert_data_parallel=True, independent_all_gather=True
        )
    return groups


_ALL_GATHER_PAIRS = [
    ("dp_cp_ag", "dp_cp"),
    ("dp_cp_ag", "intra_dp_cp"),
    ("expt_dp_ag", "expt_dp"),
    ("expt_dp_ag", "intra_expt_dp"),
]


def _describe_groups(config: dict) -> dict:
    ps.initialize_model_parallel(**config)
    groups = _groups_by_name()
    sums = {}
    # Every rank walks the names in the same order, so each group's members meet in each call.
    for name, group in groups.items():
        value = torch.tensor([float(dist.get_rank())], device=current_device())
        dist.all_reduce(value, group=group)
        sums[name] = int(value.item())
    return {
        "recorded": {name: ps.get_group_ranks(name) for name in groups},
        "actual": {name: dist.get_process_group_ranks(group) for name, group in groups.items()},
        "sums": sums,
        "size_and_rank": {
            "dp": (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()),
            "dp_cp": (
                ps.get_data_parallel_world_size(with_context_parallel=True),
                ps.get_data_parallel_rank(with_context_parallel=True),
            ),
            "intra_dp_cp": (
                ps.get_data_parallel_world_size(True, partial_data_parallel=True),
                ps.get_data_parallel_rank(True, partial_data_parallel=True),
            ),
            "cp": (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()),
            "tp": (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()),
            "tp_cp": (
                ps.get_tensor_and_context_parallel_world_size(),
                ps.get_tensor_and_context_parallel_rank(),
            ),
            "tp_dp_cp": (ps.get_tensor_and_data_parallel_world_size(True), dist.get_rank()),
            "expt_tp": (
                ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_rank(),
            ),
            "tp_ep": (
                ps.get_expert_tensor_and_model_parallel_world_size(),
                ps.get_expert_tensor_and_model_parallel_rank(),
            ),
            "pp": (
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_rank(),
            ),
            "ep": (
                ps.get_expert_model_parallel_world_size(),
                ps.get_expert_model_parallel_rank(),
            ),
            "expt_dp": (
                ps.get_expert_data_parallel_world_size(),
                ps.get_expert_data_parallel_rank(),
            ),
            "intra_expt_dp": (
                ps.get_expert_data_parallel_world_size(partial_expert_data_parallel=True),
                ps.get_expert_data_parallel_rank(partial_expert_data_parallel=True),
            ),
        },
        "has_separate_all_gather_group": ps.has_separate_all_gather_group(),
        "intra_is_dp_cp": groups["intra_dp_cp"] is groups["dp_cp"],
        "intra_expt_is_expt_dp": groups["intra_expt_dp"] is groups["expt_dp"],
        "ag_differs_from_shard_groups": [
            groups[ag] is not groups[other] for ag, other in _ALL_GATHER_PAIRS if ag in groups
        ],
        "tp_src_rank": ps.get_tensor_model_parallel_src_rank(),
    }


@pytest.mark.parametrize("world_size, config", LAYOUTS)
def test_groups_follow_documented_layout(world_size, config):
    results = run_distributed(_describe_groups, world_size, config)

    names = set(results[0]["recorded"])
    all_gather = config.get(AG, False)
    assert names == set(ps.GROUP_NAMES) - (set() if all_gather else {"dp_cp_ag", "expt_dp_ag"})
    for name in names:
        # Every rank agrees on the partition: members of a group all report that same group,
        # and each rank lies in exactly one group.
        for rank, result in enumerate(results):
            members = result["recorded"][name]
            assert rank in members
            assert all(results[other]["recorded"][name] == members for other in members), name
        distinct = {tuple(result["recorded"][name]) for result in results}
        assert sorted(r for group in distinct for r in group) == list(range(world_size)), name

    for rank, result in enumerate(results):
        for name in names:
            expected = _expected_members(name, rank, world_size, config)
            assert result["recorded"][name] == expected, (rank, name)
            assert result["actual"][name] == expected, (rank, name)
            assert result["sums"][name] == sum(expected), (rank, name)
        for name, size_and_rank in result["size_and_rank"].items():
            expected = _expected_members(name, rank, world_size, config)
            assert size_and_rank == (len(expected), expected.index(rank)), (rank, name)
        assert result["tp_src_rank"] == result["recorded"]["tp"][0]
        # FSDP shards never hold two tensor-parallel peers: their tp shards differ.
        assert not set(result["recorded"]["intra_dp_cp"]) & set(result["recorded"]["tp"]) - {rank}
        assert result["has_separate_all_gather_group"] == all_gather
        # Same ranks as the shard group (checked above), but a communicator of its own.
        assert result["ag_differs_from_shard_groups"] == [True] * 4 * all_gather
        hybrid = config.get(R, 1) > 1
        assert result["intra_is_dp_cp"] == (not hybrid)
        assert result["intra_expt_is_expt_dp"] == (not hybrid)


def test_docstring_example_layout():
    """The module docstring's table, read from the docstring itself."""
    layout, aliases = rank_groups(8, tp=2, cp=2, ep=2, instances=2, all_gather=True, etp=1)
    table = ps.__doc__.split("each rank is in exactly one group of each name)\n")[1]
    rows = {}
    for line in table.split("\n\n")[0].splitlines():
        names, groups = re.match(r"\s+([a-z_, ]+?)\s+(\[.*)", line).groups()
        for name in names.split(", "):
            rows[name] = groups
    assert set(rows) == set(ps.GROUP_NAMES) - {"dp_cp_ag", "expt_dp_ag"}

    def parsed(row: str) -> list[list[int]]:
        if row == "[0..7]":
            return [list(range(8))]
        if row == "[0] [1] ... [7]":
            return [[r] for r in range(8)]
        return [[int(r) for r in g.split(",")] for g in re.findall(r"\[([\d,]+)\]", row)]

    for name, row in rows.items():
        assert sorted(parsed(row)) == sorted(layout[aliases.get(name, name)]), name
    assert layout["intra_dp_cp"] == layout["dp_cp_ag"]
    assert layout["intra_expt_dp"] == layout["expt_dp_ag"]
    assert aliases["mp"] == "tp" and aliases["embd"] == "pp"


BAD_SIZES = [
    ({TP: 3}, "tensor_model_parallel_size=3", "world size 4"),
    ({TP: 2, CP: 4}, "context_parallel_size=4 = 8", "world size 4"),
    # dp x cp is 4 / 2 = 2 ranks: 4 instances cannot cut it.
    ({TP: 2, R: 4}, "num_distributed_optimizer_instances=4", "data x context parallel size 2"),
    ({"pipeline_model_parallel_size": 3}, "pipeline_model_parallel_size=3", "world size 4"),
    ({ETP: 3}, "expert_tensor_parallel_size=3", "world size 4"),
    ({ETP: 2, EP: 4}, "expert_tensor_parallel_size x expert_model_parallel_size=8", "(2 x 4)"),
    # etp defaults to tp: 2 x 2 experts ranks leave an expert data-parallel size of 1.
    ({TP: 2, EP: 2, R: 2}, "num_distributed_optimizer_instances=2", "expert data-parallel size 1"),
    ({CP: 3}, "context_parallel_size=3", "world size 4"),
    ({EP: 3}, "expert_model_parallel_size=3", "world size 4"),
    ({R: 3}, "num_distributed_optimizer_instances=3", "world size 4"),
    # The expert data-parallel group (4 / 4 = 1 rank) cannot be cut into 2 instances.
    ({EP: 4, R: 2}, "num_distributed_optimizer_instances=2", "expert data-parallel size 1"),
]


def _try_bad_sizes() -> list[tuple[str, str, bool]]:
    outcomes = []
    for kwargs, _, _ in BAD_SIZES:
        try:
            ps.initialize_model_parallel(**kwargs)
            outcomes.append(("no error", "", ps.model_parallel_is_initialized()))
            ps.destroy_model_parallel()
        except Exception as error:  # noqa: BLE001 - the test checks the type
            outcomes.append((type(error).__name__, str(error), ps.model_parallel_is_initialized()))
    # Nothing half-built is left behind: a valid call still works.
    ps.initialize_model_parallel(context_parallel_size=2)
    outcomes.append(("valid", "", ps.get_context_parallel_world_size() == 2))
    return outcomes


def test_bad_sizes_raise_value_error_naming_the_argument():
    outcomes = run_distributed(_try_bad_sizes, 4)[0]
    for (kwargs, argument, detail), (kind, message, initialized) in zip(BAD_SIZES, outcomes):
        assert kind == "ValueError", (kwargs, kind, message)
        assert argument in message and detail in message, message
        assert not initialized, kwargs
    assert outcomes[-1] == ("valid", "", True)


def _lifecycle() -> None:
    getters = [
        ps.get_data_parallel_group,
        ps.get_data_parallel_world_size,
        ps.get_context_parallel_rank,
        ps.get_tensor_model_parallel_world_size,
        ps.get_expert_data_parallel_group,
        ps.get_inter_distributed_optimizer_instance_group,
        lambda: ps.get_group_ranks("dp"),
    ]
    assert not ps.model_parallel_is_initialized()
    assert not ps.has_separate_all_gather_group()
    ps.destroy_model_parallel()  # nothing to destroy: a no-op
    for getter in getters:
        with pytest.raises(RuntimeError, match="initialize_model_parallel"):
            getter()
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    assert ps.get_expert_data_parallel_group(check_initialized=False) is None

    ps.initialize_model_parallel(create_all_gather_group=True)
    assert ps.model_parallel_is_initialized()
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    with pytest.raises(RuntimeError, match="destroy_model_parallel"):
        ps.initialize_model_parallel()
    assert ps.get_data_parallel_group(with_context_parallel=True) is dp_cp
    created = {name: ps.get_group_ranks(name) for name in ps.GROUP_NAMES}
    assert len(created) == len(ps.GROUP_NAMES)
    old_groups = [ps.get_data_parallel_group(), dp_cp, ps.get_context_parallel_group()]

    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    assert not ps.has_separate_all_gather_group()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_data_parallel_group()
    for group in old_groups:  # torch no longer knows the destroyed groups
        with pytest.raises((KeyError, ValueError, RuntimeError)):
            dist.get_process_group_ranks(group)
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(context_parallel_size=2)
    assert ps.get_context_parallel_world_size() == 2
    assert ps.get_data_parallel_world_size() == 1
    value = torch.ones(1, device=current_device())
    dist.all_reduce(value, group=ps.get_context_parallel_group())
    assert value.item() == 2


def test_lifecycle_init_destroy_reinit():
    run_distributed(_lifecycle, 2)


def _getter_argument_errors() -> None:
    ps.initialize_model_parallel()
    with pytest.raises(ValueError, match="with_context_parallel"):
        ps.get_data_parallel_group(partial_data_parallel=True)
    with pytest.raises(ValueError, match="with_context_parallel"):
        ps.get_data_parallel_group(independent_all_gather=True)
    with pytest.raises(RuntimeError, match="create_all_gather_group=True"):
        ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
    with pytest.raises(RuntimeError, match="create_all_gather_group=True"):
        ps.get_expert_data_parallel_group(independent_all_gather=True)
    with pytest.raises(ValueError, match="create_all_gather_group"):
        ps.get_group_ranks("dp_cp_ag")
    with pytest.raises(ValueError, match="'nonsense'"):
        ps.get_group_ranks("nonsense")
    ps.destroy_model_parallel()

    # With R > 1 the all-gather group mirrors the intra group, so asking for the twin of the
    # full dp_cp / expt_dp group is refused rather than answered with different ranks.
    ps.initialize_model_parallel(
        num_distributed_optimizer_instances=2, create_all_gather_group=True
    )
    with pytest.raises(ValueError, match="partial_data_parallel=True"):
        ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
    with pytest.raises(ValueError, match="partial_expert_data_parallel=True"):
        ps.get_expert_data_parallel_group(independent_all_gather=True)


def test_getter_argument_errors():
    run_distributed(_getter_argument_errors, 2)
