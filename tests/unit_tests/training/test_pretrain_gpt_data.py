"""`pretrain_gpt.py` on data from disk, in-process on spawned ranks: the quick-start corpus
tokenized into Megatron's indexed format trains (loss falls, evaluation runs) with the EOD
options, and a run resumed from a checkpoint reads the same samples in the same order as one
that never stopped, for a single dataset and for a blend. The flags build Megatron-core's
datasets (its golden arrays); validation asked of an empty split is said, once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.core.datasets import IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.datasets.tokenizers import ByteLevelTokenizer
from megatron.training.arguments import parse_args, validate_args
from megatron.training.data_iterators import train_valid_test_num_samples
from megatron.training.global_vars import build_tokenizer, set_args, unset_tokenizer
from megatron.training.train_state import TrainState
from tests.unit_tests.datasets import upstream_parity
from tests.unit_tests.datasets.fixtures import parity_cases
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.log_capture import capture_training_log

CORPUS = (
    Path(__file__).resolve().parents[3] / "examples" / "data" / "pride_and_prejudice_vol1.jsonl"
)

MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --tokenizer-type ByteLevelTokenizer "
    "--num-workers 0 --log-interval 5 --hidden-dropout 0.1 --attention-dropout 0.1"
).split()
"""A tiny byte-level GPT; 2 ranks x 2 microbatches of 2 sequences; dropout on, so a resumed
run must restore the random generators too."""

ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def _write_dataset(prefix: str, documents: list[str]) -> str:
    tokenizer = ByteLevelTokenizer()
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    for text in documents:
        tokens = [*tokenizer.tokenize(text), tokenizer.eod]
        builder.add_document(tokens, lengths=[len(tokens)])
    builder.finalize(get_idx_path(prefix))
    return prefix


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[str, str]:
    """Two indexed datasets: the first 60 documents of the quick-start corpus, and the next 40."""
    folder = tmp_path_factory.mktemp("corpus")
    with open(CORPUS, encoding="utf-8") as lines:
        texts = [json.loads(line)["text"] for _, line in zip(range(100), lines)]
    return (
        _write_dataset(str(folder / "first_text_document"), texts[:60]),
        _write_dataset(str(folder / "second_text_document"), texts[60:]),
    )


def _history(flags: list[str]) -> dict:
    history = pretrain_gpt.main([*flags, "--distributed-backend", dist.get_backend()])
    return {
        "losses": history.loss_curve(),
        "grad_norms": history.grad_norms,
        "validation": history.validation_losses,
        "final_validation": history.final_validation_losses,
        "start": history.start_iteration,
    }


def test_loss_falls_on_the_corpus_with_eod_options(corpora, tmp_path):
    flags = [
        *MODEL,
        *ZERO3,
        "--data-path",
        corpora[0],
        "--split",
        "90,10,0",
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--train-iters",
        "30",
        "--eval-interval",
        "15",
        "--eval-iters",
        "2",
        "--eod-mask-loss",
        "--reset-position-ids",
        "--reset-attention-mask",
    ]
    ranks = run_distributed(_history, 2, flags)
    losses = ranks[0]["losses"]
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5, losses
    assert set(ranks[0]["validation"]) == {15, 30}
    assert ranks[0]["final_validation"] is not None
    assert ranks[0] == ranks[1]  # the values reported are the ranks' averages
    # --data-cache-path reached the datasets: their sample indices are cached there.
    assert list((tmp_path / "cache").rglob("*.npy"))


@pytest.mark.parametrize("blend", [False, True], ids=["one_dataset", "blend"])
def test_resumed_run_reads_the_data_of_the_uninterrupted_one(corpora, tmp_path, blend):
    data = ["0.7", corpora[0], "0.3", corpora[1]] if blend else [corpora[0]]
    flags = [*MODEL, *ZERO3, "--data-path", *data, "--train-iters", "8", "--eval-interval", "4"]
    flags += ["--split", "80,10,10", "--eval-iters", "1", "--data-cache-path", str(tmp_path)]
    straight = run_distributed(_history, 2, flags)[0]
    save = ["--save", str(tmp_path / "checkpoints")]
    first = run_distributed(_history, 2, [*flags, *save, "--exit-interval", "3"])[0]
    second = run_distributed(_history, 2, [*flags, *save, "--load", str(tmp_path / "checkpoints")])
    second = second[0]
    assert second["start"] == 3
    assert first["losses"] + second["losses"] == straight["losses"]
    assert first["grad_norms"] + second["grad_norms"] == straight["grad_norms"]
    assert second["validation"] == {k: v for k, v in straight["validation"].items() if k > 3}
    assert second["final_validation"] == straight["final_validation"]


def test_resume_with_another_batch_size_reads_on_from_the_consumed_samples(corpora, tmp_path):
    """Saved at 2 ranks with global batch 8, resumed on 1 rank with global batch 4: the data
    are sized from the checkpoint's consumed samples plus what the remaining iterations read."""
    flags = [*MODEL, *ZERO3, "--data-path", corpora[0], "--split", "90,10,0"]
    flags += ["--train-iters", "6", "--eval-iters", "0", "--data-cache-path", str(tmp_path)]
    save = ["--save", str(tmp_path / "checkpoints")]
    run_distributed(_history, 2, [*flags, *save, "--exit-interval", "3"])
    flags[flags.index("--global-batch-size") + 1] = "4"
    # The schedule's lengths are in samples (Megatron-LM's), so another batch size changes them:
    # keep the flags' schedule, as a Megatron-LM run would have to.
    flags.append("--override-opt_param-scheduler")
    (resumed,) = run_distributed(_history, 1, [*flags, "--load", str(tmp_path / "checkpoints")])
    assert resumed["start"] == 3 and len(resumed["losses"]) == 3


@pytest.mark.parametrize("case", ["flag_path_blend", "flag_path_single", "flag_path_per_split"])
def test_flags_build_upstreams_datasets(case, tmp_path):
    """The flag path (`--data-path` and `--split`, or `--train-data-path`, `--valid-data-path`
    and `--test-data-path`; `--seed`, `--seq-length`, the EOD flags, the tokenizer; the split
    sizes from `--train-iters`, `--eval-interval`, `--eval-iters`, `--global-batch-size`) gives
    Megatron-core 0.19.2's datasets, index arrays and samples."""
    spec = upstream_parity.CASES[case]
    folder = upstream_parity.write_corpora(str(tmp_path / "data"), ["bytes_a", "bytes_b"])
    flags = [*MODEL, "--distributed-backend", "gloo"]  # global batch 8
    if spec["per_split"] is None:
        flags += ["--data-path", *parity_cases.with_prefixes(spec["data"], folder)]
        flags += ["--split", spec["split"]]
    else:
        for split, data in zip(("train", "valid", "test"), spec["per_split"]):
            flags += [f"--{split}-data-path", *parity_cases.with_prefixes(data, folder)]
    flags += ["--seq-length", str(spec["seq"]), "--seed", "1234"]
    flags += ["--train-iters", "20", "--eval-interval", "10", "--eval-iters", "2"]
    flags += ["--data-cache-path", str(tmp_path / "cache")]
    flags += [
        f"--{name.replace('_', '-')}"
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
        if spec[name]
    ]
    args = parse_args(args=flags)
    validate_args(args, world_size=1)
    build_tokenizer(args)
    set_args(args)
    try:
        sizes = train_valid_test_num_samples(args, TrainState())
        assert sizes == spec["sizes"]
        datasets = pretrain_gpt.train_valid_test_datasets_provider(sizes)
        assert upstream_parity.assert_matches_upstream(case, datasets) == ["identical"] * 3
    finally:
        set_args(None)
        unset_tokenizer()


def _error_of_run(flags: list[str]) -> str | None:
    try:
        _history(flags)
    except ValueError as error:
        return str(error)
    return None


def test_token_id_beyond_the_vocabulary_is_refused_on_every_rank(corpora, tmp_path):
    """Byte-level data (EOD 258) trained with NullTokenizer --vocab-size 200 (ids 0 to 199):
    every rank raises the same error at dataset build, naming the data, the largest id, the
    vocabulary and the fix (before: an IndexError on one rank, the other left hanging)."""
    flags = [*MODEL, *ZERO3, "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]
    flags += ["--data-path", corpora[0], "--split", "90,10,0", "--train-iters", "2"]
    flags += ["--data-cache-path", str(tmp_path / "cache")]
    errors = run_distributed(_error_of_run, 2, flags)
    for error in errors:
        assert error is not None and corpora[0] in error
        assert "token id 258" in error and "vocabulary has 200 ids" in error
        assert "--tokenizer-type" in error and "--vocab-size" in error


def test_no_training_data_says_why_on_every_rank(corpora, tmp_path):
    """A training split without data names the flag that left it empty (before: "the dataset
    provider returned no training dataset")."""
    flags = [*MODEL, *ZERO3, "--train-iters", "2", "--data-cache-path", str(tmp_path / "cache")]
    flags += ["--data-path", corpora[0], "--split", "0,100,0"]
    expected = "No training data: the train split is empty (--split 0,100,0 gives it no weight"
    for error in run_distributed(_error_of_run, 2, flags):
        assert error is not None and error.startswith(expected)


def _warnings_of_run(flags: list[str]) -> list[str]:
    with capture_training_log() as messages:
        _history(flags)
    return [message for message in messages if "asks for validation" in message]


@pytest.mark.parametrize(
    "why", ["split_without_validation", "corpus_too_small", "no_valid_data_path", "fine"]
)
def test_validation_asked_of_an_empty_split_is_said_once(corpora, tmp_path, why):
    """`--eval-iters 2` with no validation data: one warning from rank 0 naming --split (or
    the missing --valid-data-path) and --eval-iters (before: validation silently skipped)."""
    split, data = "100,0,0", corpora[0]
    if why == "corpus_too_small":
        # 98,2,0 of 12 documents: the validation book-ends both round to 12, no document.
        with open(CORPUS, encoding="utf-8") as lines:
            texts = [json.loads(line)["text"] for _, line in zip(range(12), lines)]
        data, split = _write_dataset(str(tmp_path / "small_text_document"), texts), "98,2,0"
    elif why == "fine":
        split = "90,10,0"
    data_flags = ["--data-path", data, "--split", split]
    if why == "no_valid_data_path":
        data_flags = ["--train-data-path", data]
    flags = [*MODEL, *ZERO3, *data_flags, "--train-iters", "4"]
    flags += ["--eval-interval", "2", "--eval-iters", "2", "--seq-length", "16"]
    flags += ["--data-cache-path", str(tmp_path / "cache")]
    ranks = run_distributed(_warnings_of_run, 2, flags)
    assert ranks[1] == []  # rank 0 says it
    if why == "fine":
        assert ranks[0] == []
        return
    (warning,) = ranks[0]
    expected = f"--split {split}" if why != "no_valid_data_path" else "no --valid-data-path"
    assert expected in warning and "--eval-iters 2" in warning
    assert "no validation runs" in warning
