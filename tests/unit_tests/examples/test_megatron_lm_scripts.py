"""Upstream Megatron-LM's launch scripts, scaled down in `examples/megatron_lm/` with their flag
sets unchanged: each parses with no unknown flag, and each either trains on 2 CPU ranks or stops
with an error that names the feature it asks for and this project does not build."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training.arguments import add_megatron_arguments
from megatron.training.training import pretrain
from tests.unit_tests.distributed_harness import run_distributed

ROOT = pathlib.Path(__file__).resolve().parents[3]
PRINT_ARGV = pathlib.Path(__file__).with_name("print_argv.py")


def _positional(script: str, tmp: pathlib.Path) -> list[str]:
    """The script's own arguments (checkpoint and log folders under `tmp`, mock data)."""
    if script == "gpt_oss.sh":
        return ["--checkpoint-path", str(tmp)]
    if script in ("gpt3_175b.sh", "llama3_8b_fp8.sh", "llama3_8b_fsdp_fp8.sh"):
        return [str(tmp / "checkpoints"), str(tmp / "tensorboard")]
    if script == "mixtral_8x7b.sh":
        return [str(tmp / "checkpoints")]
    return []


def script_flags(script: str, tmp: pathlib.Path, env: dict[str, str] | None = None) -> list[str]:
    """The flags `script` passes to pretrain_gpt.py, read by running it with a launcher that
    prints its arguments."""
    environment = dict(
        os.environ,
        LAUNCHER=f"{sys.executable} {PRINT_ARGV}",
        OUTPUT_PATH=str(tmp / "output"),
        DATA_CACHE_PATH=str(tmp / "cache"),
        **(env or {}),
    )
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / "megatron_lm" / script), *_positional(script, tmp)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    argv = json.loads(done.stdout.strip().splitlines()[-1])
    return argv[argv.index("pretrain_gpt.py") + 1 :]


SCRIPTS = sorted(path.name for path in (ROOT / "examples" / "megatron_lm").glob("*.sh"))

OUTCOMES: dict[tuple[str, tuple[tuple[str, str], ...], tuple[str, ...]], str | None] = {
    ("gpt3_175b.sh", (), ()): "tensor and pipeline parallelism are not supported",
    ("llama3_8b_fp8.sh", (), ()): "FP8",
    ("llama3_8b_fp8.sh", (("DTYPE", "bf16"),), ()): "--profile without --use-pytorch-profiler",
    (
        "llama3_8b_fp8.sh",
        (("DTYPE", "bf16"),),
        ("--attention-backend", "auto", "--use-pytorch-profiler"),
    ): None,
    ("llama3_8b_fsdp_fp8.sh", (), ()): "FP8",
    (
        "llama3_8b_fsdp_fp8.sh",
        (("DTYPE", "bf16"),),
        (),
    ): "--attention-backend fused needs a CUDA GPU",
    ("llama3_8b_fsdp_fp8.sh", (("DTYPE", "bf16"),), ("--attention-backend", "auto")): None,
    ("mixtral_8x7b.sh", (), ()): "Mixture of Experts is not built",
    ("deepseek_v3_fsdp.sh", (), ()): "Mixture of Experts is not built",
    ("gpt_oss.sh", (), ()): "Mixture of Experts is not built",
}
"""What each script does on 2 CPU ranks, with the environment and extra flags given: None
trains; otherwise a part of the error it stops with. The Llama-3 scripts ask for cuDNN's fused
attention, which a CPU lacks, and the H100 one for an nsys profile (`--profile` alone): with
`--attention-backend auto` (and `--use-pytorch-profiler`) added after their own flags (argparse
keeps the last value) the rest of their flags train."""


def test_every_upstream_script_is_here():
    assert {script for script, _, _ in OUTCOMES} == set(SCRIPTS)
    assert len(SCRIPTS) == 6


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_with_no_unknown_flag(script, tmp_path):
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    for name, env, _ in OUTCOMES:
        if name == script:
            _, unknown = parser.parse_known_args(script_flags(script, tmp_path, dict(env)))
            assert unknown == [], f"{script} passes flags this project does not know: {unknown}"


def _pretrain(flags: list[str]) -> int:
    """Trains with `flags` on this rank; the iteration it reached."""
    history = pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        argv=[*flags, "--distributed-backend", dist.get_backend()],
    )
    return len(history.loss_curve())


def _refusal(flags: list[str]) -> str:
    """The error message pretrain stops with on this rank (fails if it trains)."""
    with pytest.raises(ValueError) as error:
        _pretrain(flags)
    return str(error.value)


@pytest.mark.parametrize(("script", "env", "extra"), list(OUTCOMES), ids=str)
def test_script_trains_or_names_what_is_not_built(script, env, extra, tmp_path):
    # The harness's ranks are daemon processes, which cannot start dataloader workers.
    flags = [*script_flags(script, tmp_path, dict(env)), *extra, "--num-workers", "0"]
    expected = OUTCOMES[(script, env, extra)]
    if expected is None:
        for iterations in run_distributed(_pretrain, 2, flags):
            assert iterations > 0
        return
    for message in run_distributed(_refusal, 2, flags):
        assert expected in message, message
