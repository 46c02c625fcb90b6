"""Checkpoints through `pretrain_gpt.main` on spawned gloo ranks (NCCL on GPUs).

- Training resumed from a checkpoint is bitwise the uninterrupted run (FP8 delayed scaling
  included, of MoE experts too: its amax histories and scales are saved; and blockwise
  scaling, which has none).
- A save killed part-way, or failing on rank 0, leaves the previous checkpoint, which resumes
  exactly.
- Missing, damaged (a flipped byte included: the file checksums) and mismatched checkpoints
  fail naming what differs, and leave the directory byte-identical; --finetune,
  --no-load-optim and --no-load-rng load what they say.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import pretrain_gpt
from megatron.core.optimizer_param_scheduler import ScheduleMismatchError
from megatron.training import checkpoint_layout, checkpointing, training
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_checksums import (
    CHECKSUMS_FILENAME,
    ChecksumWriter,
)
from megatron.training.checkpointing import (
    TRACKER_FILENAME,
    CheckpointError,
)
from megatron.training.flag_groups.optimization import describe_schedule_mismatch
from megatron.training.training import TrainingHistory
from tests.unit_tests.distributed_harness import DistributedTestError, run_distributed
from tests.unit_tests.program_launcher import run_program
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    ZERO3,
    assert_histories_equal,
    assert_same,
    directory_hashes,
    edit_common,
    flip_byte,
    main,
    main_error,
    read_tracker_text,
    read_whole_checkpoint,
    resumed_part,
    whole_tensor,
)
from tests.unit_tests.training.flag_checks import BASE, validated

REPOSITORY = os.path.dirname(os.path.abspath(pretrain_gpt.__file__))

FP8_DELAYED = (
    "--bf16 --fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max".split()
)
"""FP8 with delayed scaling: the amax histories and scales are state to restore (a resume
from fresh ones casts with other scales, and its losses differ)."""

FP8_BLOCKWISE = "--bf16 --fp8-format e4m3 --fp8-recipe blockwise".split()
"""FP8 with block scales from each block's values: no FP8 state to restore."""

FP8_MOE = (
    "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-grouped-gemm "
    "--fp8-param-gather"
).split()
"""FP8 experts (their delayed-scaling slots, one per expert, are state too) at EP 2, gathered as
FP8 by Megatron-FSDP."""

ENGINES = {
    "fsdp_zero3": ZERO3,
    "ddp": [],
    "fsdp_zero3_bf16": [*ZERO3, "--bf16"],
    "ddp_bf16": ["--bf16"],  # the optimizer's fp32 masters are state to restore
    "fsdp_zero3_fp8_delayed": [*ZERO3, *FP8_DELAYED],
    "ddp_fp8_delayed": FP8_DELAYED,
    "fsdp_zero3_fp8_blockwise": [*ZERO3, *FP8_BLOCKWISE],
    # The model's copies of the FP8 weights hold dequantised FP8 values on other ranks' rows:
    # the resume must cast from the saved fp32 main weights.
    "ddp_fp8_param_gather": [*FP8_DELAYED, "--use-distributed-optimizer", "--fp8-param-gather"],
    "fsdp_zero3_fp8_delayed_moe": [*ZERO3, *FP8_DELAYED, *FP8_MOE],
    # The multi-token prediction depths' delayed-scaling state is a state of its own.
    "fsdp_zero3_fp8_delayed_mtp": [*ZERO3, *FP8_DELAYED, "--mtp-num-layers", "1"],
}


def _dropout_rng() -> str:
    """The generator dropout draws from on this rank (the key of its state in a checkpoint's
    RNG states): only its state tells a loaded RNG from a kept one, as training leaves the
    other one untouched."""
    return "cuda" if dist.get_backend() == "nccl" else "torch"


def _dropout_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _dropout_rng() == "cuda" else torch.get_rng_state()


def _main_observing_load(flags: list[str]) -> tuple[TrainingHistory, dict[str, Any]]:
    """Runs training and records what `load_checkpoint()` left: the iteration, the whole
    weights, the optimizer state, the schedule's step, the consumed samples, and dropout's RNG
    state before and after it."""
    observed: dict[str, Any] = {}
    original = training.load_checkpoint

    def observe(model, optimizer, scheduler, args):
        observed["rng_before"] = _dropout_rng_state()
        progress = original(model, optimizer, scheduler, args)
        observed.update(
            iteration=progress.iteration,
            weights={  # the model chunks (one without virtual pipeline stages)
                name: whole_tensor(t) for chunk in model for name, t in chunk.state_dict().items()
            },
            optimizer_state=sum(map(len, optimizer.sharded_state_dict()["state"].values())),
            scheduler_steps=scheduler.num_steps,
            consumed=(progress.consumed_train_samples, progress.consumed_valid_samples),
            rng_after=_dropout_rng_state(),
            rng=_dropout_rng(),
        )
        return progress

    with mock.patch.object(training, "load_checkpoint", observe):
        history = main(flags)
    return history, observed


@pytest.fixture(scope="module")
def straight_runs() -> Callable[[str], TrainingHistory]:
    """engine -> its 6 iterations without checkpoints, run once when first asked for."""
    cache: dict[str, TrainingHistory] = {}

    def get(engine: str) -> TrainingHistory:
        if engine not in cache:
            histories = run_distributed(main, 2, [*RUN, *ENGINES[engine]])
            assert histories[0].losses == histories[1].losses
            cache[engine] = histories[0]
        return cache[engine]

    return get


@pytest.fixture(scope="module")
def zero3_first_half(tmp_path_factory) -> str:
    """A --save directory of ZeRO-3 stopped by --exit-interval 3: iterations 2 and 3 saved."""
    root = str(tmp_path_factory.mktemp("first-half"))
    flags = [*RUN, *ZERO3, "--exit-interval", "3", "--save", root, "--save-interval", "2"]
    history = run_distributed(main, 2, flags)[0]
    assert len(history.losses) == 3
    return root


@pytest.mark.parametrize("engine", ENGINES)
def test_resumed_training_is_bitwise_the_uninterrupted_run(
    engine, tmp_path, straight_runs, zero3_first_half
):
    straight = straight_runs(engine)
    if engine == "fsdp_zero3":
        root = zero3_first_half
    else:
        root = str(tmp_path)
        flags = [*RUN, *ENGINES[engine], "--exit-interval", "3", "--save", root]
        flags += ["--save-interval", "2"]
        first = run_distributed(main, 2, flags)[0]
        # Saving changes nothing in training; the first half evaluated at iteration 2.
        assert first.losses == straight.losses[:3]
        assert first.validation_losses == {2: straight.validation_losses[2]}
    assert read_tracker_text(root) == "3\n"
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", TRACKER_FILENAME]
    # Resuming into a copy: the module's first half stays as it was for the other tests.
    resume_root = str(tmp_path / "resume")
    shutil.copytree(root, resume_root)
    flags = [*RUN, *ENGINES[engine], "--load", resume_root, "--save", resume_root]
    second = run_distributed(main, 2, flags)
    assert second[0].start_iteration == 3
    # The data order too: each iteration's loss is of its own samples and dropout masks.
    assert_histories_equal(second[0], resumed_part(straight, 3))
    assert_histories_equal(second[1], second[0])
    assert read_tracker_text(resume_root) == "6\n"


class _DyingWriter(ChecksumWriter):
    """Writes this rank's shards of the save into `iter_0000004.tmp`, then SIGKILLs its own
    process: before it reports them, so no rank can finish the save."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if str(self.path).endswith("iter_0000004.tmp"):
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return future


def _main_killed_in_save(flags: list[str], where: str) -> TrainingHistory:
    """Trains, and dies in the save of iteration 4: rank 1 after writing its shards
    ("writing"), or rank 0 after the commit, before the tracker names it ("tracker")."""
    rank = dist.get_rank()
    if where == "writing" and rank == 1:
        patch = mock.patch.object(checkpointing, "ChecksumWriter", _DyingWriter)
    elif where == "tracker" and rank == 0:
        original = checkpointing.write_tracker

        def write_then_die(root: str, iteration: int) -> None:
            if iteration == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            original(root, iteration)

        patch = mock.patch.object(checkpointing, "write_tracker", write_then_die)
    else:
        patch = contextlib.nullcontext()
    with patch:
        return main(flags)


@pytest.mark.parametrize("where", ["writing", "tracker"])
def test_save_killed_part_way_leaves_the_previous_checkpoint(where, tmp_path, straight_runs):
    root = str(tmp_path / "ckpt")
    flags = [*RUN, *ZERO3, "--save", root, "--save-interval", "2"]
    dying = 1 if where == "writing" else 0
    with pytest.raises(DistributedTestError, match=f"rank {dying} died"):
        run_distributed(_main_killed_in_save, 2, flags, where)
    assert read_tracker_text(root) == "2\n"
    if where == "writing":
        staging = os.path.join(root, "iter_0000004.tmp")
        assert not os.path.exists(os.path.join(root, "iter_0000004"))
        # Killed mid-save: rank 1's shards are there, the save's metadata never was.
        assert "__1_0.distcp" in os.listdir(staging)
        assert not {".metadata", "common.pt"} & set(os.listdir(staging))
    else:
        # Committed but never tracked: not loaded, and replaced by the next save of 4.
        assert os.path.isfile(os.path.join(root, "iter_0000004", "common.pt"))
    previous = directory_hashes(os.path.join(root, "iter_0000002"))

    flags = [*flags, "--load", root]
    resumed = run_distributed(main, 2, flags)[0]
    assert_histories_equal(resumed, resumed_part(straight_runs("fsdp_zero3"), 2))
    assert directory_hashes(os.path.join(root, "iter_0000002")) == previous
    assert sorted(os.listdir(root)) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000006",
        TRACKER_FILENAME,
    ]
    assert read_tracker_text(root) == "6\n"


class _NodeLocalWriter(ChecksumWriter):
    """Writes this rank's shards into a directory of its own, as on a node whose `--save` is
    not the filesystem rank 0 sees."""

    def __init__(self, path, *args, **kwargs):
        local = f"{path}.node-local"
        os.makedirs(local, exist_ok=True)
        super().__init__(local, *args, **kwargs)


def _main_with_node_local_save(flags: list[str]) -> tuple[str, str] | None:
    writer = _NodeLocalWriter if dist.get_rank() == 1 else ChecksumWriter
    with mock.patch.object(checkpointing, "ChecksumWriter", writer):
        return main_error(flags)


def test_save_with_shards_rank_0_cannot_see_fails_on_every_rank(tmp_path):
    """--save not shared by all ranks: rank 0 finds rank 1's shards missing before it commits,
    and every rank raises (none waits for a timeout); nothing names the partial save."""
    root = str(tmp_path / "ckpt")
    errors = run_distributed(_main_with_node_local_save, 2, [*RUN, *ZERO3, "--save", root])
    for kind, message in errors:
        assert kind == CheckpointError.__name__, message
        assert "Saving failed on rank 0 while committing" in message, message
        assert "__1_0.distcp is missing" in message and "shared filesystem" in message, message
    assert sorted(os.listdir(root)) == ["iter_0000006.tmp", "iter_0000006.tmp.node-local"]


def test_save_directory_rank_0_cannot_create_fails_on_every_rank(tmp_path):
    """--save is a file: rank 0 cannot create the directory (nor its lock) at the start; every
    rank raises its error (instead of the others waiting at a barrier), and the file is left as
    it was."""
    target = tmp_path / "not_a_directory"
    target.write_text("keep me")
    errors = run_distributed(main_error, 2, [*RUN, *ZERO3, "--save", str(target)])
    for kind, message in errors:
        assert kind == CheckpointError.__name__, message
        assert f"--save {target} cannot be used (FileExistsError: " in message, message
    assert target.read_text() == "keep me"


def _save_in_this_process(state: dict[str, Any], path: str) -> None:
    with warnings.catch_warnings():  # DCP's note that it runs without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)


def _weights_only(source: str, target: str) -> None:
    """`target`: the checkpoint of `source` less its optimizer state, as a conversion from
    model weights writes it (no parameter groups, schedule or RNG states)."""
    whole = read_whole_checkpoint(source, target)
    _save_in_this_process({"model": whole["model"]}, target)
    common = torch.load(os.path.join(source, "common.pt"), weights_only=False)
    common.update(param_groups=None, opt_param_scheduler=None, rng_state=[])
    torch.save(common, os.path.join(target, "common.pt"))


def _edit(path: str, text: str | bytes) -> None:
    with open(path, "wb" if isinstance(text, bytes) else "w") as file:
        file.write(text)


def _truncate(path: str) -> None:
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)


def _drop_model_args(directory: str) -> None:
    """Empties the arguments in the checkpoint's common.pt (a checkpoint saved without them)."""
    edit_common(directory, lambda common: common.update(args={}))


ITER_3 = "iter_0000003"
BAD_LOADS = {
    # id: (edit of a copy of the first half's directory, extra flags, fragments of the error)
    "hidden-size": (None, ["--hidden-size", "64"], ["--hidden-size 32 (here 64)"]),
    "num-layers": (None, ["--num-layers", "3"], ["--num-layers 2 (here 3)"]),
    "tensor-shapes": (
        lambda root: _drop_model_args(os.path.join(root, ITER_3)),
        ["--hidden-size", "64"],
        ["differ in shape", "embedding.word_embeddings.weight: saved [128, 32], model [128, 64]"],
    ),
    "schedule": (
        None,
        ["--min-lr", "2e-3"],
        ["saved with another learning-rate schedule: --min-lr 0.002 here, 0.001 in the checkpo"],
    ),
    "schedule-length": (
        None,
        ["--train-iters", "8"],
        [
            f"{ITER_3} was saved with another learning-rate schedule: --train-iters 8 here, 6 in "
            "the checkpoint (and --lr-decay-iters, which defaults to it). To resume it, pass "
            "--override-opt_param-scheduler to follow this run's flags from the checkpoint's "
            "step, --use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule, or "
            "the checkpoint's values."
        ],
    ),
    "no-such-directory": (None, ["--load", "{root}/missing"], ["missing: no such directory"]),
    "tracker-to-missing": (
        lambda root: _edit(os.path.join(root, TRACKER_FILENAME), "7\n"),
        [],
        ["names iteration 7, but", "iter_0000007 does not exist"],
    ),
    "ckpt-step-missing": (None, ["--ckpt-step", "5"], ["--ckpt-step 5 names iteration 5"]),
    "corrupt-tracker": (
        lambda root: _edit(os.path.join(root, TRACKER_FILENAME), "banana\n"),
        [],
        ["holds 'banana', not an iteration number"],
    ),
    "no-metadata": (
        lambda root: os.remove(os.path.join(root, ITER_3, ".metadata")),
        [],
        ["iter_0000003 is incomplete (no .metadata)"],
    ),
    "no-common": (
        lambda root: os.remove(os.path.join(root, ITER_3, "common.pt")),
        [],
        ["iter_0000003 is incomplete (no common.pt)"],
    ),
    "truncated-common": (
        lambda root: _truncate(os.path.join(root, ITER_3, "common.pt")),
        [],
        ["iter_0000003 is damaged: common.pt has ", "Load another iteration with --ckpt-step"],
    ),
    "truncated-common-saved-without-checksums": (
        lambda root: (
            os.remove(os.path.join(root, ITER_3, CHECKSUMS_FILENAME)),
            _truncate(os.path.join(root, ITER_3, "common.pt")),
        ),
        [],
        ["common.pt cannot be read", "damaged"],
    ),
    "flipped-byte-in-shard": (
        lambda root: flip_byte(os.path.join(root, ITER_3, "__1_0.distcp")),
        [],
        [
            "iter_0000003 is damaged: __1_0.distcp bytes [0, ",
            "Load another iteration with --ckpt-step (",
            "holds iterations [2])",
        ],
    ),
    "flipped-byte-in-common": (
        lambda root: flip_byte(os.path.join(root, ITER_3, "common.pt")),
        [],
        ["iter_0000003 is damaged: common.pt bytes [0, ", "have CRC-32", "--ckpt-step"],
    ),
    "damaged-checksums-file": (
        lambda root: _edit(os.path.join(root, ITER_3, CHECKSUMS_FILENAME), '{"files": '),
        [],
        ["checksums.json cannot be read", "damaged", "--ckpt-step"],
    ),
    "missing-shard": (
        lambda root: os.remove(os.path.join(root, ITER_3, "__1_0.distcp")),
        [],
        ["iter_0000003 is incomplete: __1_0.distcp is missing"],
    ),
    "truncated-shard": (
        lambda root: _truncate(os.path.join(root, ITER_3, "__0_0.distcp")),
        [],
        ["iter_0000003 is incomplete: __0_0.distcp has "],
    ),
    "weights-only": (
        lambda root: (
            shutil.move(os.path.join(root, ITER_3), os.path.join(root, "adam")),
            _weights_only(os.path.join(root, "adam"), os.path.join(root, ITER_3)),
            shutil.rmtree(os.path.join(root, "adam")),
        ),
        [],
        ["holds no optimizer state", "pass --no-load-optim or --finetune"],
    ),
    "renamed-iteration": (
        lambda root: (
            os.rename(os.path.join(root, ITER_3), os.path.join(root, "iter_0000005")),
            _edit(os.path.join(root, TRACKER_FILENAME), "5\n"),
        ),
        [],
        ["iter_0000005 holds the checkpoint of iteration 3, not 5"],
    ),
    "bf16-ddp-engine-from-fp32-fsdp": (
        None,
        ["--bf16"],
        ["fp32 master weights do not fit", "lacks 28 of them", "--no-load-optim"],
    ),
    "other-optimizer": (
        None,
        ["--optimizer", "sgd"],
        ["optimizer is of another kind", "'betas'", "'momentum'", "--no-load-optim"],
    ),
}


DDP_ENGINE_LOADS = {"bf16-ddp-engine-from-fp32-fsdp"}
"""Cases that load the ZeRO-3 checkpoint into the DDP engine."""


@pytest.mark.parametrize("case", BAD_LOADS)
def test_bad_load_fails_naming_the_difference_and_leaves_the_directory(
    case, tmp_path, zero3_first_half
):
    edit, extra, fragments = BAD_LOADS[case]
    root = str(tmp_path / "ckpt")
    shutil.copytree(zero3_first_half, root)
    if edit is not None:
        edit(root)
    before = directory_hashes(root)
    engine = [] if case in DDP_ENGINE_LOADS else ZERO3
    flags = [*RUN, *engine, "--load", root, *(f.format(root=root) for f in extra)]
    errors = run_distributed(main_error, 2, flags)
    for error in errors:
        assert error is not None, "loaded a bad checkpoint"
        kind, message = error
        assert kind == CheckpointError.__name__, message
        for fragment in fragments:
            assert fragment in message, message
    assert directory_hashes(root) == before


def test_a_resume_with_another_schedule_ends_pretrain_gpt_as_a_flag_error(
    tmp_path, zero3_first_half
):
    """Two ranks of pretrain_gpt.py, started as torchrun starts them: before, every rank printed
    the traceback of a CheckpointError that spoke in samples ("lr_decay_steps ...: 32 here, 24
    in the checkpoint") and exited with code 1."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(zero3_first_half, root)
    before = directory_hashes(root)
    flags = [*RUN, *ZERO3, "--train-iters", "8", "--load", root, "--save", root]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = run_program(
        "pretrain_gpt.py",
        [*flags, "--distributed-backend", "gloo"],
        nproc=2,
        env=environment,
        cwd=REPOSITORY,
        timeout=600,
        stop_others=False,
    )
    stderr = done.stderr
    assert done.rank_returncodes == [2, 2], stderr
    assert "Traceback" not in stderr, stderr
    assert [line for line in stderr.splitlines() if "error" in line] == [
        f"error: {root}/{ITER_3} was saved with another learning-rate schedule: --train-iters 8 "
        "here, 6 in the checkpoint (and --lr-decay-iters, which defaults to it). To resume it, "
        "pass --override-opt_param-scheduler to follow this run's flags from the checkpoint's "
        "step, --use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule, or the "
        "checkpoint's values."
    ]
    assert directory_hashes(root) == before


def test_weights_only_checkpoint_loads_with_no_load_optim(tmp_path, zero3_first_half):
    source = os.path.join(zero3_first_half, ITER_3)
    root = str(tmp_path / "ckpt")
    _weights_only(source, os.path.join(root, ITER_3))
    _edit(os.path.join(root, TRACKER_FILENAME), "3\n")
    flags = [*RUN, *ZERO3, "--load", root, "--no-load-optim"]
    history, observed = run_distributed(_main_observing_load, 2, flags)[0]
    assert observed["iteration"] == 3 and history.start_iteration == 3
    assert_same(observed["weights"], read_whole_checkpoint(source, str(tmp_path))["model"])
    # No RNG states in it: the generators keep their seeded states.
    assert torch.equal(observed["rng_after"], observed["rng_before"])
    assert observed["optimizer_state"] == 0 and len(history.losses) == 3


def test_load_of_the_empty_save_directory_starts_from_scratch(tmp_path, straight_runs):
    root = str(tmp_path)
    assert os.listdir(root) == []
    history = run_distributed(main, 2, [*RUN, *ZERO3, "--load", root, "--save", root])[0]
    assert history.start_iteration == 0
    assert_histories_equal(history, straight_runs("fsdp_zero3"))
    assert read_tracker_text(root) == "6\n"


LOAD_OPTIONS = ["--finetune", "--no-load-optim", "--no-load-rng"]


@pytest.mark.parametrize("option", LOAD_OPTIONS)
def test_load_options(option, tmp_path, straight_runs, zero3_first_half):
    """--finetune: weights only, iteration 0, fresh optimizer, schedule and data. --no-load-optim:
    weights, iteration, data position and RNG, fresh optimizer and schedule. --no-load-rng:
    everything but the RNG states."""
    straight = straight_runs("fsdp_zero3")
    path = os.path.join(zero3_first_half, ITER_3)
    before = directory_hashes(zero3_first_half)
    flags = [*RUN, *ZERO3, "--load", zero3_first_half, option]
    results = run_distributed(_main_observing_load, 2, flags)
    saved = read_whole_checkpoint(path, str(tmp_path))
    common = torch.load(os.path.join(path, "common.pt"), weights_only=False)
    for rank, (history, observed) in enumerate(results):
        assert_same(observed["weights"], saved["model"], f"rank {rank} weights")
        saved_rng = common["rng_state"][rank][observed["rng"]]
        rng_loaded = torch.equal(observed["rng_after"], saved_rng)
        rng_kept = torch.equal(observed["rng_after"], observed["rng_before"])
        if option == "--finetune":
            assert observed["iteration"] == 0 and history.start_iteration == 0
            assert observed["consumed"] == (0, 0)
            assert observed["optimizer_state"] == 0 and observed["scheduler_steps"] == 0
            assert rng_kept and not rng_loaded
            assert len(history.losses) == 6
            # A new run from the weights: the schedule starts again, and is the straight one.
            assert history.learning_rates == straight.learning_rates
            assert history.losses[0] != straight.losses[0]  # other weights than at the start
        elif option == "--no-load-optim":
            assert observed["iteration"] == 3 and history.start_iteration == 3
            assert observed["consumed"] == (24, 8)
            assert observed["optimizer_state"] == 0 and observed["scheduler_steps"] == 0
            assert rng_loaded and not rng_kept
            # Same weights, samples and dropout masks: the 4th loss is the straight run's; then
            # the fresh optimizer (and restarted schedule) takes another step.
            assert history.losses[0] == straight.losses[3]
            assert history.losses[1] != straight.losses[4]
        else:
            assert observed["iteration"] == 3 and observed["consumed"] == (24, 8)
            # The schedule counts samples, as Megatron-LM's: 3 iterations of 8.
            assert observed["optimizer_state"] > 0 and observed["scheduler_steps"] == 24
            assert rng_kept and not rng_loaded
            # The same weights and samples, other dropout masks.
            assert history.losses[0] != straight.losses[3]
            assert history.learning_rates == straight.learning_rates[3:]
    assert directory_hashes(zero3_first_half) == before


# --- Without processes ---


def test_interrupted_replacement_is_restored_by_the_next_save(tmp_path):
    """A save replacing a committed checkpoint renames it aside, then renames the new one in:
    killed between the two, the next save puts the old one back instead of deleting it."""
    root = str(tmp_path)
    for name, content in [
        ("iter_0000004.replaced.tmp", "old 4"),  # its replacement never took its place
        ("iter_0000006.replaced.tmp", "old 6"),  # replaced: iter_0000006 is there
        ("iter_0000006", "new 6"),
        ("iter_0000008.tmp", "staging"),
    ]:
        os.makedirs(os.path.join(root, name))
        _edit(os.path.join(root, name, "common.pt"), content)
    with pytest.raises(CheckpointError, match="rename .*iter_0000004.replaced.tmp to"):
        checkpointing._check_complete(os.path.join(root, "iter_0000004"), 4, root, 4)
    checkpoint_layout.remove_leftovers(root)
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000006"]
    with open(os.path.join(root, "iter_0000004", "common.pt")) as file:
        assert file.read() == "old 4"
    with open(os.path.join(root, "iter_0000006", "common.pt")) as file:
        assert file.read() == "new 6"


def test_tracker_is_read_strictly(tmp_path):
    assert checkpoint_layout.read_tracker(str(tmp_path)) is None
    _edit(os.path.join(tmp_path, TRACKER_FILENAME), " 12\n")
    assert checkpoint_layout.read_tracker(str(tmp_path)) == 12
    _edit(os.path.join(tmp_path, TRACKER_FILENAME), "release")
    with pytest.raises(CheckpointError, match="'release', not an iteration number"):
        checkpoint_layout.read_tracker(str(tmp_path))


def test_saved_tensor_paths_are_read_from_the_metadata(tmp_path):
    """`_saved_tensors` groups DCP's flattened keys by their top-level entry."""
    state = {
        "model": {"a.weight": torch.zeros(2, 3)},
        "optimizer": {
            "state": {"a.weight": {"exp_avg": torch.ones(2, 3), "step": torch.tensor(3.0)}}
        },
    }
    _save_in_this_process(state, str(tmp_path))
    saved = checkpointing._saved_tensors(FileSystemReader(str(tmp_path)).read_metadata())
    assert saved["model"] == {("a.weight",): (torch.Size([2, 3]), torch.float32)}
    assert saved["optimizer"] == {
        ("state", "a.weight", "exp_avg"): (torch.Size([2, 3]), torch.float32),
        ("state", "a.weight", "step"): (torch.Size([]), torch.float32),
    }


def test_exit_on_missing_checkpoint_refuses_to_train_from_scratch(tmp_path):
    """The one case that trains from scratch, `--load` the `--save` directory holding nothing
    yet, is an error with the flag."""
    root = str(tmp_path / "ckpt")
    flags = [*BASE, "--load", root, "--save", root]
    fresh = checkpointing.load_checkpoint(None, None, None, parse_args(args=flags))
    assert fresh.iteration == 0
    args = parse_args(args=[*flags, "--exit-on-missing-checkpoint"])
    with pytest.raises(CheckpointError, match="holds no checkpoint yet, and --exit-on-missing"):
        checkpointing.load_checkpoint(None, None, None, args)


def _schedule_mismatch(saved_flags: list[str], flags: list[str], saved_args: bool = True) -> str:
    """How a run of `flags` describes resuming a checkpoint saved by a run of `saved_flags`."""
    saved, here = validated(*saved_flags), validated(*flags)
    schedules = [
        training.get_optimizer_param_scheduler(SimpleNamespace(param_groups=[{}]), args)
        for args in (saved, here)
    ]
    with pytest.raises(ScheduleMismatchError) as error:
        schedules[1].check_state_dict(schedules[0].state_dict())
    return describe_schedule_mismatch(error.value, vars(saved) if saved_args else {}, here)


SCHEDULE_MISMATCHES = {
    # id: (the checkpoint's flags, this run's, the start of the description)
    "train-iters": (
        ["--train-iters", "200"],
        ["--train-iters", "250"],
        "--train-iters 250 here, 200 in the checkpoint (and --lr-decay-iters, which defaults to "
        "it). To resume it, pass --override-opt_param-scheduler",
    ),
    "lr-decay-iters": (
        ["--lr-decay-iters", "8"],
        ["--lr-decay-iters", "9"],
        "--lr-decay-iters 9 here, 8 in the checkpoint. ",
    ),
    "global-batch-size": (
        ["--global-batch-size", "8"],
        ["--global-batch-size", "16"],
        "--global-batch-size 16 here, 8 in the checkpoint. ",
    ),
    "weight-decay": (
        ["--weight-decay", "0.01"],
        ["--weight-decay", "0.1"],
        "--weight-decay 0.1 here, 0.01 in the checkpoint (and --start-weight-decay and "
        "--end-weight-decay, which default to it). ",
    ),
    "warmup-fraction": (
        ["--lr-warmup-fraction", "0.1"],
        ["--lr-warmup-fraction", "0.2", "--lr-decay-style", "cosine"],
        "--lr-warmup-fraction 0.2 here, 0.1 in the checkpoint; --lr-decay-style cosine here, "
        "linear in the checkpoint. ",
    ),
}


@pytest.mark.parametrize("case", SCHEDULE_MISMATCHES)
def test_a_changed_schedule_is_described_in_the_flags_the_user_changed(case):
    """Before: in the schedule's samples ("lr_decay_steps ...: 4000 here, 3200 in the
    checkpoint") after a changed --train-iters."""
    saved_flags, flags, description = SCHEDULE_MISMATCHES[case]
    assert _schedule_mismatch(saved_flags, flags).startswith(description)


def test_a_schedule_in_the_same_samples_resumes_as_upstream():
    """The schedule counts samples (Megatron-LM's): half the iterations of twice the batch is
    the same schedule."""
    saved, here = (
        validated("--train-iters", "20", "--global-batch-size", "8"),
        validated("--train-iters", "10", "--global-batch-size", "16"),
    )
    schedules = [
        training.get_optimizer_param_scheduler(SimpleNamespace(param_groups=[{}]), args)
        for args in (saved, here)
    ]
    schedules[1].check_state_dict(schedules[0].state_dict())


def test_a_changed_schedule_without_the_checkpoints_flags_keeps_the_schedules_words():
    """A checkpoint converted from weights records no arguments."""
    description = _schedule_mismatch(["--train-iters", "200"], ["--train-iters", "250"], False)
    assert description.startswith(
        "lr_decay_steps (--lr-decay-iters/-samples): 1000 here, 800 in the checkpoint; "
        "wd_incr_steps (--train-iters/-samples): 1000 here, 800 in the checkpoint. "
    )


def test_which_checkpoint_the_tracker_names(tmp_path):
    """`--load` == `--save` without a committed checkpoint (missing, empty, or holding only an
    interrupted first save) starts from scratch; any other `--load` without a tracker fails."""
    root = str(tmp_path / "ckpt")

    def tracked(load: str, save: str | None) -> int | None:
        return checkpointing._tracked_iteration(load, "--load", save)

    assert tracked(root, root) is None  # not created yet
    os.makedirs(os.path.join(root, "iter_0000002.tmp"))
    assert tracked(root, root + "/") is None
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt"):
        tracked(root, None)
    with pytest.raises(CheckpointError, match="missing: no such directory"):
        tracked(root + "/missing", None)
    os.makedirs(os.path.join(root, "iter_0000004"))
    with pytest.raises(CheckpointError, match=r"It holds iterations \[4\]: pass --ckpt-step"):
        tracked(root, root)
    _edit(os.path.join(root, TRACKER_FILENAME), "4\n")
    assert tracked(root, None) == 4
