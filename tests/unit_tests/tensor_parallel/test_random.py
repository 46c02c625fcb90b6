"""The RNG tracker: `model_parallel_cuda_manual_seed` seeds the default generator and the named
states as Megatron-core does (different model-parallel streams per tp rank, the same default
stream), `fork` swaps a state in and out, states can be saved and restored, the training
initialisation seeds it, and activation recompute replays forked dropout when checkpointed with
`rng_tracker_replay_contexts` (which plain `torch.utils.checkpoint` does not do)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import (
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    model_parallel_cuda_manual_seed,
    rng_tracker_device_type,
    rng_tracker_replay_contexts,
)
from megatron.training.initialize import destroy_megatron, initialize_megatron
from tests.unit_tests.distributed_harness import run_distributed

SEED = 1234


@pytest.fixture(autouse=True)
def _fresh_tracker():
    state = torch.get_rng_state()
    yield
    get_cuda_rng_tracker().reset()
    torch.set_rng_state(state)


def _stream(seed: int, n: int = 6) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def _draws(tp_rank: int, ep_rank: int) -> dict[str, torch.Tensor]:
    model_parallel_cuda_manual_seed(SEED, tp_rank=tp_rank, ep_rank=ep_rank, device_type="cpu")
    tracker = get_cuda_rng_tracker()
    draws = {"default_before": torch.rand(3)}
    with tracker.fork():
        draws["model_parallel"] = torch.rand(6)
    draws["default_after"] = torch.rand(3)
    with tracker.fork(get_expert_parallel_rng_tracker_name()):
        draws["expert"] = torch.rand(6)
    with tracker.fork(get_data_parallel_rng_tracker_name()):
        draws["data_parallel"] = torch.rand(6)
    return draws


def test_seeding_gives_each_state_its_upstream_seed():
    draws = _draws(tp_rank=1, ep_rank=2)
    # Forking leaves the default stream where it was: the two default draws are consecutive.
    torch.testing.assert_close(
        torch.cat([draws["default_before"], draws["default_after"]]), _stream(SEED)
    )
    torch.testing.assert_close(draws["model_parallel"], _stream(SEED + 2718 + 1))
    torch.testing.assert_close(draws["expert"], _stream(SEED + 1024 + 100 * 2))
    torch.testing.assert_close(draws["data_parallel"], _stream(SEED))


def test_tracker_reports_the_seed_of_each_state():
    """What a checkpoint loaded at another layout matches saved states by."""
    model_parallel_cuda_manual_seed(SEED, tp_rank=1, ep_rank=2, etp_rank=1, device_type="cpu")
    tracker = get_cuda_rng_tracker()
    assert tracker.get_seeds() == {
        get_data_parallel_rng_tracker_name(): SEED,
        "model-parallel-rng": SEED + 2718 + 1,
        get_expert_parallel_rng_tracker_name(): SEED + 1024 + 100 * 2 + 1,
    }
    tracker.reset()
    assert tracker.get_seeds() == {}


def test_tp_ranks_share_the_default_stream_but_not_the_model_parallel_one():
    rank0, rank1 = _draws(tp_rank=0, ep_rank=0), _draws(tp_rank=1, ep_rank=0)
    torch.testing.assert_close(rank0["default_before"], rank1["default_before"])
    torch.testing.assert_close(rank0["expert"], rank1["expert"])
    assert not torch.equal(rank0["model_parallel"], rank1["model_parallel"])


def test_fork_continues_its_stream_and_states_restore():
    model_parallel_cuda_manual_seed(SEED, tp_rank=0, ep_rank=0, device_type="cpu")
    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        first = torch.rand(3)
    saved = tracker.get_states()
    with tracker.fork():
        second = torch.rand(3)
    torch.testing.assert_close(torch.cat([first, second]), _stream(SEED + 2718))
    tracker.set_states(saved)
    with tracker.fork():
        torch.testing.assert_close(torch.rand(3), second)

    with pytest.raises(ValueError, match="already tracked"):
        tracker.add("another", SEED)
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        with tracker.fork("unknown"):
            pass


def _forked_dropout(x: torch.Tensor) -> torch.Tensor:
    with get_cuda_rng_tracker().fork():
        return F.dropout(x, p=0.5, training=True)


def _train_step(**checkpoint_kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output, input gradient and the next model-parallel draw of one step from the seed."""
    model_parallel_cuda_manual_seed(SEED, tp_rank=0, ep_rank=0, device_type="cpu")
    x = torch.linspace(0.5, 1.5, 512).requires_grad_()
    if checkpoint_kwargs:
        y = checkpoint(_forked_dropout, x, use_reentrant=False, **checkpoint_kwargs)
    else:
        y = _forked_dropout(x)
    loss = (y * y).sum()
    loss.backward(retain_graph=True)
    loss.backward()  # recomputes again: the recompute context is entered once more
    with get_cuda_rng_tracker().fork():
        after = torch.rand(4)
    return y.detach(), x.grad, after


def test_recompute_replays_the_tracker_with_the_replay_contexts():
    expected_y, expected_grad, expected_after = _train_step()
    y, grad, after = _train_step(context_fn=rng_tracker_replay_contexts)
    torch.testing.assert_close(y, expected_y, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    torch.testing.assert_close(after, expected_after, rtol=0, atol=0)


def test_upstreams_tensor_parallel_checkpoint_replays_the_tracker():
    """`tensor_parallel.checkpoint(fn, distribute_saved_activations, *args)`, upstream's name."""
    expected_y, expected_grad, expected_after = _train_step()
    model_parallel_cuda_manual_seed(SEED, tp_rank=0, ep_rank=0, device_type="cpu")
    x = torch.linspace(0.5, 1.5, 512).requires_grad_()
    y = tensor_parallel.checkpoint(_forked_dropout, False, x)
    (y * y).sum().mul(2).backward()  # as `_train_step`'s two backward passes
    torch.testing.assert_close(y.detach(), expected_y, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, expected_grad, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"distribute_saved_activations=True\) is not built"):
        tensor_parallel.checkpoint(_forked_dropout, True, x)


def test_plain_checkpoint_does_not_replay_the_tracker():
    """Why the replay contexts exist: torch restores the default generator only, so the
    recomputation draws a new mask and advances the tracker a second time."""
    expected_y, expected_grad, expected_after = _train_step()
    y, grad, after = _train_step(preserve_rng_state=True)
    torch.testing.assert_close(y, expected_y, rtol=0, atol=0)
    assert not torch.equal(grad, expected_grad)
    assert not torch.equal(after, expected_after)


FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --train-iters 4 --lr 1e-2 --mock-data --vocab-size 64 --seed 77"
).split()


def _initialized_draws() -> tuple[torch.Tensor, torch.Tensor, int]:
    backend = ["--distributed-backend", dist.get_backend()]
    initialize_megatron(argv=[*FLAGS, "--tensor-model-parallel-size", "2", *backend])
    try:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        default = torch.rand(4)
        with get_cuda_rng_tracker().fork():
            model_parallel = torch.rand(4)
        return default, model_parallel, tp_rank
    finally:
        destroy_megatron(destroy_default_group=False)


def test_initialize_megatron_seeds_the_tracker():
    """On gloo ranks the tracker holds CPU generator states, GPUs present or not (where the
    tracker followed CUDA's availability, its forks left CPU dropout unchanged on GPU
    machines)."""
    results = run_distributed(_initialized_draws, 2)
    assert [tp_rank for _, _, tp_rank in results] == [0, 1]  # one TP group of both ranks
    for default, model_parallel, tp_rank in results:
        torch.testing.assert_close(default, _stream(77, 4))
        torch.testing.assert_close(model_parallel, _stream(77 + 2718 + tp_rank, 4))


def test_device_type_must_be_one_the_process_has():
    for device_type in ("tpu", *(() if torch.cuda.is_available() else ("cuda",))):
        with pytest.raises(ValueError, match=f"device_type='{device_type}'"):
            model_parallel_cuda_manual_seed(SEED, device_type=device_type)
    model_parallel_cuda_manual_seed(SEED, device_type="cpu")
    assert rng_tracker_device_type() == "cpu"
