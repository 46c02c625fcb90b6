"""The file checksums of checkpoints (`megatron.training.checkpoint_checksums`).

- A save lists every file of the checkpoint with its size and the CRC-32 of each block of its
  bytes on disk, as does `tools/convert_checkpoint.py from-torch`; `ChecksumWriter` records
  what DCP wrote with several writer threads too; verification names the damaged block.
- A checkpoint saved before checksums existed loads, with a note.
- `tools/benchmark_checkpoint.py` saves and loads with and without them on two CPU ranks.

Damaged checkpoints (a flipped byte in a shard or in common.pt, a damaged checksums file) are
among the bad loads of `test_checkpoint_resume.py`.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import warnings
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.training import checkpoint_checksums
from megatron.training.checkpoint_checksums import (
    BLOCK_BYTES,
    CHECKSUMS_FILENAME,
    ChecksumWriter,
    FileChecksum,
    checksum_bytes,
    checksum_file,
    verify_files,
)
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.program_launcher import run_program
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    ZERO3,
    directory_hashes,
    main,
)
from tests.unit_tests.training.log_capture import capture_training_log

REPO = Path(__file__).resolve().parents[3]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))
convert_checkpoint = importlib.import_module("convert_checkpoint")


def _listed(directory: str) -> dict[str, dict]:
    with open(os.path.join(directory, CHECKSUMS_FILENAME)) as file:
        manifest = json.load(file)
    assert (manifest["algorithm"], manifest["block_bytes"]) == ("crc32", BLOCK_BYTES)
    return manifest["files"]


def _block_crcs(data: bytes, block: int) -> list[int]:
    """The CRC-32 of each `block` bytes of `data` (zlib's, not the code under test)."""
    return [zlib.crc32(data[start : start + block]) for start in range(0, len(data), block)]


def _assert_lists_every_file(directory: str) -> None:
    """The checksums file names every other file of `directory`, each with the size and the
    CRC-32 of its bytes as they are on disk."""
    files = _listed(directory)
    assert sorted(files) == sorted(set(os.listdir(directory)) - {CHECKSUMS_FILENAME})
    for name, entry in files.items():
        data = Path(directory, name).read_bytes()
        crcs = [f"{crc:08x}" for crc in _block_crcs(data, BLOCK_BYTES)]
        assert entry == {"bytes": len(data), "crc32": crcs}, name


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A --save directory of 3 ZeRO-3 iterations on 2 ranks, saved at iterations 2 and 3."""
    root = str(tmp_path_factory.mktemp("saved"))
    flags = [*RUN, *ZERO3, "--exit-interval", "3", "--save", root, "--save-interval", "2"]
    run_distributed(main, 2, flags)
    return root


def test_save_lists_every_file_with_its_checksum(saved):
    for iteration in ("iter_0000002", "iter_0000003"):
        directory = os.path.join(saved, iteration)
        _assert_lists_every_file(directory)
        # Both ranks' shards, .metadata and common.pt: every file a save writes is listed.
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "common.pt"} <= set(_listed(directory))


BLOCK = 1000
"""A block size for the tests of several blocks per file (not a divisor of the file sizes)."""


def test_writer_records_the_blocks_of_files_of_several_threads(tmp_path):
    state = {f"tensor_{i}": torch.randn(64, 32) for i in range(6)}
    writer = ChecksumWriter(str(tmp_path), thread_count=3)
    with (
        mock.patch.object(checkpoint_checksums, "BLOCK_BYTES", BLOCK),
        warnings.catch_warnings(),  # DCP's note that it runs without a process group
    ):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert sorted(writer.checksums) == sorted(os.listdir(tmp_path))
    assert len(writer.checksums) == 4  # .metadata and a file per thread
    for name, checksum in writer.checksums.items():
        data = (tmp_path / name).read_bytes()
        assert len(data) > BLOCK, name  # several blocks
        assert checksum == FileChecksum(len(data), tuple(_block_crcs(data, BLOCK))), name


def test_verification_names_the_damaged_block(tmp_path):
    data = bytes(range(256)) * 20  # 5120 bytes: blocks of 1000, the last of 120
    files = {name: tmp_path / name for name in ("a", "b", "c", "d")}
    for path in files.values():
        path.write_bytes(data)
    with mock.patch.object(checkpoint_checksums, "BLOCK_BYTES", BLOCK):
        checksums = {name: checksum_file(str(path)) for name, path in files.items()}
        assert checksums["a"] == checksum_bytes(data)
        assert len(checksums["a"].blocks) == 6
        damaged = bytearray(data)
        damaged[2500] ^= 1
        files["a"].write_bytes(damaged)
        files["b"].write_bytes(data[:-1])
        files["c"].unlink()
        problems = verify_files(str(tmp_path), checksums, checksums)
    assert problems[0] == "b has 5119 bytes, but its save wrote 5120"
    assert problems[1] == "c is missing"
    crc = zlib.crc32(damaged[2000:3000])
    expected = f"{zlib.crc32(data[2000:3000]):08x}"
    assert problems[2:] == [
        f"a bytes [2000, 3000) have CRC-32 {crc:08x}, but its save recorded {expected}"
    ]


def test_convert_from_torch_lists_every_file(saved, tmp_path):
    full = tmp_path / "full.pt"
    convert_checkpoint.main(["to-torch", "--load", saved, "--output", str(full)])
    converted = tmp_path / "converted"
    convert_checkpoint.main(["from-torch", "--input", str(full), "--save", str(converted)])
    _assert_lists_every_file(str(converted / "iter_0000003"))


def _resume_logging(flags: list[str]) -> tuple[int, list[str]]:
    with capture_training_log() as messages:
        history = main(flags)
    return history.start_iteration, messages


def test_checkpoint_saved_without_checksums_loads_with_a_note(saved, tmp_path):
    root = str(tmp_path / "old")
    shutil.copytree(saved, root)
    for iteration in ("iter_0000002", "iter_0000003"):
        os.remove(os.path.join(root, iteration, CHECKSUMS_FILENAME))
    before = directory_hashes(root)
    results = run_distributed(_resume_logging, 2, [*RUN, *ZERO3, "--load", root])
    assert [start for start, _ in results] == [3, 3]
    note = f"iter_0000003 has no {CHECKSUMS_FILENAME} (saved before checkpoints recorded"
    assert any(note in message for message in results[0][1]), results[0][1]
    assert directory_hashes(root) == before


TOOL = REPO / "tools" / "benchmark_checkpoint.py"
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --vocab-size 64 --seq-length 16 "
    "--repeats 1"
).split()


TINY_PARAMETERS = 128 * 32 + 2 * 12_704 + 64 + 128 * 32
"""The tiny model's parameters: embedding, 2 layers (norms, QKV, projection, MLP, with biases),
final norm, output layer."""


@pytest.mark.parametrize("fp8", [[], ["--bf16", "--fp8-format", "hybrid"]], ids=["bf16", "fp8"])
def test_benchmark_tool_runs_on_two_cpu_ranks(fp8, tmp_path):
    """Also with FP8 delayed scaling, whose checkpoint holds a non-tensor entry (its amax
    histories and scales): not counted as parameters."""
    out = tmp_path / "result.json"
    scratch = tmp_path / "scratch"
    flags = [*TINY, *fp8, "--dir", str(scratch), "--json-out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # CPU ranks, GPUs or not
    proc = run_program(TOOL, flags, nproc=2, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["world_size"] == 2 and result["bytes"] > 0
    assert result["config"]["params"] == TINY_PARAMETERS
    for mode in ("checksums", "none"):
        for kind in ("save", "load"):
            assert len(result["seconds"][mode][kind]) == 1 and result["seconds"][mode][kind][0] > 0
    assert [line.split()[0] for line in proc.stdout.splitlines()[1:5]] == [
        "checksums",
        "on",
        "off",
        "cost",
    ]
    assert not scratch.exists()  # removed at the end
