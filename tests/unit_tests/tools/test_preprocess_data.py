"""`tools/preprocess_data.py` end to end: JSON lines -> .bin/.idx read back with
`IndexedDataset` equal to tokenizing each document directly, with worker processes, several
json keys, and every input error; and the shipped quick-start corpus."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.tokenizers import build_tokenizer
from tests.unit_tests.program_launcher import run_program

REPO = Path(__file__).resolve().parents[3]
CORPUS = REPO / "examples" / "data" / "pride_and_prejudice_vol1.jsonl"

# The tool is a script, not a package module: import it by path. Its worker processes find it
# the same way (forked ones inherit the module; spawned ones inherit sys.path).
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))
preprocess_data = importlib.import_module("preprocess_data")

DOCUMENTS = [
    {"text": "It is a truth universally acknowledged.", "title": "One", "id": 1},
    {"text": "Café naïve — 東京 😀", "title": "Two", "id": 2},
    {"text": "", "title": "Empty text", "id": 3},
    {"text": "Line one.\nLine two.\n\n  spaced  ", "title": "", "id": 4},
] + [{"text": f"Document number {i}: " + "word " * (i % 7), "title": f"T{i}"} for i in range(5, 80)]
"""Non-ASCII text, an empty text and an empty title, and enough documents that two workers
each take several chunks (so a lost or reordered chunk shows)."""


def write_jsonl(path: Path, rows: list, blank_lines: bool = False) -> Path:
    lines = [json.dumps(row, ensure_ascii=False) for row in rows]
    if blank_lines:
        lines = [line for row_line in lines for line in (row_line, "")]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run(tmp_path: Path, *flags: str, input_path: Path | None = None) -> dict[str, str]:
    if input_path is None:
        input_path = write_jsonl(tmp_path / "input.jsonl", DOCUMENTS)
    argv = ["--input", str(input_path), "--output-prefix", str(tmp_path / "out" / "corpus")]
    if "--tokenizer-type" not in flags:
        argv += ["--tokenizer-type", "ByteLevelTokenizer"]
    return preprocess_data.main([*argv, *flags])


def with_eod(tokens: list[int], eod: int) -> list[int]:
    """What --append-eod writes for a document: its tokens and the EOD, unless it has none."""
    return [*tokens, eod] if tokens else []


def read_documents(prefix: str) -> list[list[int]]:
    """Each document's tokens (its sequences concatenated), in file order."""
    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    return [
        [int(token) for index in range(bounds[d], bounds[d + 1]) for token in dataset[index]]
        for d in range(len(bounds) - 1)
    ]


def test_two_workers_match_direct_tokenization_with_eod(tmp_path):
    prefixes = run(tmp_path, "--workers", "2", "--append-eod", "--log-interval", "10")
    prefix = str(tmp_path / "out" / "corpus_text_document")
    assert prefixes == {"text": prefix}
    assert os.path.isfile(get_bin_path(prefix)) and os.path.isfile(get_idx_path(prefix))
    tokenizer = build_tokenizer("ByteLevelTokenizer")
    expected = [with_eod(tokenizer.tokenize(row["text"]), tokenizer.eod) for row in DOCUMENTS]
    assert expected[2] == []  # the empty text: no EOD either, as in Megatron-LM
    assert read_documents(prefix) == expected
    dataset = IndexedDataset(prefix)
    # One sequence per non-empty document (the empty one has none); uint16 holds 259 ids.
    assert len(dataset) == len(DOCUMENTS) - 1
    assert dataset.dtype == numpy.uint16
    assert dataset.sequence_lengths.tolist() == [len(ids) for ids in expected if ids]
    assert tokenizer.detokenize(dataset[1]) == DOCUMENTS[1]["text"]
    # Nothing but the two files is left beside them (no temporary files).
    assert sorted(os.listdir(tmp_path / "out")) == [
        "corpus_text_document.bin",
        "corpus_text_document.idx",
    ]


def test_without_eod_empty_documents_have_no_sequence(tmp_path):
    prefix = run(tmp_path, "--workers", "1")["text"]
    tokenizer = build_tokenizer("ByteLevelTokenizer")
    assert read_documents(prefix) == [tokenizer.tokenize(row["text"]) for row in DOCUMENTS]
    dataset = IndexedDataset(prefix)
    # The empty third document is a document of no sequences, as in Megatron-LM.
    assert len(dataset) == len(DOCUMENTS) - 1
    assert len(dataset.document_indices) == len(DOCUMENTS) + 1
    assert dataset.document_indices[3] == dataset.document_indices[2]
    assert 0 not in dataset.sequence_lengths.tolist()


def test_multiple_keys_blank_lines_and_progress(tmp_path, capsys):
    input_path = write_jsonl(tmp_path / "input.jsonl", DOCUMENTS, blank_lines=True)
    prefixes = run(
        tmp_path,
        "--json-keys",
        "text",
        "title",
        "--workers",
        "2",
        "--append-eod",
        "--log-interval",
        "25",
        input_path=input_path,
    )
    assert set(prefixes) == {"text", "title"}
    assert prefixes["title"].endswith("corpus_title_document")
    tokenizer = build_tokenizer("ByteLevelTokenizer")
    for key in ("text", "title"):
        expected = [with_eod(tokenizer.tokenize(row[key]), tokenizer.eod) for row in DOCUMENTS]
        assert read_documents(prefixes[key]) == expected
    progress = [line for line in capsys.readouterr().err.splitlines() if "Processed " in line]
    assert len(progress) == len(DOCUMENTS) // 25
    # Each line says how much of the input is done, out of its size: the bytes up to the last
    # document written, blank lines included.
    data = input_path.read_bytes()
    lines = data.splitlines(keepends=True)
    for count, line in zip((25, 50, 75), progress):
        last = [i for i, text in enumerate(lines) if text.strip()][count - 1]
        done = sum(map(len, lines[: last + 1]))
        assert line.startswith(
            f"Processed {count} documents, {done / 1024**2:.2f} of {len(data) / 1024**2:.2f} MB "
            f"({100 * done / len(data):.1f}%) ("
        ), line
        assert " docs/s, " in line and " MB/s, ETA " in line


def test_progress_line_has_the_rates_and_the_time_left():
    mib = 1024**2
    # 1 of 4 MiB and 10 documents in 2 s: 0.5 MiB/s, so the other 3 MiB take 6 s more.
    assert preprocess_data.progress_line(10, mib, 4 * mib, 2.0) == (
        "Processed 10 documents, 1.00 of 4.00 MB (25.0%) (5.0 docs/s, 0.50 MB/s, ETA 0:00:06)."
    )
    # 2 hours in, a tenth done: 18 hours left.
    line = preprocess_data.progress_line(1000, 100 * mib, 1000 * mib, 7200.0)
    assert line.endswith("(10.0%) (0.1 docs/s, 0.01 MB/s, ETA 18:00:00).")


def test_gpt2_bpe_and_null_tokenizers(tmp_path):
    # A hand-written GPT-2 vocabulary: all bytes, <|endoftext|> and the merges t+h, th+e.
    from megatron.core.datasets.tokenizers.gpt2_bpe import bytes_to_unicode

    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    vocab.update({"<|endoftext|>": 256, "th": 257, "the": 258})
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\nt h\nth e\n", encoding="utf-8")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "2"]
    flags += ["--vocab-file", str(tmp_path / "vocab.json")]
    flags += ["--merge-file", str(tmp_path / "merges.txt")]
    prefix = run(tmp_path, *flags)["text"]
    tokenizer = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=tmp_path / "vocab.json",
        merge_file=tmp_path / "merges.txt",
    )
    documents = read_documents(prefix)
    assert documents == [with_eod(tokenizer.tokenize(row["text"]), 256) for row in DOCUMENTS]
    assert documents[0][:2] == [vocab["I"], vocab["t"]] and 257 in documents[0]  # "truth"

    ids_input = write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2 3"}, {"text": "98 0"}])
    null = run(
        tmp_path,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        "--append-eod",
        input_path=ids_input,
    )
    assert read_documents(null["text"]) == [[1, 2, 3, 99], [98, 0, 99]]  # EOD: the last id


def test_empty_input_gives_empty_datasets(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    prefix = run(tmp_path, "--workers", "2", "--append-eod", input_path=empty)["text"]
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 0
    assert dataset.document_indices.tolist() == [0]
    assert "holds no documents" in capsys.readouterr().err


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"text": "unterminated', "--input line 4 is not valid JSON"),
        ('["text", "a list"]', "--input line 4 is not a JSON object"),
        ('{"body": "no text key"}', "--input line 4 has no key 'text' .*'body'.*--json-keys"),
        ('{"text": ["a", "list"]}', "--input line 4: key 'text' holds a list, not a string"),
    ],
)
def test_bad_line_names_line_and_leaves_no_output(tmp_path, workers, bad_line, message):
    lines = [json.dumps(row) for row in DOCUMENTS[:40]]
    lines.insert(3, bad_line)
    input_path = tmp_path / "input.jsonl"
    input_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        run(tmp_path, "--workers", workers, input_path=input_path)
    assert os.listdir(tmp_path / "out") == []


def test_invalid_utf8_and_tokenizer_errors_name_the_line(tmp_path):
    input_path = tmp_path / "input.jsonl"
    input_path.write_bytes(b'{"text": "fine"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match="--input line 2 is not valid JSON"):
        run(tmp_path, input_path=input_path)
    ids_input = write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2"}, {"text": "3 101"}])
    with pytest.raises(ValueError, match="--input line 2, key 'text': .*id 101 is not in"):
        run(
            tmp_path,
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
            input_path=ids_input,
        )


def test_flag_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--input .*missing.jsonl: no such file"):
        run(tmp_path, input_path=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="--json-keys names \\['text'\\] more than once"):
        run(tmp_path, "--json-keys", "text", "text")
    with pytest.raises(ValueError, match="--workers 0 must be >= 1"):
        run(tmp_path, "--workers", "0")
    with pytest.raises(ValueError, match="needs --vocab-file"):
        run(tmp_path, "--tokenizer-type", "GPT2BPETokenizer")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        run(tmp_path, "--tokenizer-type", "NullTokenizer")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        run(
            tmp_path,
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(tmp_path / "missing.model"),
        )
    with pytest.raises(SystemExit):
        run(tmp_path, "--tokenizer-type", "NoSuchTokenizer")
    # Upstream's flags of features not built here are refused naming the feature.
    for flags, feature in (
        (["--split-sentences", "--lang", "english"], "sentence splitting"),
        (["--partitions", "2"], "input partitions"),
        (["--trust-remote-code"], "remote code of HuggingFace tokenizers"),
    ):
        with pytest.raises(ValueError, match=f"{flags[0]}.*: {feature}.* is not built"):
            run(tmp_path, *flags)


def test_tokenizer_type_is_required(tmp_path, capsys):
    argv = ["--input", str(write_jsonl(tmp_path / "input.jsonl", DOCUMENTS))]
    with pytest.raises(SystemExit):
        preprocess_data.main([*argv, "--output-prefix", str(tmp_path / "out")])
    assert "--tokenizer-type is required" in capsys.readouterr().err
    assert not (tmp_path / "out_text_document.bin").exists()


def test_append_eod_needs_an_eod_token(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.ByteLevelBPETokenizer()
    model.train_from_iterator(["some text to learn"] * 5, vocab_size=270, show_progress=False)
    directory = tmp_path / "no_eos"
    transformers.PreTrainedTokenizerFast(tokenizer_object=model._tokenizer).save_pretrained(
        str(directory)
    )
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(directory)]
    with pytest.raises(ValueError, match="--append-eod: .*eos_token"):
        run(tmp_path, *flags, "--append-eod")
    # Without --append-eod the same tokenizer is fine.
    prefix = run(tmp_path, *flags)["text"]
    assert read_documents(prefix)[0] == model.encode(DOCUMENTS[0]["text"]).ids


def test_ignored_vocab_size_is_said_once_not_per_worker(tmp_path):
    """`--vocab-size` with a tokenizer whose files give the vocabulary (upstream's scripts pass
    it): one warning on the command line, from the main process, none from the 2 workers."""
    from megatron.core.datasets.tokenizers.gpt2_bpe import bytes_to_unicode

    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = 256
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    flags = ["--input", str(write_jsonl(tmp_path / "input.jsonl", DOCUMENTS))]
    flags += ["--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer"]
    flags += ["--vocab-file", str(tmp_path / "vocab.json"), "--workers", "2"]
    flags += ["--merge-file", str(tmp_path / "merges.txt"), "--vocab-size", "1000"]
    result = run_program(REPO / "tools" / "preprocess_data.py", flags, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("--vocab-size 1000 is ignored, as Megatron-LM ignores it") == 1


def test_command_line_error_is_one_line(tmp_path):
    flags = ["--input", "nope.jsonl", "--output-prefix", str(tmp_path / "x")]
    flags += ["--tokenizer-type", "ByteLevelTokenizer"]
    result = run_program(REPO / "tools" / "preprocess_data.py", flags, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "preprocess_data.py: error: --input nope.jsonl: no such file; give a JSON-lines file."
    )


# The shipped quick-start corpus ------------------------------------------------------------


def test_shipped_corpus_is_jsonl_text():
    assert 150_000 <= CORPUS.stat().st_size <= 400_000
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    documents = [json.loads(line) for line in lines]
    assert len(documents) >= 200
    assert all(set(row) == {"text"} and row["text"].strip() for row in documents)
    text = "\n".join(row["text"] for row in documents)
    assert text.startswith("PRIDE AND PREJUDICE")
    assert "It is a truth universally acknowledged" in text
    # The public-domain text without the e-text publisher's name, header or licence.
    for forbidden in ("gutenberg", "license", "licence", "ebook", "*** start", "*** end"):
        assert forbidden not in text.lower()


def test_shipped_corpus_preprocesses(tmp_path):
    prefix = preprocess_data.main(
        ["--input", str(CORPUS), "--output-prefix", str(tmp_path / "austen")]
        + ["--tokenizer-type", "ByteLevelTokenizer", "--append-eod", "--workers", "2"]
        + ["--log-interval", "100000"]
    )["text"]
    dataset = IndexedDataset(prefix)
    rows = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    assert len(dataset) == len(rows)
    # Byte-level: each document is its UTF-8 bytes and one EOD.
    expected_tokens = sum(len(row.encode("utf-8")) + 1 for row in rows)
    assert int(dataset.sequence_lengths.sum()) == expected_tokens
    assert build_tokenizer("ByteLevelTokenizer").detokenize(dataset[len(rows) - 1]) == rows[-1]
