"""Upstream Megatron-LM's launch scripts, scaled down in `examples/megatron_lm/` with their flag
sets unchanged: each parses with no unknown flag, and each either trains on 2 CPU ranks or stops
with an error that names the feature it asks for and this project does not build. Upstream's
GPT-3 175B script, at its own sizes in `examples/gpt3/`, validates as written and trains scaled
down with tensor parallelism 2."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training.arguments import add_megatron_arguments, parse_args, validate_args
from megatron.training.checkpoint_layout import TRACKER_FILENAME
from megatron.training.global_vars import set_args
from megatron.training.training import TrainingHistory, pretrain
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.log_capture import capture_training_log

ROOT = pathlib.Path(__file__).resolve().parents[3]
PRINT_ARGV = pathlib.Path(__file__).with_name("print_argv.py")
GPT3 = "train_gpt3_175b_distributed.sh"


def _positional(script: str, tmp: pathlib.Path) -> list[str]:
    """The script's own arguments (checkpoint and log folders under `tmp`, mock data)."""
    if script == "gpt_oss.sh":
        # Its TensorBoard folder defaults to ./tensorboard_logs/, which it creates.
        return ["--checkpoint-path", str(tmp), "--tensorboard-logs-path", str(tmp / "tensorboard")]
    if script in (GPT3, "llama3_8b_fp8.sh", "llama3_8b_fsdp_fp8.sh"):
        return [str(tmp / "checkpoints"), str(tmp / "tensorboard")]
    if script == "mixtral_8x7b.sh":
        return [str(tmp / "checkpoints")]
    return []


def script_flags(
    script: str,
    tmp: pathlib.Path,
    env: dict[str, str] | None = None,
    folder: str = "megatron_lm",
) -> list[str]:
    """The flags `examples/<folder>/<script>` passes to pretrain_gpt.py, read by running it
    with a launcher that prints its arguments."""
    environment = dict(
        os.environ,
        LAUNCHER=f"{sys.executable} {PRINT_ARGV}",
        OUTPUT_PATH=str(tmp / "output"),
        DATA_CACHE_PATH=str(tmp / "cache"),
        **(env or {}),
    )
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / folder / script), *_positional(script, tmp)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    argv = json.loads(done.stdout.strip().splitlines()[-1])
    return argv[argv.index("pretrain_gpt.py") + 1 :]


SCRIPTS = sorted(path.name for path in (ROOT / "examples" / "megatron_lm").glob("*.sh"))

CPU_FLAGS = {
    "llama3_8b_fp8.sh": ("--attention-backend", "auto", "--use-pytorch-profiler"),
    "llama3_8b_fsdp_fp8.sh": ("--attention-backend", "auto"),
}
"""What the Llama-3 FP8 scripts need added to train on CPU (see `OUTCOMES`)."""


OUTCOMES: dict[tuple[str, tuple[tuple[str, str], ...], tuple[str, ...]], str | None] = {
    ("llama3_8b_fp8.sh", (), ()): "--profile without --use-pytorch-profiler",
    ("llama3_8b_fp8.sh", (), CPU_FLAGS["llama3_8b_fp8.sh"]): None,
    ("llama3_8b_fp8.sh", (("DTYPE", "bf16"),), ()): "--profile without --use-pytorch-profiler",
    ("llama3_8b_fp8.sh", (("DTYPE", "bf16"),), CPU_FLAGS["llama3_8b_fp8.sh"]): None,
    ("llama3_8b_fsdp_fp8.sh", (), ()): "--attention-backend fused needs a CUDA GPU",
    ("llama3_8b_fsdp_fp8.sh", (), CPU_FLAGS["llama3_8b_fsdp_fp8.sh"]): None,
    (
        "llama3_8b_fsdp_fp8.sh",
        (("DTYPE", "bf16"),),
        (),
    ): "--attention-backend fused needs a CUDA GPU",
    ("llama3_8b_fsdp_fp8.sh", (("DTYPE", "bf16"),), CPU_FLAGS["llama3_8b_fsdp_fp8.sh"]): None,
    ("mixtral_8x7b.sh", (), ()): "--pipeline-model-parallel-size 4 = 4; launch a multiple of 4",
    ("deepseek_v3_fsdp.sh", (), ()): "the flex token dispatcher (DeepEP / HybridEP / NCCL EP)",
    ("gpt_oss.sh", (), ()): "--transformer-impl transformer_engine: transformer-engine is not",
}
"""What each script does on 2 CPU ranks, with the environment and extra flags given: None
trains; otherwise a part of the error it stops with. The Llama-3 scripts ask for cuDNN's fused
attention, which a CPU lacks, and the H100 one for an nsys profile (`--profile` alone): with
`--attention-backend auto` (and `--use-pytorch-profiler`) added after their own flags (argparse
keeps the last value) the rest of their flags train, their FP8 setting (`DTYPE=fp8`) included:
FP8 parameter all-gathers (`--fp8-param-gather`) under Megatron-FSDP in the FSDP script and
under the DDP engine's distributed optimizer in the other (`test_fp8_scripts_train_in_fp8`).
Mixtral asks for 4 pipeline stages by default, more than 2 ranks hold; with `PP=1` it trains (see
`test_mixtral_trains_with_expert_parallelism_...`). gpt-oss asks for Transformer Engine, flash
attention and 2 pipeline stages; without them it trains (`test_gpt_oss_trains_...`). DeepSeek-V3
asks for the flex token dispatcher, Transformer Engine and flash attention; without them it
trains (`test_deepseek_v3_trains_...`)."""


def test_every_upstream_script_is_here():
    assert {script for script, _, _ in OUTCOMES} == set(SCRIPTS)
    assert len(SCRIPTS) == 5


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_with_no_unknown_flag(script, tmp_path):
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    for name, env, _ in OUTCOMES:
        if name == script:
            _, unknown = parser.parse_known_args(script_flags(script, tmp_path, dict(env)))
            assert unknown == [], f"{script} passes flags this project does not know: {unknown}"


def _history(flags: list[str]) -> TrainingHistory:
    """Trains with `flags` on this rank."""
    return pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        argv=[*flags, "--distributed-backend", dist.get_backend()],
    )


def _pretrain(flags: list[str]) -> int:
    """Trains with `flags` on this rank; the iteration it reached."""
    return len(_history(flags).loss_curve())


def _refusal(flags: list[str]) -> str:
    """The error message pretrain stops with on this rank (fails if it trains)."""
    with pytest.raises(ValueError) as error:
        _pretrain(flags)
    return str(error.value)


TRAINED_IN_FP8 = {(script, (), extra) for script, extra in CPU_FLAGS.items()}
"""The outcomes `test_fp8_scripts_train_in_fp8` trains (and checks more of): not trained twice."""


@pytest.mark.parametrize(
    ("script", "env", "extra"), [key for key in OUTCOMES if key not in TRAINED_IN_FP8], ids=str
)
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


@pytest.mark.parametrize("script", sorted(CPU_FLAGS))
def test_fp8_scripts_train_in_fp8(script, tmp_path):
    """Upstream's FP8 flags (hybrid, delayed scaling over a 1024-long amax history, max, and
    `--fp8-param-gather`, under Megatron-FSDP or the DDP engine's distributed optimizer): the
    run says it trains in FP8 and every loss is finite."""
    flags = script_flags(script, tmp_path)
    assert "--fp8-param-gather" in flags
    flags += [*CPU_FLAGS[script], "--num-workers", "0"]
    history, messages = run_distributed(_logged_history, 2, flags)[0]
    losses = history.loss_curve()
    assert len(losses) > 0 and all(math.isfinite(loss) for loss in losses)
    assert (
        "> FP8 (hybrid format, delayed scaling (amax history 1024, max, margin 0)) in the "
        "linear layers of 2 of 2 transformer layers" in "\n".join(messages)
    ), messages
    assert any("| fp8: hybrid delayed |" in message for message in messages)


def _moe_run(flags: list[str]) -> tuple[list[float], list[float]]:
    """The language-model and load-balancing loss curves of a run on this rank."""
    history = _history(flags)
    return history.loss_curve(), history.loss_curve("load_balancing_loss")


def test_mixtral_trains_with_expert_parallelism_and_its_loss_falls(tmp_path):
    """Upstream's Mixtral flags as written (MoE layers of 4 experts, top-2, alltoall, grouped
    GEMM, EP 2, aux loss, bf16, distributed optimizer), with one pipeline stage and a batch,
    learning rate and length that let the tiny model learn: the loss falls, and the
    load-balancing loss is reported every step."""
    flags = [
        *script_flags("mixtral_8x7b.sh", tmp_path, {"PP": "1"}),
        # Larger batches and a higher learning rate than the script's 4 iterations at 1e-4.
        *(
            "--num-workers 0 --micro-batch-size 4 --global-batch-size 16 --lr 3e-3 "
            "--min-lr 3e-4 --train-iters 20 --lr-decay-iters 20 --eval-interval 1000 "
            "--save-interval 1000"
        ).split(),
    ]
    ranks = run_distributed(_moe_run, 2, flags)
    losses, balancing = ranks[0]
    assert ranks[1] == ranks[0]  # averaged over the data-parallel ranks: the same on both
    assert sum(losses[-4:]) / 4 < losses[0] - 0.5, losses
    # Megatron-core's load-balancing loss is 1 for an evenly balanced router, at most 4 here.
    assert all(0.5 < value < 4 for value in balancing), balancing


def test_gpt3_175b_validates_at_its_own_sizes(tmp_path):
    """Upstream's 175B flags as written (TP 8 on each node of 8 GPUs, 16 pipeline stages): they
    validate on 128 ranks, and the GPT-2 vocabulary pads to 51200 rows, the size Megatron-LM
    reports for it at TP 8 (a multiple of 128 x 8)."""
    flags = [*script_flags(GPT3, tmp_path, folder="gpt3"), "--distributed-backend", "gloo"]
    args = validate_args(parse_args(args=flags), world_size=128)
    sizes = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    assert (*sizes, args.data_parallel_size) == (8, 16, 1)
    assert (args.num_layers, args.hidden_size, args.fp16) == (96, 12288, True)
    assert args.padded_vocab_size == 51200


GPT3_SCALED_DOWN = [
    "--step-batch-size-schedule",
    "0:4 64:8",
    *"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --global-batch-size 8 "
    "--train-iters 4 --lr-decay-iters 4 --log-interval 1 --save-interval 2 --eval-interval 2 "
    "--eval-iters 1 --vocab-size 512 --num-workers 0".split(),
]
"""The 175B run at a size 2 CPU ranks train in seconds: tiny model and batch, 4 iterations;
the rest of upstream's flags (fp16, Adam, clipping, cosine decay, the batch-size ramp, saves,
evaluation) as written."""


def _logged_history(flags: list[str]) -> tuple[TrainingHistory, list[str]]:
    with capture_training_log() as messages:
        history = _history(flags)
    return history, messages


def _whole_model_parameters(flags: list[str]) -> int:
    """The parameter count of the model `flags` describe at TP 1 (built here, no ranks)."""
    args = validate_args(parse_args(args=[*flags, "--distributed-backend", "gloo"]), world_size=1)
    set_args(args)
    try:
        return sum(param.numel() for param in pretrain_gpt.model_provider().parameters())
    finally:
        set_args(None)


def test_gpt3_175b_scaled_down_trains_with_tensor_parallelism(tmp_path):
    """Needs the tensor-parallel model: TP 2 on 2 ranks (one data-parallel rank). Each rank
    holds part of the weights, and both report the same losses."""
    flags = [
        *script_flags(GPT3, tmp_path, {"TP": "2", "PP": "1"}, folder="gpt3"),
        *GPT3_SCALED_DOWN,
    ]
    ranks = run_distributed(_logged_history, 2, flags)
    curves = [history.loss_curve() for history, _ in ranks]
    assert len(curves[0]) == 4
    assert all(math.isfinite(loss) for loss in curves[0])
    # The two ranks are the tensor-parallel halves of one model: they report one loss.
    assert curves[1] == curves[0]
    logged = next(m for m in ranks[0][1] if m.startswith("> number of parameters"))
    match = re.match(r"> number of parameters on tensor-parallel rank 0 of 2: ([\d,]+)", logged)
    assert match, logged
    whole = _whole_model_parameters([*flags, "--tensor-model-parallel-size", "1"])
    # The split weights (QKV, projections, MLP, vocabulary) hold most of the parameters.
    assert int(match[1].replace(",", "")) < 0.6 * whole, (logged, whole)


def _two_stage_runs(mixtral: list[str], gpt3: list[str]) -> list[list[float]]:
    return [_history(mixtral).loss_curve(), _history(gpt3).loss_curve()]


def test_mixtral_and_gpt3_train_at_two_pipeline_stages(tmp_path):
    """Upstream's Mixtral (EP 1 here: a stage per rank) and scaled-down 175B flags at 2
    pipeline stages on 2 ranks: every loss finite, the same on both stages."""
    mixtral = [
        *script_flags("mixtral_8x7b.sh", tmp_path / "mixtral", {"PP": "2", "EP": "1"}),
        "--num-workers",
        "0",
    ]
    gpt3 = script_flags(GPT3, tmp_path / "gpt3", {"PP": "2", "TP": "1"}, folder="gpt3")
    gpt3 += GPT3_SCALED_DOWN
    ranks = run_distributed(_two_stage_runs, 2, mixtral, gpt3)
    assert ranks[1] == ranks[0]
    for curve in ranks[0]:
        assert curve and all(math.isfinite(loss) for loss in curve), curve


FLASH_ATTENTION_REFUSED = "--use-flash-attn needs a CUDA GPU"
"""How the refusal of flash attention on ranks that compute on the CPU starts (it goes on to say
why: no GPU, or gloo on a machine with GPUs)."""


def _refusal_messages(flags: list[str]) -> list[str]:
    """The flag errors validation reports for `flags` on 2 ranks (fails if they validate)."""
    with pytest.raises(ValueError) as error:
        validate_args(parse_args(args=[*flags, "--distributed-backend", "gloo"]), world_size=2)
    return getattr(error.value, "messages", [str(error.value)])


def test_gpt_oss_stops_only_at_hardware_refusals(tmp_path):
    """Upstream's gpt-oss flags ask for Transformer Engine and flash attention (a CPU has
    neither): one message names the two, and nothing else is refused."""
    messages = _refusal_messages(script_flags("gpt_oss.sh", tmp_path))
    assert len(messages) == 2, messages
    assert messages[0].startswith("--transformer-impl transformer_engine: transformer-engine is")
    assert messages[1].startswith(FLASH_ATTENTION_REFUSED)


def test_gpt_oss_trains_with_those_dropped(tmp_path):
    """Upstream's gpt-oss flags, its 2 pipeline stages included, with the local layers and
    without flash attention (`test_gpt_oss_stops_only_at_...`): its preset's YaRN positions,
    sliding windows on alternate layers, learnable sinks, the clamped GLU, MoE with the alltoall
    dispatcher, FP8 with FP8 parameter all-gathers, recompute; every loss is finite and the
    preset says what it set."""
    flags = [flag for flag in script_flags("gpt_oss.sh", tmp_path) if flag != "--use-flash-attn"]
    flags += ["--transformer-impl", "local", "--num-workers", "0"]
    history, messages = run_distributed(_logged_history, 2, flags)[0]
    losses = history.loss_curve()
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses), losses
    assert any(
        message.startswith(
            "> --enable-gpt-oss (upstream's gpt-oss preset) sets "
            "--position-embedding-type yarn --rotary-scaling-factor 32.0"
        )
        for message in messages
    ), messages


DEEPSEEK_V3_CPU_FLAGS = ("--moe-token-dispatcher-type", "alltoall", "--transformer-impl", "local")
"""What replaces the DeepSeek-V3 script's hardware-bound choices on CPU (`--use-flash-attn`, a
switch no later flag turns off, is deleted from its flags)."""


def test_deepseek_v3_stops_only_at_hardware_refusals(tmp_path):
    """Upstream's DeepSeek-V3 flags ask for the flex token dispatcher (HybridEP), Transformer
    Engine and flash attention (a CPU has neither): one message names them, and nothing else is
    refused."""
    messages = _refusal_messages(script_flags("deepseek_v3_fsdp.sh", tmp_path))
    assert [message.split(":")[0] for message in messages[:3]] == [
        "--moe-token-dispatcher-type flex",
        "--transformer-impl transformer_engine",
        "--transformer-impl transformer_engine with --multi-latent-attention",
    ], messages
    assert len(messages) == 4 and messages[3].startswith(FLASH_ATTENTION_REFUSED), messages
    assert messages[3].endswith("use --attention-backend auto (or local / unfused)."), messages
    assert "the flex token dispatcher (DeepEP / HybridEP / NCCL EP) is not built" in messages[0]


def test_deepseek_v3_trains_with_those_dropped(tmp_path):
    """Upstream's DeepSeek-V3 flags with the alltoall dispatcher, the local layers and without
    flash attention (`test_deepseek_v3_stops_only_at_...`): multi-latent attention with YaRN,
    one multi-token prediction depth, a dense first layer then MoE layers (shared expert,
    sigmoid routing with the expert bias, group-limited top-k, the sequence-wise loss) at EP 2,
    bf16, Megatron-FSDP ZeRO-3 built on the meta device, recompute. Stopped after iteration 2
    and launched again as written, it loads its `fsdp_dtensor` checkpoint (under
    `--dist-ckpt-strictness log_all`) and trains to the end: every iteration's losses (the
    depth's included) are finite and the same on both ranks."""
    flags = [
        flag for flag in script_flags("deepseek_v3_fsdp.sh", tmp_path) if flag != "--use-flash-attn"
    ]
    for built in ("--multi-latent-attention", "--mtp-num-layers", "--init-model-with-meta-device"):
        assert built in flags
    flags += [*DEEPSEEK_V3_CPU_FLAGS, "--num-workers", "0"]
    tracker = tmp_path / "output" / "checkpoints" / TRACKER_FILENAME
    first = run_distributed(_history, 2, [*flags, "--exit-interval", "2"])
    assert tracker.read_text() == "2\n"
    second = run_distributed(_history, 2, flags)
    assert second[0].start_iteration == 2
    assert tracker.read_text() == "4\n"
    for histories in (first, second):
        losses = histories[0].losses
        assert len(losses) == 2, losses
        for step in losses:
            assert sorted(step) == ["lm loss", "mtp_1 loss", "seq_load_balancing_loss"], step
            assert all(math.isfinite(value) for value in step.values()), step
        assert histories[1].losses == losses
