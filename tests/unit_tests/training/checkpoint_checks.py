"""What the checkpoint tests share: tiny training runs through `pretrain_gpt.main` on the
spawned ranks, and what they compare: whole tensors (DTensors gathered), exact equality of
nested state and of training histories, a checkpoint's tensors read without the code that wrote
them, and the bytes of every file of a directory; and another job's process holding the lock of a
`--save` directory."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

import pretrain_gpt
from megatron.training.checkpoint_checksums import (
    CHECKSUMS_FILENAME,
    checksum_file,
    write_manifest,
)
from megatron.training.checkpoint_layout import COMMON_FILENAME, TRACKER_FILENAME
from megatron.training.training import TrainingHistory
from tests.unit_tests.program_launcher import start_program

RUN = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 1e-2 --lr-warmup-iters 2 "
    "--lr-decay-style cosine --min-lr 1e-3 --mock-data --vocab-size 64 --hidden-dropout 0.1 "
    "--attention-dropout 0.1 --num-workers 0 --eval-interval 2 --eval-iters 1 "
    "--log-interval 10 --clip-grad 1.0"
).split()
"""6 iterations of 2 microbatches per rank at 2 ranks, dropout on, validation every 2."""

ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def main(flags: list[str]) -> TrainingHistory:
    """`pretrain_gpt.main` on this rank, with the backend of the rank pool."""
    return pretrain_gpt.main([*flags, "--distributed-backend", dist.get_backend()])


def main_error(flags: list[str]) -> tuple[str, str] | None:
    """(exception type, message) of a run that fails; None if it trains."""
    try:
        main(flags)
    except Exception as error:  # noqa: BLE001 - the test checks which
        return type(error).__name__, str(error)
    return None


@contextlib.contextmanager
def lock_held_by_another_process(root: str) -> Iterator[int]:
    """A live process of this host holding the lock of the directory `root` (as another job's
    rank 0 does) for the block; yields its pid."""
    code = (
        "import sys\n"
        "from megatron.training.checkpoint_lock import hold_save_lock\n"
        f"with hold_save_lock({root!r}):\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.read()\n"
    )
    with start_program(code=code) as holder:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
        holder.stdin.close()  # ends its block: it releases the lock
        assert holder.wait(timeout=120) == 0


def read_tracker_text(root: str) -> str:
    with open(os.path.join(root, TRACKER_FILENAME)) as tracker:
        return tracker.read()


def directory_hashes(root: str) -> dict[str, str]:
    """Every file under `root` -> the SHA-256 of its bytes."""
    hashes = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as file:
                hashes[os.path.relpath(path, root)] = hashlib.sha256(file.read()).hexdigest()
    return hashes


def flip_byte(path: str) -> None:
    """Inverts the bits of the byte in the middle of the file `path` (its size unchanged)."""
    with open(path, "r+b") as file:
        file.seek(os.path.getsize(path) // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))


def assert_histories_equal(actual: TrainingHistory, expected: TrainingHistory) -> None:
    """Bitwise: Python floats compare exactly."""
    assert actual.losses == expected.losses
    assert actual.grad_norms == expected.grad_norms
    assert actual.learning_rates == expected.learning_rates
    assert actual.validation_losses == expected.validation_losses
    assert actual.final_validation_losses == expected.final_validation_losses
    assert actual.test_losses == expected.test_losses


def resumed_part(straight: TrainingHistory, after: int) -> TrainingHistory:
    """What a run resumed after iteration `after` must report of `straight`."""
    return TrainingHistory(
        start_iteration=after,
        losses=straight.losses[after:],
        grad_norms=straight.grad_norms[after:],
        learning_rates=straight.learning_rates[after:],
        validation_losses={i: v for i, v in straight.validation_losses.items() if i > after},
        final_validation_losses=straight.final_validation_losses,
        test_losses=straight.test_losses,
    )


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor`, gathered whole if it is a DTensor."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def whole_value(value: Any) -> Any:
    """A copy of a model state dict's value: `whole_tensor` of a tensor; of a module's extra
    state (the FP8 delayed-scaling state, the bytes of a `torch.save`), what it holds."""
    if isinstance(value, io.BytesIO):
        return torch.load(io.BytesIO(value.getvalue()), weights_only=True)
    return whole_tensor(value)


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Recursive exact equality: tensors bitwise, with the same dtype and shape."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (
            f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def read_whole_checkpoint(path: str, scratch: str) -> dict[str, Any]:
    """A checkpoint's tensors, whole, read in this process (DCP's own converter)."""
    os.makedirs(scratch, exist_ok=True)
    output = os.path.join(scratch, "whole.pt")
    dcp_to_torch_save(path, output)
    whole = torch.load(output, weights_only=False)
    os.remove(output)
    return whole


def edit_common(directory: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Applies `edit` to the checkpoint's common.pt and records the new checksums (an edit that
    stands for a checkpoint saved so, not for damage)."""
    path = os.path.join(directory, COMMON_FILENAME)
    common = torch.load(path, weights_only=False)
    edit(common)
    torch.save(common, path)
    checksums = {
        name: checksum_file(os.path.join(directory, name)) for name in os.listdir(directory)
    }
    del checksums[CHECKSUMS_FILENAME]
    write_manifest(directory, checksums, FileSystemReader(directory).read_metadata())
