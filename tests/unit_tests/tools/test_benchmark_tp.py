"""Smoke tests of `tools/benchmark_tp.py`: a tiny GPT on two ranks through torchrun, under
Megatron-FSDP at TP 2 (x FSDP 1) and TP 1 (x FSDP 2), FSDP2, and PyTorch's TP x FSDP2 composition.
Every row is sane; the Megatron-FSDP rows and FSDP2 train the same model from the same initial
weights (tensor-parallel initialisation draws the TP 1 weights) on the same data, so they end at
the same loss; PyTorch's model draws its own initial weights, so its loss is only finite."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.unit_tests.tools.conftest import usage_error
from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "benchmark_tp.py"
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --seq-length 32 "
    "--micro-batch-size 2 --num-microbatches 2 --warmup-steps 1 --steps 2 --lr 1e-3 "
    "--adamw foreach"
).split()


def test_every_tensor_parallel_size_reports_a_row_and_the_same_loss(tmp_path: Path):
    out = tmp_path / "result.json"
    engines = "megatron_fsdp,fsdp2,torch_2d"
    proc = run_tool(
        *TINY,
        "--sequence-parallel",
        "--engines",
        engines,
        "--json-out",
        str(out),
        tool=TOOL,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["megatron_fsdp_tp2", "megatron_fsdp_tp1", "fsdp2_tp1", "torch_2d_tp2"]
    for name, row in rows.items():
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0, name
        assert math.isfinite(row["final_loss"]), name
        assert row["mfu"] == pytest.approx(row["tflops_per_s_per_gpu"] / 989.0)
        assert row["tokens_vs_torch_2d"] == pytest.approx(
            row["tokens_per_s_per_gpu"] / rows["torch_2d_tp2"]["tokens_per_s_per_gpu"]
        )
    # Each GPU of a TP 2 group does half of its micro-batch's work.
    tp2, tp1 = rows["megatron_fsdp_tp2"], rows["megatron_fsdp_tp1"]
    assert tp2["tokens_per_s_per_gpu"] == pytest.approx(2 * 2 * 32 / (tp2["step_ms"] / 1e3) / 2)
    assert tp1["tokens_per_s_per_gpu"] == pytest.approx(2 * 2 * 32 / (tp1["step_ms"] / 1e3))
    reference = rows["fsdp2_tp1"]["final_loss"]
    for name in ("megatron_fsdp_tp2", "megatron_fsdp_tp1"):
        assert rows[name]["final_loss"] == pytest.approx(reference, rel=1e-5), name


def test_tensor_parallel_size_must_divide_the_heads(import_tool, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = import_tool("benchmark_tp")
    message = usage_error(lambda: tool.parse_args([*TINY, "--tensor-parallel-sizes", "3"]), capsys)
    assert "--tensor-parallel-sizes" in message


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_the_pytorch_model_has_the_benchmark_gpts_parameters(swiglu):
    """torch_2d times the same architecture: as many parameters as the benchmark GPT."""
    sys.path.insert(0, str(REPO / "tools"))
    from benchmark_lib.gpt_model import add_model_args, build_gpt
    from benchmark_lib.torch_2d_model import TorchGPT

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args([*TINY[:10], *(["--swiglu"] if swiglu else [])])
    with torch.device("meta"):
        ours = build_gpt(args)[1]
        theirs = TorchGPT(args)
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in ours.parameters())
