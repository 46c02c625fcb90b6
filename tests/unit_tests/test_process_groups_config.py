"""ProcessGroupCollection holds explicit groups or parallel_state's, and rejects unknown names."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.distributed_harness import run_distributed

FIELDS = [field.name for field in dataclasses.fields(ProcessGroupCollection)]


def _parallel_state_groups() -> dict[str, dist.ProcessGroup | None]:
    """What each field should hold, asked of parallel_state directly."""
    all_gather = ps.has_separate_all_gather_group()
    return {
        "dp": ps.get_data_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "dp_cp_ag": ps.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True, independent_all_gather=True
        )
        if all_gather
        else None,
        "intra_dp_cp": ps.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True
        ),
        "inter_dist_opt": ps.get_inter_distributed_optimizer_instance_group(),
        "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group(),
        "cp": ps.get_context_parallel_group(),
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "mp": ps.get_model_parallel_group(),
        "tp_cp": ps.get_tensor_and_context_parallel_group(),
        "tp_dp_cp": ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        "embd": ps.get_embedding_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "expt_tp": ps.get_expert_tensor_parallel_group(),
        "tp_ep": ps.get_expert_tensor_and_model_parallel_group(),
        "expt_dp": ps.get_expert_data_parallel_group(),
        "expt_dp_ag": ps.get_expert_data_parallel_group(
            partial_expert_data_parallel=True, independent_all_gather=True
        )
        if all_gather
        else None,
        "intra_expt_dp": ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
    }


def _check_use_mpu_process_groups(config: dict) -> dict[str, int | None]:
    ps.initialize_model_parallel(**config)
    expected = _parallel_state_groups()
    assert set(expected) == set(FIELDS)

    collection = ProcessGroupCollection.use_mpu_process_groups()
    for name in FIELDS:
        assert getattr(collection, name) is expected[name], name

    subset = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["dp_cp", "ep"])
    assert subset.dp_cp is expected["dp_cp"] and subset.ep is expected["ep"]
    assert all(getattr(subset, name) is None for name in FIELDS if name not in ("dp_cp", "ep"))

    if not ps.has_separate_all_gather_group():
        # Asked for by name, a missing all-gather group is an error rather than a silent None.
        with pytest.raises(RuntimeError, match="create_all_gather_group=True"):
            ProcessGroupCollection.use_mpu_process_groups(required_pgs=["dp_cp_ag"])
    return {name: None if group is None else group.size() for name, group in expected.items()}


@pytest.mark.parametrize(
    "config, some_sizes",
    [
        pytest.param(
            {},
            {"intra_dp_cp": 4, "inter_dist_opt": 1, "dp_cp_ag": None, "expt_dp_ag": None},
            id="dense",
        ),
        pytest.param(
            {
                "context_parallel_size": 2,
                "expert_model_parallel_size": 2,
                "num_distributed_optimizer_instances": 2,
                "create_all_gather_group": True,
            },
            {"intra_dp_cp": 2, "inter_dist_opt": 2, "dp_cp_ag": 2, "expt_dp_ag": 1},
            id="cp2-ep2-hsdp2-ag",
        ),
        pytest.param(
            {
                "tensor_model_parallel_size": 2,
                "expert_model_parallel_size": 2,
                "expert_tensor_parallel_size": 1,
                "num_distributed_optimizer_instances": 2,
            },
            {"tp": 2, "dp_cp": 2, "intra_dp_cp": 1, "intra_dist_opt": 2, "tp_dp_cp": 4},
            id="tp2-ep2-etp1-hsdp2",
        ),
        pytest.param(
            {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2},
            {"tp": 2, "expt_tp": 2, "ep": 2, "tp_ep": 4, "expt_dp": 1},
            id="tp2-ep2-etp2",
        ),
    ],
)
def test_use_mpu_process_groups_matches_parallel_state(config, some_sizes):
    for sizes in run_distributed(_check_use_mpu_process_groups, 4, config):
        assert {name: sizes[name] for name in some_sizes} == some_sizes


def _check_explicit_construction() -> None:
    world = dist.group.WORLD
    pair = dist.new_group([0, 1])
    collection = ProcessGroupCollection(dp=pair, dp_cp=world)
    assert collection.dp is pair and collection.dp_cp is world
    assert all(getattr(collection, name) is None for name in FIELDS if name not in ("dp", "dp_cp"))
    assert collection == ProcessGroupCollection(dp=pair, dp_cp=world)
    assert collection != ProcessGroupCollection(dp=world, dp_cp=world)
    assert repr(collection) == "ProcessGroupCollection(dp=2, dp_cp=2)"
    # A collective on the pair before tearing it down: gloo's connect can return on one rank
    # before the other has finished its handshake, and destroying the group then closes the
    # socket under it ("Connection closed by peer" on the other rank).
    total = torch.ones(1)
    dist.all_reduce(total, group=collection.dp)
    assert total.item() == 2
    dist.destroy_process_group(pair)


def test_explicit_construction():
    run_distributed(_check_explicit_construction, 2)


def test_fields_default_to_none():
    collection = ProcessGroupCollection()
    required = (
        "dp dp_cp dp_cp_ag intra_dp_cp inter_dist_opt cp ep expt_dp expt_dp_ag tp pp mp tp_cp "
        "tp_dp_cp embd expt_tp tp_ep"
    )
    assert set(FIELDS) >= set(required.split())
    assert all(getattr(collection, name) is None for name in FIELDS)


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match="'dq'"):
        ProcessGroupCollection(dp=None, dq=None)
    with pytest.raises(AttributeError):
        ProcessGroupCollection().dq = None  # a typo on assignment is caught too
    with pytest.raises(ValueError, match="'bogus'"):
        ProcessGroupCollection.use_mpu_process_groups(required_pgs=["dp", "bogus"])


def test_use_mpu_process_groups_needs_initialized_parallel_state():
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ProcessGroupCollection.use_mpu_process_groups()
