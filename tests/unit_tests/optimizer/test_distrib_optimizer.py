"""The distributed optimizer (`use_distributed_optimizer` with the DDP engine) on gloo ranks.

- Training matches the plain DDP engine: bitwise at 2 ranks without clipping (the same sums in
  the same order, the same elementwise AdamW), to rounding otherwise; in fp32 both match
  torch's AdamW in one process on the whole batch, to rounding.
- Each rank holds optimizer state and reduced gradients for its dim-0 chunk of each parameter.
- A checkpoint saved on 4 ranks loads on 2 (and into the plain DDP engine) exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_param_groups
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    VOCAB_SIZE,
    build_tiny_gpt,
    shard_batch,
    tiny_gpt_config,
)
from tests.unit_tests.training.checkpoint_checks import assert_same, whole_tensor

POSITIONS = 3
"""Position-embedding rows: over 4 ranks one rank's chunk is empty, over 2 they are uneven."""
GLOBAL_BATCH = 8
NUM_MICROBATCHES = 2
LR = 1e-2


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB_SIZE, (steps, GLOBAL_BATCH, POSITIONS + 1), generator=generator)
    return [(batch[:, :-1].contiguous(), batch[:, 1:].contiguous()) for batch in data]


def _build(
    distributed: bool,
    *,
    seed: int = 1234,
    bf16: bool = False,
    clip_grad: float = 0.0,
    bucket_size: int | None = None,
    overlap: bool = False,
) -> tuple[DistributedDataParallel, object, OptimizerParamScheduler]:
    """A tiny GPT (untied output layer) under the DDP engine, with or without the distributed
    optimizer, AdamW with weight decay, and a warmup-cosine schedule."""
    model = _fresh_model(dict(bf16=bf16), seed)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed,
        bucket_size=bucket_size,
        overlap_grad_reduce=overlap,
    )
    wrapped = DistributedDataParallel(model.config, ddp_config, model)
    config = OptimizerConfig(lr=LR, weight_decay=0.1, clip_grad=clip_grad)
    optimizer = get_megatron_optimizer(config, wrapped)
    assert isinstance(optimizer, DistributedOptimizer) == distributed
    return wrapped, optimizer, _scheduler(optimizer)


def _scheduler(optimizer) -> OptimizerParamScheduler:
    """Warmup (2 steps) then cosine decay of the learning rate; constant weight decay 0.1."""
    return OptimizerParamScheduler(
        optimizer, 0.0, LR, LR / 10, 2, 10, "cosine", 0.1, 0.1, 10, "constant"
    )


def _train(state: tuple, batches: list) -> list[float]:
    """Megatron's iterations on this rank's microbatches of `batches` (all but the last
    microbatch under no_sync()); the grad norms."""
    model, optimizer, scheduler = state
    rank, world_size = dist.get_rank(), dist.get_world_size()
    norms = []
    for tokens, labels in batches:
        tokens = shard_batch(tokens, rank, world_size).chunk(NUM_MICROBATCHES)
        labels = shard_batch(labels, rank, world_size).chunk(NUM_MICROBATCHES)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model.start_param_sync()
        for i in range(NUM_MICROBATCHES):
            last = i == NUM_MICROBATCHES - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(tokens[i], labels=labels[i]).float().mean() / NUM_MICROBATCHES
                loss.backward()
        model.finish_grad_sync()
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful
        scheduler.step(1)
        norms.append(grad_norm)
    return norms


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _run(distributed: bool, build: dict) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        state = _build(distributed, **build)
        norms = _train(state, _batches(3))
        return dict(weights=_weights(state[0]), norms=norms)
    finally:
        parallel_state.destroy_model_parallel()


PARITY = {
    # 2 ranks, no clipping: the same sums (a + b) and elementwise steps, so bitwise.
    "2-fp32": (2, {}, True),
    "2-fp32-buckets-overlap": (2, dict(bucket_size=2000, overlap=True), True),
    "2-bf16": (2, dict(bf16=True), True),
    # Clipping scales by a norm summed in another order; 4 ranks sum in another order too.
    "2-fp32-clip": (2, dict(clip_grad=0.05), False),
    "4-fp32-clip-buckets": (4, dict(clip_grad=0.05, bucket_size=3000), False),
}


def _reference(build: dict) -> dict:
    """One process, plain PyTorch: the same model, Megatron's weight-decay groups and schedule
    over torch's AdamW, each step on the whole global batch, clipped by `clip_grad_norm_`
    (Megatron's rule: scale by clip / (norm + 1e-6) when that is below 1)."""
    model = _fresh_model(build)
    optimizer = torch.optim.AdamW(get_param_groups(model, 0.1), lr=LR)
    scheduler = _scheduler(optimizer)
    max_norm = build.get("clip_grad") or math.inf
    norms = []
    for tokens, labels in _batches(3):
        optimizer.zero_grad()
        model(tokens.to(current_device()), labels=labels.to(current_device())).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        scheduler.step(1)
    return dict(weights=_weights(model), norms=norms)


@pytest.mark.parametrize("case", PARITY)
def test_matches_the_plain_ddp_engine(case):
    world_size, build, bitwise = PARITY[case]
    sharded = run_distributed(_run, world_size, True, build)
    plain = run_distributed(_run, world_size, False, build)
    if not build.get("bf16"):
        # The data-parallel engines against one process (bf16 rounds per rank and microbatch).
        # AdamW divides each gradient element by its own scale, so summation-order rounding of
        # a near-zero gradient moves its weight by a fraction of an lr-sized step (measured:
        # 1.1e-5 = LR / 900 in one bias element): 1% of a step is allowed.
        reference = _reference(build)
        torch.testing.assert_close(plain[0], reference, atol=LR / 100, rtol=1.3e-6)
    initial = _weights_of_fresh_model(build)
    assert all(not torch.equal(initial[n], w) for n, w in plain[0]["weights"].items()), (
        "some weight never changed"
    )
    if build.get("clip_grad"):
        assert all(norm > build["clip_grad"] for norm in plain[0]["norms"]), "clip never acted"
    for rank in range(world_size):
        # Every rank holds the same, whole parameters after the all-gather.
        for name, expected in plain[0]["weights"].items():
            actual = sharded[rank]["weights"][name]
            if bitwise:
                assert torch.equal(actual, expected), f"rank {rank}: {name} differs"
            else:
                torch.testing.assert_close(actual, expected, msg=f"rank {rank}: {name}")
        torch.testing.assert_close(sharded[rank]["norms"], plain[0]["norms"])


def _fresh_model(build: dict, seed: int = 1234) -> torch.nn.Module:
    """The tiny GPT (untied output layer) every test trains, bf16 where `build` says."""
    dtypes = dict(bf16=True, params_dtype=torch.bfloat16) if build.get("bf16") else {}
    return build_tiny_gpt(
        tiny_gpt_config(**dtypes),
        seed,
        max_sequence_length=POSITIONS,
        share_embeddings_and_output_weights=False,
    )


def _weights_of_fresh_model(build: dict) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in _fresh_model(build).named_parameters()}


def _state_sizes(bf16: bool) -> dict:
    """After one step: this rank's optimizer state, main weights and gradient shard sizes."""
    parallel_state.initialize_model_parallel()
    try:
        model, optimizer, scheduler = _build(True, bf16=bf16, bucket_size=3000)
        _train((model, optimizer, scheduler), _batches(1))
        rank, size = dist.get_rank(), dist.get_world_size()
        held = {id(t): t for g in optimizer.optimizer.param_groups for t in g["params"]}
        state = optimizer.optimizer.state
        per_param = {}
        for name, param in model.module.named_parameters():
            # Rows ceil(rows / N) * rank onwards, as DTensor's Shard(0) cuts them.
            rows = math.ceil(param.shape[0] / size)
            expected = param.detach()[rank * rows : (rank + 1) * rows].float()
            main = optimizer._shards[param]
            assert id(main) in held
            assert torch.equal(main, expected), name
            assert param.grad is None, f"{name}: the engine handed out a whole .grad"
            per_param[name] = {key: state[main][key].numel() for key in ("exp_avg", "exp_avg_sq")}
            per_param[name]["main"] = main.numel()
            per_param[name]["fp32_main"] = main.dtype == torch.float32
        grad_shards = sum(b.shards.grad_shard.data.numel() for b in model.buckets)
        return dict(per_param=per_param, grad_shards=grad_shards)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_each_rank_holds_one_nth_of_the_state(bf16):
    world_size = 4
    ranks = run_distributed(_state_sizes, world_size, bf16)
    shapes = {n: p.shape for n, p in _weights_of_fresh_model({"bf16": bf16}).items()}
    padded_total = 0
    for name, shape in shapes.items():
        row = math.prod(shape[1:])
        padded_total += math.ceil(shape[0] / world_size) * world_size * row
        for key in ("exp_avg", "exp_avg_sq", "main"):
            counts = [r["per_param"][name][key] for r in ranks]
            # The chunks partition the parameter: nothing is held twice, nothing is missing.
            assert sum(counts) == math.prod(shape), (name, key, counts)
            assert max(counts) == math.ceil(shape[0] / world_size) * row, (name, key, counts)
        assert all(r["per_param"][name]["fp32_main"] for r in ranks)
    # Position embedding (3 rows over 4 ranks): the last rank holds nothing of it.
    assert ranks[3]["per_param"]["embedding.position_embeddings.weight"]["main"] == 0
    # Reduced gradients: 1/N of the padded model per rank.
    for r in ranks:
        assert r["grad_shards"] * world_size == padded_total


def _snapshot(state: tuple) -> dict:
    model, optimizer, scheduler = state
    sharded = optimizer.sharded_state_dict()
    return {
        "weights": {name: whole_tensor(t) for name, t in model.state_dict().items()},
        "masters": {n: whole_tensor(t) for n, t in sharded["fp32_from_fp16_params"].items()},
        "optimizer": {
            name: {key: whole_tensor(value) for key, value in values.items()}
            for name, values in sharded["state"].items()
        },
        "scheduler": scheduler.state_dict(),
    }


def _ckpt_args(root: str) -> argparse.Namespace:
    return argparse.Namespace(
        save=root,
        load=root,
        ckpt_format="torch_dist",
        ckpt_step=None,
        finetune=False,
        pretrained_checkpoint=None,
        no_load_optim=False,
        no_load_rng=True,
        dist_ckpt_strictness="assume_ok_unexpected",
        num_layers=2,
        hidden_size=32,
    )


def _save(root: str, bf16: bool) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        state = _build(True, bf16=bf16, bucket_size=3000)
        _train(state, _batches(2))
        save_checkpoint(2, *state, _ckpt_args(root))
        return _snapshot(state)
    finally:
        parallel_state.destroy_model_parallel()


def _load(root: str, bf16: bool, distributed: bool) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        state = _build(distributed, seed=4321, bf16=bf16)
        assert load_checkpoint(*state, _ckpt_args(root)).iteration == 2
        loaded = _snapshot(state)
        # Training goes on from the loaded shards (states, masters) without error.
        _train(state, _batches(3)[2:])
        return loaded
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_checkpoint_saved_on_4_ranks_loads_on_2(bf16, tmp_path):
    root = str(tmp_path)
    saved = run_distributed(_save, 4, root, bf16)
    assert saved[0]["optimizer"], "no optimizer state was saved"
    assert bool(saved[0]["masters"]) == bf16
    for other in saved[1:]:
        assert_same(other, saved[0])
    for distributed in (True, False):  # resharded, and into the plain DDP engine
        loaded = run_distributed(_load, 2, root, bf16, distributed)
        for rank, state in enumerate(loaded):
            assert_same(state, saved[0], f"rank {rank} distributed={distributed}")
