"""`initialize_megatron`: script defaults for flags, reuse of an existing process group,
`parallel_state` set up and torn down per job."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training import global_vars
from megatron.training.arguments import parse_args
from megatron.training.initialize import _with_defaults, destroy_megatron, initialize_megatron
from tests.unit_tests.distributed_harness import run_distributed

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --train-iters 4 --lr 1e-2 --mock-data --vocab-size 64"
).split()


def test_args_defaults_are_defaults_the_command_line_overrides():
    provider = _with_defaults(None, {"lr_decay_style": "cosine", "micro_batch_size": 8})
    args = parse_args(provider, args=["--num-layers", "2"])
    assert (args.lr_decay_style, args.micro_batch_size) == ("cosine", 8)
    assert parse_args(provider, args=FLAGS).micro_batch_size == 2


def test_args_defaults_must_name_flags():
    with pytest.raises(ValueError, match=r"args_defaults names \['micro_batch'\]"):
        parse_args(_with_defaults(None, {"micro_batch": 8}), args=FLAGS)


def test_get_args_before_initialize_raises():
    global_vars.set_args(None)
    with pytest.raises(RuntimeError, match="initialize_megatron"):
        global_vars.get_args()


def _initialize_twice(flags: list[str]) -> dict:
    """Two jobs in a row on the harness's default group, then a wrong backend."""
    world_sizes = []
    for instances in ("1", "2"):  # the second job shards over half the ranks
        fsdp = ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", instances]
        args = initialize_megatron(
            argv=[*flags, *fsdp, "--distributed-backend", dist.get_backend()]
        )
        shard_size = parallel_state.get_data_parallel_world_size(True, partial_data_parallel=True)
        world_sizes.append((args.world_size, shard_size))
        destroy_megatron(destroy_default_group=False)
    wrong = "gloo" if dist.get_backend() == "nccl" else "nccl"
    try:
        initialize_megatron(argv=[*flags, "--distributed-backend", wrong])
        error = None
    except ValueError as caught:
        error = str(caught)
    return dict(
        world_sizes=world_sizes,
        still_initialized=dist.is_initialized(),
        parallel_state_left=parallel_state.model_parallel_is_initialized(),
        error=error,
    )


def test_initialize_reuses_the_default_group_and_resets_parallel_state():
    for result in run_distributed(_initialize_twice, 2, FLAGS):
        assert result["world_sizes"] == [(2, 2), (2, 1)]
        assert result["still_initialized"] and not result["parallel_state_left"]
        # validate_args refuses nccl without CUDA first; with CUDA the reuse check does.
        assert "--distributed-backend" in result["error"]
