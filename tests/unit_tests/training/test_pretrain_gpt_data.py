"""`pretrain_gpt.py` on data from disk, in-process on spawned ranks: the quick-start corpus
tokenized into Megatron's indexed format trains (loss falls, evaluation runs) with the EOD
options, and a run resumed from a checkpoint reads the same samples in the same order as one
that never stopped, for a single dataset and for a blend."""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.core.datasets import IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.datasets.tokenizers import ByteLevelTokenizer
from tests.unit_tests.distributed_harness import run_distributed

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
