"""Smoke tests of `tools/benchmark_fsdp.py`: two ranks as torchrun starts them, a small GPT,
every engine; each must report a sane row, and all must end at the same loss, to the bit (they
train the same model on the same data on every rank, so every average of gradients is exact: a
wrong average, a lost microbatch, a race between streams or a difference in precision shows up
there)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron.core.transformer.transformer_config import inductor_finds_cpp_compiler
from tests.unit_tests.program_launcher import run_program
from tests.unit_tests.tools.conftest import usage_error

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "benchmark_fsdp.py"
ENGINES = [
    "megatron_fsdp_zero3",
    "megatron_fsdp_zero2",
    "megatron_fsdp_no_shard",
    "fsdp2",
    "ddp",
    "single",
]
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --seq-length 32 "
    "--micro-batch-size 2 --num-microbatches 2 --warmup-steps 1 --steps 2 --lr 1e-3"
).split()
# lr 1e-3 moves the loss by ~0.45 in the 3 steps (the model memorises its 2 microbatches).


def run_tool(
    *args: str,
    nproc: int | None = 2,
    timeout: float = 120,
    tool: Path = TOOL,
    cuda: bool = False,
    tmpdir: Path | None = None,
) -> subprocess.CompletedProcess:
    """Runs `tool` (as torchrun runs it when `nproc` is given: `run_program`) from the
    repository root, on CPU unless `cuda` (GPU tests): the tools default to CUDA wherever there
    is a GPU, and a CPU test's ranks may outnumber the GPUs of the machine the suite runs on.
    `tmpdir` becomes the tool's temporary directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return run_program(tool, list(args), nproc=nproc, env=env, cwd=REPO, timeout=timeout)


def check_needs_gpus(tool: Path) -> None:
    """Without CUDA, `tool` (which times NCCL collectives) exits with a usage error saying so."""
    proc = run_tool(nproc=None, tool=tool)
    assert proc.returncode == 2
    assert "it times NCCL collectives: run it on GPUs." in proc.stderr


def run_every_engine(tmp_path: Path, *args: str, cuda: bool = False) -> dict[str, dict]:
    """Runs every engine on 2 ranks; checks each row is sane and returns the rows by engine."""
    out = tmp_path / "result.json"
    flags = ["--engines", ",".join(ENGINES), "--json-out", str(out)]
    proc = run_tool(*args, *flags, timeout=300, cuda=cuda)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["world_size"] == 2
    rows = {row["engine"]: row for row in result["rows"]}
    assert list(rows) == ENGINES
    for name, row in rows.items():
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0, name
        assert math.isfinite(row["loop_ms"]) and row["loop_ms"] > 0, name
        assert math.isfinite(row["final_loss"]), name
        assert row["vs_single"] is not None and math.isfinite(row["vs_single"]), name
    assert rows["single"]["vs_single"] == 1.0
    # The table went to stdout too, one line per engine.
    assert all(any(line.startswith(name) for line in proc.stdout.splitlines()) for name in ENGINES)
    return rows


def assert_same_loss(rows: dict[str, dict]) -> None:
    reference = rows["single"]["final_loss"]
    assert {name: row["final_loss"] for name, row in rows.items()} == dict.fromkeys(
        ENGINES, reference
    )


def test_every_engine_reports_a_row_and_the_same_loss(tmp_path):
    # bf16: the mixed-precision path of every engine (the other launches here run fp32).
    rows = run_every_engine(tmp_path, *TINY, "--bf16")
    for row in rows.values():  # CPU
        assert row["peak_gib"] is None and row["peak_requested_gib"] is None
    assert_same_loss(rows)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
@pytest.mark.parametrize("fusion", [True, False], ids=["fused-wgrad", "autograd-wgrad"])
def test_every_engine_trains_bitwise_like_one_gpu_with_deterministic_kernels(tmp_path, fusion):
    # Enough work per layer that the side streams' collectives run under the compute stream's
    # kernels, where a missing wait would read or overwrite memory in use. (Flags given after
    # TINY's override them.)
    model = (
        "--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --vocab-size 4096 "
        "--seq-length 1024 --micro-batch-size 2 --num-microbatches 2 --steps 4"
    ).split()
    # Unfused, torch's own AdamW steps every engine's main weights (the fused one's Triton
    # kernel is equal to torch's up to fp32 rounding), so FSDP2 computes the same bits too.
    flags = [] if fusion else ["--no-gradient-accumulation-fusion", "--adamw", "foreach"]
    rows = run_every_engine(tmp_path, *TINY, *model, "--bf16", "--deterministic", *flags, cuda=True)
    # Every block holds at least the bytes asked for, so neither peak can pass the other's.
    assert all(0 < row["peak_requested_gib"] <= row["peak_gib"] for row in rows.values())
    if not fusion:
        assert_same_loss(rows)
        return
    # With fusion this project's engines write each weight gradient as the fp32 output of its
    # GEMM on CUDA (FSDP2's stay bf16 GEMM outputs, upcast for its reduction) and step with the
    # fused kernel, so FSDP2 computes another step (checked to the bit unfused, above).
    reference = rows["single"]["final_loss"]
    fused = {name: row["final_loss"] for name, row in rows.items() if name != "fsdp2"}
    assert fused == dict.fromkeys(fused, reference)


def test_accumulation_options_train_like_one_rank_and_report_their_memory(tmp_path):
    out = tmp_path / "result.json"
    options = [
        "--megatron-fsdp-keep-unsharded-params",
        "--megatron-fsdp-accumulate-unsharded-grads",
    ]
    engines = ["--engines", "megatron_fsdp_zero3,single", "--json-out", str(out)]
    proc = run_tool(*TINY, *options, *engines, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["engine"]: row["final_loss"] for row in json.loads(out.read_text())["rows"]}
    assert rows["megatron_fsdp_zero3"] == rows["single"]
    for option in ("keep_unsharded_params", "accumulate_unsharded_grads"):
        assert f"megatron_fsdp_zero3: {option} holds up to" in proc.stdout, option


def test_hybrid_engines_train_like_zero3_over_all_ranks(tmp_path):
    # 4 ranks: HSDP and HFSDP as 2 instances x 2, in the same run as ZeRO-3 over all 4 (which
    # its adapter would refuse were parallel_state still holding the instances).
    engines = ["megatron_fsdp_zero3", "megatron_fsdp_hsdp", "megatron_fsdp_hfsdp"]
    out = tmp_path / "result.json"
    flags = ["--engines", ",".join(engines), "--json-out", str(out)]
    proc = run_tool(*TINY, *flags, nproc=4, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["world_size"] == 4
    assert result["config"]["num_distributed_optimizer_instances"] == 2
    rows = {row["engine"]: row for row in result["rows"]}
    assert list(rows) == engines
    layouts = {name: row["layout"] for name, row in rows.items()}
    assert layouts == dict(zip(engines, ["ZeRO-3 over 4", "HSDP 2 x 2", "HFSDP 2 x 2"]))
    assert all(f"{name} [{layouts[name]}]:" in proc.stdout for name in engines)
    reference = rows["megatron_fsdp_zero3"]["final_loss"]
    assert math.isfinite(reference)
    assert {name: row["final_loss"] for name, row in rows.items()} == dict.fromkeys(
        engines, reference
    )


@pytest.fixture
def benchmark_fsdp(import_tool):
    """The tool's module, imported here (its parser reads the world size from WORLD_SIZE)."""
    return import_tool("benchmark_fsdp")


@pytest.mark.parametrize(
    "flags, world, message",
    [
        ("--engines megatron_fsdp_hsdp --num-distributed-optimizer-instances 3", 4, "R >= 2"),
        ("--engines megatron_fsdp_hfsdp --num-distributed-optimizer-instances 1", 4, "R >= 2"),
        ("--engines megatron_fsdp_hsdp", 2, "instances of two or more ranks"),
        ("--engines megatron_fsdp_hfsdp", 1, "instances of two or more ranks"),
        ("--engines ddp --num-distributed-optimizer-instances 2", 4, "megatron_fsdp_hsdp and"),
        ("--engines megatron_fsdp_hsdp --cuda-graph --device cuda", 4, "--cuda-graph needs"),
        ("--engines fsdp2 --cuda-graph --device cpu", 2, "--cuda-graph needs CUDA and engines"),
        ("--engines megatron_fsdp_zero2 --megatron-fsdp-keep-unsharded-params", 2, "ZeRO-3"),
        ("--engines fsdp2,zero4", 2, "'fsdp2,zero4'"),
        ("--use-symm-mem --device cpu", 2, "--use-symm-mem needs CUDA"),
        ("--rounds 0", 2, "--rounds 0: give 1 or more"),
    ],
)
def test_bad_flags_are_usage_errors(benchmark_fsdp, monkeypatch, capsys, flags, world, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit):
        benchmark_fsdp.parse_args(flags.split())
    assert message in capsys.readouterr().err


def test_the_loop_time_runs_its_steps_back_to_back(benchmark_fsdp, monkeypatch):
    """`loop_ms` times steps as a training loop runs them: one synchronisation before the first
    step and one after the last, none between (each step's host work may then run while the
    GPU still computes the steps before it)."""
    events = []
    monkeypatch.setattr(benchmark_fsdp, "synchronize", lambda device: events.append("sync"))
    seconds = benchmark_fsdp.time_loop(
        lambda batches: events.append("step"), [], 3, torch.device("cpu")
    )
    assert events == ["sync", "step", "step", "step", "sync"]
    assert seconds > 0


def test_hybrid_engines_default_to_two_instances(benchmark_fsdp, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = benchmark_fsdp.parse_args(["--engines", "megatron_fsdp_zero3,megatron_fsdp_hfsdp"])
    assert args.num_distributed_optimizer_instances == 2
    assert "megatron_fsdp_hsdp" not in benchmark_fsdp.parse_args([]).engines


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_cuda_graph_replays_train_like_eager_steps(tmp_path):
    engines = ["megatron_fsdp_zero3", "megatron_fsdp_zero2", "single"]
    # Graph mode trains 3 eager warm-up steps before capture, then replays 1 + 2 (TINY's
    # warm-up and timed steps); eager mode runs the same 6 steps with --steps 5. Deterministic
    # kernels: a replay runs the captured kernels, so it must train to the bit as eager steps do.
    modes = {"eager": ["--steps", "5"], "graph": ["--cuda-graph"]}
    losses = {}
    for mode, extra in modes.items():
        out = tmp_path / f"{mode}.json"
        engine_list = ",".join(engines)
        flags = [*TINY, "--bf16", "--deterministic", "--engines", engine_list, *extra]
        proc = run_tool(*flags, "--json-out", str(out), cuda=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = json.loads(out.read_text())["rows"]
        losses[mode] = {row["engine"]: row["final_loss"] for row in rows}
    for name in engines:
        expected = losses["eager"][name]
        assert losses["graph"][name] == expected, name


def test_fp8_format_times_each_engine_in_bf16_then_fp8(tmp_path):
    """`--fp8-format`: a bf16 row, then an FP8 row, per engine; the FP8 rows agree with each
    other to the bit as the bf16 ones do (the one-rank engine reduces its amaxes over itself:
    over all ranks its collectives would wait for ranks that run nothing) and differ from them;
    with `--fp8-only`, the FP8 rows alone, with the same losses."""
    out = tmp_path / "result.json"
    flags = ["--engines", "megatron_fsdp_zero3,ddp,single", "--json-out", str(out)]
    proc = run_tool(*TINY, "--fp8-format", "hybrid", *flags, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    names = ["megatron_fsdp_zero3", "ddp", "single"]
    assert list(rows) == [f"{name}{suffix}" for name in names for suffix in ("", " fp8")]
    bf16 = {rows[name]["final_loss"] for name in names}
    fp8 = {rows[f"{name} fp8"]["final_loss"] for name in names}
    assert len(bf16) == 1 and len(fp8) == 1 and bf16 != fp8
    assert "FP8 (hybrid, delayed)" in rows["single fp8"]["precision"]
    # `--fp8-only`: the FP8 rows alone, training as they do beside their twins.
    proc = run_tool(*TINY, "--fp8-format", "hybrid", "--fp8-only", *flags, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    alone = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(alone) == [f"{name} fp8" for name in names]
    assert {row["final_loss"] for row in alone.values()} == fp8


def test_fp8_only_needs_fp8_format(import_tool, capsys):
    parse = import_tool("benchmark_fsdp").parse_args
    err = usage_error(lambda: parse([*TINY, "--fp8-only"]), capsys)
    assert "--fp8-only leaves out the bf16 twin of an FP8 run: give --fp8-format too." in err


def test_rounds_repeat_every_engine_with_ratios_to_their_own_round(tmp_path):
    out = tmp_path / "result.json"
    flags = ["--engines", "megatron_fsdp_zero3,single", "--rounds", "2", "--json-out", str(out)]
    proc = run_tool(*TINY, *flags, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    names = [f"{name} r{r}" for r in (1, 2) for name in ("megatron_fsdp_zero3", "single")]
    assert [row["engine"] for row in rows] == names
    for row in rows:
        single = next(r for r in rows if r["engine"] == f"single r{row['round']}")
        assert row["vs_single"] == pytest.approx(row["step_ms"] / single["step_ms"])
    # Each round builds the engines afresh from the same seed: the same training.
    assert len({row["final_loss"] for row in rows}) == 1


@pytest.mark.skipif(
    not inductor_finds_cpp_compiler(), reason="inductor on CPU needs a C++ compiler"
)
def test_compiled_layers_compile_afresh_for_each_engine(tmp_path, monkeypatch):
    """Each engine's layers are a class of their own (the engines' unit subclasses): built one
    after another in one process, the compiled layer code would recompile for each and keep
    every engine's entry, tried in turn at each layer call, and run the layers uncompiled past
    dynamo's recompile limit. Each build starts afresh instead: nothing recompiles."""
    monkeypatch.setenv("TORCH_LOGS", "recompiles")
    out = tmp_path / "result.json"
    flags = ["--engines", "megatron_fsdp_zero3,single", "--compile-layers", "--json-out", str(out)]
    proc = run_tool(*TINY, *flags, nproc=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Recompiling function" not in proc.stderr, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(math.isfinite(row["final_loss"]) for row in rows)
