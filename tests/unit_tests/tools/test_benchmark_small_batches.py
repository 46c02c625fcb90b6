"""`tools/benchmark_small_batches.py`: runs each row once (a small GPT on 2 CPU ranks), keeps
going past a row that fails, reports what it ran against its target, and reads training logs."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest

from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_small_batches.py"
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --seq-length 32 "
    "--micro-batch-size 2 --warmup-steps 1 --steps 2"
)


def _table(stdout: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in stdout.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def _torchrun_in_warm_ranks(
    command: list[str], cwd: str, stdout, stderr
) -> subprocess.CompletedProcess:
    """Runs a row's command, `python -m torch.distributed.run --standalone --nproc-per-node N
    SCRIPT ARGS`, as `subprocess.run` would, its ranks started by `run_tool` (warm processes)
    instead of a new interpreter each: the tool's own torchrun launches took most of this
    test's time."""
    launch, (nproc, script, *args) = command[:5], command[5:]
    assert launch[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    assert stderr == subprocess.STDOUT
    done = run_tool(*args, nproc=int(nproc), tool=Path(cwd) / script, timeout=300)
    stdout.write(done.stdout + done.stderr)
    return subprocess.CompletedProcess(command, 1 if done.returncode else 0)  # as torchrun exits


def test_runs_each_row_once_and_reports_it_against_its_target(tmp_path, import_tool, capsys):
    tool = import_tool("benchmark_small_batches")

    def run(*flags: str) -> tuple[int, str]:
        status = tool.main(list(flags), run=_torchrun_in_warm_ranks)
        return status, capsys.readouterr().out

    args = ["--out", str(tmp_path), "--rows", "L-4mb,L-graphed", "--model-args", TINY]
    status, stdout = run(*args)
    # --cuda-graph needs CUDA: that row fails (exit 1, its output kept), the others are reported.
    assert status == 1, stdout
    assert "[L-graphed] exit 1" in stdout
    (failed,) = tmp_path.glob("L-graphed-2gpu-*.json.out")
    assert "--cuda-graph needs" in failed.read_text()
    table = _table(stdout)
    assert table["L-graphed"][0] == "not run"
    # One row run (4 microbatches: the accumulation path) stands for all: they share the code.
    (result,) = tmp_path.glob("L-4mb-2gpu-*.json")
    rows = {r["engine"]: r for r in json.loads(result.read_text())["rows"]}
    zero3, single = rows["megatron_fsdp_zero3"]["step_ms"], rows["single"]["step_ms"]
    cells = table["L-4mb"]
    assert float(cells[0]) == pytest.approx(zero3, abs=0.005)
    assert float(cells[2]) == pytest.approx(zero3 / single, abs=0.0005)
    assert cells[3] == "<= 1.05"
    assert cells[4] == ("yes" if zero3 / single <= 1.05 else "no")
    # Again: only the failed row runs; then only the table is printed.
    status, stdout = run(*args)
    assert status == 1
    assert "[L-graphed]" in stdout and "[L-4mb]" not in stdout
    assert _table(stdout) == table
    status, stdout = run(*args, "--report-only")
    assert status == 0 and "[" not in stdout.split("|")[0]
    assert _table(stdout) == table
    # Another model is another command, whose result this one's does not stand in for (and
    # --max-seconds 0 starts nothing).
    other = ["--out", str(tmp_path), "--rows", "L", "--model-args", TINY + " --num-layers 1"]
    status, stdout = run(*other, "--max-seconds", "0")
    assert "--max-seconds reached before L-2gpu-" in stdout
    assert _table(stdout)["L"][0] == "not run"


def test_the_script_lists_each_rows_torchrun_commands(tmp_path):
    """The script itself, `--list`: each row's torchrun commands (which the test above runs
    through warm ranks)."""
    proc = run_tool(
        "--out", str(tmp_path), "--rows", "L,pretrain-S-graphed", "--list", nproc=None, tool=TOOL
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert (
        lines[0].startswith("L: ")
        and "torch.distributed.run --standalone --nproc-per-node 2 tools/benchmark_fsdp.py"
        in lines[0]
    )
    assert [line.split(":")[0] for line in lines] == [
        "L",
        "pretrain-S-graphed",
        "pretrain-S-graphed",
    ]


def test_bad_rows_and_a_single_gpu_are_usage_errors(import_tool, capsys, tmp_path):
    tool = import_tool("benchmark_small_batches")
    for bad, message in (
        (["--rows", "L,M"], "unknown rows ['M']"),
        (["--nproc-per-node", "1"], "--nproc-per-node must be >= 2"),
    ):
        flags = ["--out", str(tmp_path), *bad]
        assert message in usage_error(lambda flags=flags: tool.parse_args(flags), capsys)


def test_training_logs_give_the_median_after_the_first_interval(tmp_path, import_tool):
    """The fields as `pretrain_gpt.py` logs them (`training_log.py`)."""
    tool = import_tool("benchmark_small_batches")
    times, peaks = [900.0, 43.1, 44.0, 43.5], [10.1, 10.2, 10.2, 10.2]
    log = tmp_path / "run.log"
    log.write_text(
        "".join(
            f" iteration {10 * i:8d}/{40:8d} | elapsed time per iteration (ms): {ms:.1f} | "
            f"peak memory (GiB): {gib:.2f} | 25.0% done\n"
            for i, (ms, gib) in enumerate(zip(times, peaks), 1)
        )
    )
    parsed = tool._pretrain(str(log))
    assert parsed == {"step_ms": statistics.median(times[1:]), "peak_gib": max(peaks)}
    log.write_text(" iteration 10/40 | elapsed time per iteration (ms): 900.0\n")
    with pytest.raises(ValueError, match="after the first interval"):
        tool._pretrain(str(log))
