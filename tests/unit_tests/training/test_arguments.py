"""Command-line flags: defaults, derived values, accepted and rejected combinations (the configs
built from them: `test_configs_from_args.py`)."""

import argparse
import sys
import types
from pathlib import Path

import numpy
import pytest
import torch

from megatron.core.datasets import IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.extensions import transformer_engine
from megatron.training import flag_errors
from megatron.training.arguments import (
    add_megatron_arguments,
    get_megatron_ddp_config,
    parse_args,
    validate_args,
)
from megatron.training.flag_errors import InvalidFlagsError, report_flag_errors
from megatron.training.global_vars import build_tokenizer
from megatron.training.initialize import _with_defaults
from tests.unit_tests.training.flag_checks import BASE, FSDP, HFSDP, ZERO3
from tests.unit_tests.training.flag_checks import validated as validated_on

DOCS = Path(__file__).resolve().parents[3] / "docs" / "flags.md"


def validated(*flags: str, world_size: int = 4, base: tuple[str, ...] = tuple(BASE)):
    return validated_on(*flags, world_size=world_size, base=base)


def test_defaults_follow_megatron_except_transformer_impl():
    """Megatron-LM's defaults, but `--transformer-impl local` (Megatron-LM: transformer_engine),
    a deliberate difference documented in docs/flags.md: runs on CPU work without flags."""
    args = validated()
    expected = dict(
        position_embedding_type="learned_absolute",
        rotary_base=10000,
        make_vocab_size_divisible_by=128,
        normalization="LayerNorm",
        layernorm_epsilon=1e-5,
        add_bias_linear=True,
        untie_embeddings_and_output_weights=False,
        transformer_impl="local",
        hidden_dropout=0.1,
        attention_dropout=0.1,
        init_method_std=0.02,
        weight_decay=0.01,
        weight_decay_incr_style="constant",
        clip_grad=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        sgd_momentum=0.9,
        optimizer="adam",
        seed=1234,
        lr_decay_style="linear",
        lr_warmup_iters=0,
        lr_warmup_init=0.0,
        min_lr=0.0,
        check_for_nan_in_loss_and_grad=True,
        use_megatron_fsdp=False,
        data_parallel_sharding_strategy="optim_grads_params",
        outer_dp_sharding_strategy="no_shard",
        num_distributed_optimizer_instances=1,
        fsdp_all_gather_in_start_param_sync=True,
        create_all_gather_group=False,
        use_symm_mem=False,
        megatron_fsdp_main_params_dtype="fp32",
        megatron_fsdp_main_grads_dtype="auto",
        megatron_fsdp_grad_comm_dtype="auto",
        context_parallel_size=1,
        expert_model_parallel_size=1,
        distributed_timeout_minutes=10,
        split=None,
        num_workers=2,
        log_interval=100,
        eval_interval=None,
        eval_iters=100,
        tensorboard_log_interval=1,
        ckpt_format="torch_dist",
        no_load_optim=False,
        no_load_rng=False,
        finetune=False,
    )
    assert {name: getattr(args, name) for name in expected} == expected


def test_derived_values():
    args = validated()
    assert args.world_size == 4
    assert args.data_parallel_size == 4
    assert args.global_batch_size == 2 * 4  # micro x dp
    assert args.num_microbatches == 1
    assert args.kv_channels == 16
    assert args.ffn_hidden_size == 4 * 64
    assert args.num_query_groups == 4
    assert args.max_position_embeddings == 32
    assert args.padded_vocab_size == 128
    assert args.params_dtype == torch.float32
    assert args.lr_decay_iters == 10
    assert args.start_weight_decay == args.end_weight_decay == 0.01


def test_num_microbatches_follow_the_global_batch():
    args = validated("--global-batch-size", "24", world_size=4)
    assert (args.data_parallel_size, args.num_microbatches) == (4, 24 // (2 * 4))


@pytest.mark.parametrize("hidden", [64, 96, 128, 2048, 4096])
def test_swiglu_ffn_default_is_megatrons(hidden):
    args = validated("--hidden-size", str(hidden), "--swiglu")
    assert args.ffn_hidden_size == int((4 * hidden * 2 / 3) / 64) * 64


@pytest.mark.parametrize("flags, dtype", [("", torch.float32), ("--bf16", torch.bfloat16)])
def test_params_dtype(flags, dtype):
    assert validated(*flags.split()).params_dtype == dtype


def test_world_size_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = validate_args(parse_args(args=BASE))
    assert (args.world_size, args.data_parallel_size) == (8, 8)


def test_validate_is_idempotent():
    args = validated("--weight-decay-incr-style", "constant", "--swiglu")
    before = dict(vars(args))
    assert vars(validate_args(args, world_size=4)) == before


def test_parse_args_reads_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, "--hidden-size", "128"])
    assert parse_args().hidden_size == 128


def test_extra_args_provider_and_unknown_args():
    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--my-flag", type=int, default=3)
        return parser

    assert parse_args(provider, args=[*BASE, "--my-flag", "5"]).my_flag == 5
    assert parse_args(ignore_unknown_args=True, args=[*BASE, "--unknown", "1"]).num_layers == 2
    with pytest.raises(SystemExit):
        parse_args(args=[*BASE, "--unknown", "1"])
    with pytest.raises(SystemExit):  # no abbreviations: a typo must not pick another flag
        parse_args(args=[*BASE, "--hidden", "128"])


def test_no_weight_decay_cond_type_is_the_deprecated_spelling_of_apply_wd_to_qk_layernorm(
    capsys,
):
    assert validated().apply_wd_to_qk_layernorm is False
    flag = ("--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm")
    assert validated(*flag).apply_wd_to_qk_layernorm is True
    with pytest.raises(SystemExit):
        parse_args(args=[*BASE, "--no-weight-decay-cond-type", "qwen3_next"])
    assert "the only condition is apply_wd_to_qk_layernorm" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["override", "use-checkpoint"])
def test_opt_param_scheduler_flags_take_upstreams_dashed_spelling(name):
    attribute = f"{name.replace('-', '_')}_opt_param_scheduler"
    assert getattr(parse_args(args=[*BASE, f"--{name}-opt-param-scheduler"]), attribute)
    assert getattr(parse_args(args=[*BASE, f"--{name}-opt_param-scheduler"]), attribute)


def _flag_error_output(rank: int, monkeypatch, capsys, bad) -> str:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(flag_errors, "FLAG_ERROR_GRACE_S", 0.0)
    with pytest.raises(SystemExit) as exit_info, report_flag_errors():
        bad()
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def _invalid() -> None:
    raise InvalidFlagsError("--data-path x names no indexed dataset")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_flag_error_is_printed_by_rank_0_or_after_the_grace_by_the_rank_that_found_it(
    rank, monkeypatch, capsys
):
    """Before: a rank other than 0 exited silently after the grace, so an error only it found
    (a data path its node cannot see) ended the job with no message."""
    err = _flag_error_output(rank, monkeypatch, capsys, _invalid)
    prefix = "error:" if rank == 0 else f"error (rank {rank}):"
    assert err == f"{prefix} --data-path x names no indexed dataset\n"


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unknown_flag_is_printed_once_by_rank_0(rank, monkeypatch, capsys):
    """argparse's errors too (before: usage and error printed by every rank at once)."""
    err = _flag_error_output(rank, monkeypatch, capsys, lambda: parse_args(args=["--bogus"]))
    if rank == 0:
        assert err.startswith("usage:") and "error: unrecognized arguments: --bogus" in err
    else:
        assert err == "error (rank 1): unrecognized arguments: --bogus\n"


def test_no_fsdp_all_gather_in_start_param_sync():
    args = validated("--use-megatron-fsdp", "--no-fsdp-all-gather-in-start-param-sync")
    assert args.fsdp_all_gather_in_start_param_sync is False
    assert get_megatron_ddp_config(args).fsdp_all_gather_in_start_param_sync is False
    args = validated("--use-megatron-fsdp", "--fsdp-all-gather-in-start-param-sync")
    assert get_megatron_ddp_config(args).fsdp_all_gather_in_start_param_sync is True


@pytest.mark.parametrize(
    "flags",
    [
        "--position-embedding-type rope --max-position-embeddings 16",
        "--position-embedding-type none --max-position-embeddings 16",
        "--lr-decay-style constant --lr-warmup-iters 9",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
        "--weight-decay-incr-style linear --start-weight-decay 0 --end-weight-decay 0.1",
        "--lr-decay-style WSD --lr-wsd-decay-iters 5",
        "--group-query-attention --num-query-groups 1",
        "--num-query-groups 4",  # what it defaults to without --group-query-attention
        "--hidden-size 30 --kv-channels 8",
        f"{FSDP} --num-distributed-optimizer-instances 4",
        "--split 969,30,1",  # the default
        "--seed 0",
        f"--seed {2**31 - 3}",  # the test split draws with seed + 2 < 2**31
        "--context-parallel-size 1 --expert-model-parallel-size 1",
    ],
)
def test_accepted_combinations(flags):
    validated(*flags.split())


BAD = [
    ("--global-batch-size 6", "--global-batch-size 6 is not divisible by --micro-batch-size 2"),
    (
        "--context-parallel-size 2",
        r"attention_dropout=0.1 \(--attention-dropout\) with context_parallel_size=2 and "
        "cp_comm_type p2p",
    ),
    (
        "--context-parallel-size 2 --attention-dropout 0 --seq-length 6",
        "the sequence length 6 is not divisible by 2 x context-parallel size 2",
    ),
    (
        "--context-parallel-size 2 --attention-dropout 0 --cp-comm-type a2a "
        "--num-attention-heads 3 --hidden-size 48",
        "cp_comm_type a2a splits the attention heads over the 2 context-parallel ranks",
    ),
    ("--cp-comm-type p2p a2a", "--cp-comm-type p2p a2a: one value per layer is not built"),
    ("--cp-comm-type a2a+p2p", "a2a\\+p2p \\(hierarchical context parallelism"),
    (
        "--context-parallel-size 2 --mock-data --reset-attention-mask",
        "--reset-attention-mask with --context-parallel-size 2",
    ),
    (
        "--expert-model-parallel-size 2",
        "--expert-model-parallel-size 2 needs MoE layers; set --num-experts",
    ),
    (
        f"{FSDP} --num-distributed-optimizer-instances 3",
        "--num-distributed-optimizer-instances 3 does not divide",
    ),
    (
        f"{FSDP} --suggested-communication-unit-size 0",
        "--suggested-communication-unit-size must be a positive number of elements",
    ),
    (
        f"{FSDP} --data-parallel-sharding-strategy optim --outer-dp-sharding-strategy optim "
        "--num-distributed-optimizer-instances 2",
        "--outer-dp-sharding-strategy optim .* --data-parallel-sharding-strategy optim_grads_",
    ),
    (f"{ZERO3} --outer-dp-sharding-strategy optim", "--num-distributed-optimizer-instances > 1"),
    (
        f"{FSDP} --data-parallel-sharding-strategy optim_grads "
        "--megatron-fsdp-keep-unsharded-params",
        "--megatron-fsdp-keep-unsharded-params needs --data-parallel-sharding-strategy "
        "optim_grads_params \\(got 'optim_grads'",
    ),
    (
        f"{FSDP} --data-parallel-sharding-strategy optim "
        "--megatron-fsdp-accumulate-unsharded-grads",
        "--megatron-fsdp-accumulate-unsharded-grads needs sharded gradients, "
        "--data-parallel-sharding-strategy 'optim_grads' or 'optim_grads_params' \\(got 'optim'",
    ),
    ("--bf16 --fp16", "--fp16 and --bf16 are both given"),
    ("--hidden-size 30", "--hidden-size 30 .* --num-attention-heads 4; .* --kv-channels"),
    (
        "--group-query-attention --num-query-groups 3",
        "--num-attention-heads 4 is not divisible by --num-query-groups 3",
    ),
    ("--max-position-embeddings 16", "--seq-length 32 exceeds --max-position-embeddings 16"),
    ("--data-path corpus", "--mock-data and --data-path"),
    ("--lr-warmup-iters 10", r"--lr-warmup-iters 10 must be in \[0, --lr-decay-iters 10\)"),
    ("--lr-decay-style constant --lr-warmup-iters 10", "--lr-warmup-iters 10 must be in"),
    ("--lr-warmup-iters -1", "--lr-warmup-iters -1 must be in"),
    ("--lr-decay-iters 5 --lr-warmup-iters 7", "--lr-warmup-iters 7 .* --lr-decay-iters 5"),
    ("--ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor .* --use-megatron-fsdp"),
    ("--tensor-model-parallel-size 3", "world size 4 is not a multiple of --tensor-model-par"),
    (
        "--pipeline-model-parallel-size 2 --use-distributed-optimizer",
        "--pipeline-model-parallel-size 2 does not compose with --use-distributed-optimizer",
    ),
    ("--micro-batch-size 0", "--micro-batch-size must be >= 1"),
    ("--recompute-method uniform", "--recompute-method applies to --recompute-granularity full"),
    (
        "--recompute-granularity full --recompute-method block",
        "--recompute-granularity full needs --recompute-method .* and --recompute-num-layers",
    ),
    (
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 3",
        r"--recompute-num-layers 3 must be in \[1, --num-layers 2\]",
    ),
    ("--start-weight-decay 0.1", "--start-weight-decay needs --weight-decay-incr-style"),
    (
        "--weight-decay-incr-style cosine --end-weight-decay 0.1",
        "needs both --start-weight-decay and --end-weight-decay",
    ),
    ("--min-lr 0.1", r"--min-lr 0.1 must be in \[0, --lr 0.001\]"),
    ("--lr-warmup-init 0.1", "--lr-warmup-init 0.1 must be in"),
    ("--lr-decay-style WSD --lr-wsd-decay-iters 11", "--lr-decay-style WSD needs"),
    ("--lr-decay-iters 0", "--lr-decay-iters must be >= 1"),
    # OptimizerConfig's own checks, at validation and spelled as flags.
    ("--adam-beta1 1.5", r"--adam-beta1 1.5 must be in \[0, 1\)"),
    ("--adam-eps=-1", "--adam-eps -1.0 must be >= 0"),
    ("--clip-grad -1", "--clip-grad -1.0 must be >= 0"),
    ("--optimizer sgd --sgd-momentum -1", "--sgd-momentum -1.0 must be >= 0"),
    (
        "--weight-decay-incr-style linear --start-weight-decay 0.2 --end-weight-decay 0.1",
        r"--start-weight-decay \(0.2\) <= --end-weight-decay \(0.1\)",
    ),
    ("--lr-decay-style WSD", "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    ("--vocab-file vocab.json", "--vocab-file needs --tokenizer-type"),
    ("--hidden-size 16 --swiglu", "--swiglu .* set --ffn-hidden-size"),
    (
        f"{FSDP} --grad-reduce-in-fp32 --megatron-fsdp-main-grads-dtype bf16",
        "--grad-reduce-in-fp32 contradicts --megatron-fsdp-main-grads-dtype bf16",
    ),
    (f"{FSDP} --ddp-bucket-size 100", "--ddp-bucket-size 100 is read by the DDP engine only"),
    (
        f"{FSDP} --ddp-average-in-collective",
        "--ddp-average-in-collective is read by the DDP engine only",
    ),
    ("--save-interval 10", "--save-interval needs --save"),
    ("--save ckpt --save-interval 0", "--save-interval must be >= 1"),
    ("--finetune", "--finetune needs --load"),
    ("--exit-on-missing-checkpoint", "--exit-on-missing-checkpoint needs --load"),
    ("--ckpt-step 3", "--ckpt-step needs --load"),
    ("--load ckpt --ckpt-step -1", "--ckpt-step -1 must be >= 0"),
    (
        "--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler",
        "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are both",
    ),
    ("--eod-mask-loss", "--eod-mask-loss acts on end-of-document tokens, which --mock-data"),
    ("--reset-position-ids", "--reset-position-ids acts on end-of-document tokens"),
    ("--reset-attention-mask", "--reset-attention-mask acts on end-of-document tokens"),
    ("--seed -1", r"--seed -1 must be in \[0, 2147483645\] with --mock-data"),
    ("--seed 2147483646", r"--seed 2147483646 must be in \[0, 2147483645\]"),
    ("--ddp-bucket-size 0", "--ddp-bucket-size must be a positive number"),
    ("--log-interval 0", "--log-interval must be >= 1"),
    ("--eval-interval 0", "--eval-interval must be >= 1"),
    ("--exit-interval 0", "--exit-interval must be >= 1"),
    ("--eval-iters -1", "--eval-iters must be >= 0"),
    ("--num-workers -1", "--num-workers must be >= 0"),
]
"""(flags, regular expression the ValueError's message must contain)."""


@pytest.mark.parametrize("flags, message", BAD)
def test_bad_combination_names_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        validated(*flags.split())


@pytest.mark.parametrize(
    "flags",
    [
        "--data-parallel-sharding-strategy optim",
        "--outer-dp-sharding-strategy optim",
        "--num-distributed-optimizer-instances 2",
        "--no-fsdp-all-gather-in-start-param-sync",
        "--create-all-gather-group",
        "--use-symm-mem",
        "--suggested-communication-unit-size 1000000",
        "--overlap-param-gather",
        "--megatron-fsdp-main-params-dtype auto",
        "--megatron-fsdp-main-grads-dtype bf16",
        "--megatron-fsdp-grad-comm-dtype bf16",
        "--megatron-fsdp-keep-unsharded-params",
        "--megatron-fsdp-accumulate-unsharded-grads",
        "--init-model-with-meta-device",
    ],
)
def test_fsdp_flags_need_use_megatron_fsdp(flags):
    with pytest.raises(ValueError, match=f"{flags} needs Megatron-FSDP.*{FSDP}") as error:
        validated(*flags.split())
    # DistributedDataParallelConfig's own check, its field names spelled as the flags.
    message = str(error.value)
    assert "DistributedDataParallelConfig" not in message and "use_megatron_fsdp" not in message


def test_script_defaults_for_megatron_fsdp_are_accepted():
    script_defaults = dict(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_param_gather=True,
    )
    args = validate_args(parse_args(_with_defaults(None, script_defaults), args=BASE), 4)
    assert get_megatron_ddp_config(args).data_parallel_sharding_strategy == "optim_grads_params"
    with pytest.raises(ValueError, match="--overlap-param-gather needs Megatron-FSDP"):
        validate_args(parse_args(_with_defaults(None, {"overlap_param_gather": True}), args=BASE))


def test_fsdp_flags_accepted_with_use_megatron_fsdp():
    flags = (
        f"{HFSDP} --no-fsdp-all-gather-in-start-param-sync --create-all-gather-group "
        "--overlap-param-gather --megatron-fsdp-main-params-dtype auto "
        "--megatron-fsdp-main-grads-dtype bf16 --megatron-fsdp-grad-comm-dtype bf16 "
        "--init-model-with-meta-device --ckpt-format fsdp_dtensor"
    )
    validated(*flags.split())


def test_use_symm_mem_needs_cuda(cuda_unavailable):
    with pytest.raises(ValueError, match="--use-symm-mem needs CUDA"):
        validated(FSDP, "--use-symm-mem", "--distributed-backend", "nccl")


def test_use_symm_mem_needs_nccl(cuda_available):
    with pytest.raises(ValueError, match="--use-symm-mem needs --distributed-backend nccl"):
        validated(FSDP, "--use-symm-mem", "--distributed-backend", "gloo")
    validated(FSDP, "--use-symm-mem", "--distributed-backend", "nccl")


def test_nccl_needs_cuda(cuda_unavailable):
    with pytest.raises(ValueError, match="--distributed-backend gloo"):
        validated("--distributed-backend", "nccl")


def test_transformer_engine_must_be_importable(monkeypatch):
    monkeypatch.setattr(transformer_engine, "HAVE_TE", False)
    with pytest.raises(ValueError, match="--transformer-impl local"):
        validated("--transformer-impl", "transformer_engine")
    monkeypatch.setattr(transformer_engine, "HAVE_TE", True)
    assert validated("--transformer-impl", "transformer_engine").transformer_impl == (
        "transformer_engine"
    )


def test_missing_tensorboard_warns_and_goes_on(monkeypatch, tmp_path):
    # Megatron-LM's behaviour: a run without the package trains, unplotted.
    from megatron.training.training_log import MetricWriter
    from tests.unit_tests.training.log_capture import capture_training_log

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    args = validated("--tensorboard-dir", str(tmp_path))
    with capture_training_log() as messages:
        writer = MetricWriter(args)
    assert writer.tensorboard is None
    assert any("tensorboard package is not installed" in m for m in messages)


def test_wandb_must_be_importable_and_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match="--wandb-project needs the wandb package"):
        validated("--wandb-project", "p", "--wandb-exp-name", "e")
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    with pytest.raises(ValueError, match="--wandb-project needs --wandb-exp-name"):
        validated("--wandb-project", "p")
    validated("--wandb-project", "p", "--wandb-exp-name", "e")


def test_unknown_ckpt_format():
    args = parse_args(args=BASE)
    args.ckpt_format = "zarr"  # argparse's choices stop it on the command line
    with pytest.raises(ValueError, match="--ckpt-format zarr is unknown"):
        validate_args(args, world_size=1)


@pytest.fixture
def corpus(tmp_path) -> str:
    """The prefix of a one-document indexed dataset."""
    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    builder.add_document([1, 2, 3], lengths=[3])
    builder.finalize(get_idx_path(prefix))
    return prefix


BYTES = ("--tokenizer-type", "ByteLevelTokenizer")


@pytest.mark.parametrize(
    "flags, message",
    [
        ((), "No training data: pass --data-path PREFIX"),
        (("--data-path", "{corpus}"), "--data-path needs --tokenizer-type"),
        (
            ("--data-path", "{corpus}x", *BYTES),
            "--data-path / --split: Dataset prefix .*corpus_text_documentx.* names no indexed",
        ),
        (("--data-path", "0.5", "{corpus}", "0.5", *BYTES), "--data-path / --split: "),
        (("--data-path", "{corpus}", "--split", "9,x", *BYTES), "--data-path / --split: .*'x'"),
        (("--data-path", "{corpus}", "--seed", "-1", *BYTES), r"--seed -1 must be in \[0, 2\*\*32"),
        (("--mock-data", "--tokenizer-model", "m.model"), "--tokenizer-model needs --tokenizer"),
        (
            ("--data-path", "{corpus}", "--train-data-path", "{corpus}", *BYTES),
            "--data-path and --train-data-path are all data sources; choose one",
        ),
        (("--valid-data-path", "{corpus}", *BYTES), "--valid-data-path without --train-data-path"),
        (("--train-data-path", "{corpus}"), "--train-data-path needs --tokenizer-type"),
        (
            ("--train-data-path", "{corpus}", "--split", "9,1,0", *BYTES),
            "--split 9,1,0 divides --data-path's datasets; .* drop --split",
        ),
        (("--train-data-path", "{corpus}x", *BYTES), "--train-data-path: Dataset prefix"),
        (
            ("--mock-data", "--vocab-size", "100", "--dataloader-type", "cyclic"),
            "--dataloader-type cyclic is not built",
        ),
    ],
)
def test_training_data(corpus, flags, message):
    base = tuple(flag for flag in BASE if flag not in ("--mock-data", "--vocab-size", "100"))
    with pytest.raises(ValueError, match=message):
        validated(*(flag.format(corpus=corpus) for flag in flags), base=base)


def test_data_path_takes_the_vocabulary_from_the_tokenizer(corpus):
    base = tuple(flag for flag in BASE if flag not in ("--mock-data", "--vocab-size", "100"))
    args = validated("--data-path", corpus, *BYTES, "--split", "98,2,0", base=base)
    assert args.split == "98,2,0" and args.data_path == [corpus]
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == 259
    assert args.padded_vocab_size == 384  # 259 rounded up to --make-vocab-size-divisible-by 128


def test_mock_data_needs_vocab_size():
    base = tuple(BASE[: BASE.index("--vocab-size")] + BASE[BASE.index("--vocab-size") + 2 :])
    with pytest.raises(ValueError, match="--mock-data needs --vocab-size"):
        validated(base=base)


@pytest.mark.parametrize("missing", ["--num-layers", "--seq-length", "--train-iters", "--lr"])
def test_required_flags(missing):
    base = tuple(BASE[: BASE.index(missing)] + BASE[BASE.index(missing) + 2 :])
    with pytest.raises(ValueError, match=f"{missing} is required"):
        validated(base=base)


def test_every_flag_is_documented():
    # The parser's flags, those --help leaves out included (the unbuilt features').
    parser = add_megatron_arguments(argparse.ArgumentParser(add_help=False))
    flags = {option for action in parser._actions for option in action.option_strings}
    documented = "".join(path.read_text() for path in DOCS.parent.glob("flags*.md"))
    missing = sorted(flag for flag in flags if f"`{flag}" not in documented)
    assert not missing, f"docs/flags*.md lack {missing}"
