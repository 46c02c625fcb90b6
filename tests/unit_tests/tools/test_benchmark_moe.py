"""Smoke tests of `tools/benchmark_moe.py`: a tiny MoE GPT on two ranks through torchrun, at EP 2
and EP 1 under Megatron-FSDP and under FSDP2; every row is sane and every engine trains the same
model on the same data, so all must end at the same loss (to rounding: the expert outputs are
summed in another order when tokens come back from other ranks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_moe.py"
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --seq-length 32 "
    "--num-experts 4 --moe-ffn-hidden-size 48 --micro-batch-size 2 --num-microbatches 2 "
    "--warmup-steps 1 --steps 2 --lr 1e-3"
).split()


def test_every_expert_parallel_size_reports_a_row_and_the_same_loss(tmp_path: Path):
    out = tmp_path / "result.json"
    engines = "megatron_fsdp_zero3,ddp,fsdp2"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = run_tool(
        *TINY, "--engines", engines, "--json-out", str(out), tool=TOOL, timeout=300, tmpdir=scratch
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(scratch.glob("benchmark_moe_*")), "the run left its trace directory behind"
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    expected = ["megatron_fsdp_zero3_ep2", "megatron_fsdp_zero3_ep1", "ddp_ep2", "ddp_ep1"]
    assert list(rows) == [*expected, "fsdp2"]
    for name, row in rows.items():
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0, name
        assert row["tflops_per_s_per_gpu"] > 0, name
        assert row["all_to_all_ms"] is None, name  # measured on GPUs only
        assert row["tokens_vs_fsdp2"] == pytest.approx(
            row["tokens_per_s_per_gpu"] / rows["fsdp2"]["tokens_per_s_per_gpu"]
        )
    reference = rows["fsdp2"]["final_loss"]
    for name, row in rows.items():
        assert row["final_loss"] == pytest.approx(reference, rel=1e-5), name


def test_expert_parallel_size_must_divide_the_experts(import_tool, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = import_tool("benchmark_moe")
    message = usage_error(lambda: tool.parse_args([*TINY, "--expert-parallel-sizes", "3"]), capsys)
    assert "--expert-parallel-sizes" in message


def test_a_graphed_step_with_expert_parallelism_asks_for_the_padded_exchange(
    import_tool, monkeypatch, capsys
):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for each of 2 ranks
    tool = import_tool("benchmark_moe")
    flags = [
        *TINY, "--device", "cuda", "--cuda-graph", "--engines", "megatron_fsdp_zero3",
        "--expert-parallel-sizes", "2",
    ]  # fmt: skip
    message = usage_error(lambda: tool.parse_args(flags), capsys)
    assert "add --moe-pad-dispatch-to-worst-case" in message, message[-2000:]
