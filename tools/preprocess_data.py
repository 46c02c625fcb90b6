"""Tokenizes a JSON-lines corpus into indexed datasets (.bin/.idx), as Megatron-LM's
`tools/preprocess_data.py`.

Each line of `--input` is one document, a JSON object; the text under each `--json-keys` key
is tokenized (with `--append-eod`, followed by the tokenizer's end-of-document id) and written
to `{output_prefix}_{key}_document.bin/.idx`, one sequence per document, in input order:

    python tools/preprocess_data.py --input examples/data/pride_and_prejudice_vol1.jsonl \\
        --output-prefix data/austen --json-keys text --tokenizer-type ByteLevelTokenizer \\
        --append-eod --workers 2
    # -> data/austen_text_document.bin, data/austen_text_document.idx

`--workers N` tokenizes in N processes (each builds its tokenizer once); the writer keeps the
input's order. Blank lines are skipped. A document whose text tokenizes to nothing gets no EOD
(Megatron-LM's rule) and is kept as a document of no sequences, so the datasets of several keys
stay aligned. An input with no documents gives valid, empty datasets (and a warning). A missing
input, a line that is not a JSON object, or a missing key is an error naming the line, and no
output is left behind. Sentence splitting (`--split-sentences`) is not supported.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from multiprocessing.pool import Pool

import numpy

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    optimal_dtype,
)
from megatron.core.datasets.tokenizers import MegatronTokenizer  # noqa: E402
from megatron.training.arguments import add_tokenizer_args  # noqa: E402
from megatron.training.flag_groups.unbuilt import (  # noqa: E402
    TOKENIZER_UNBUILT,
    Unbuilt,
    add_unbuilt_flags,
    refuse_unbuilt,
)
from megatron.training.global_vars import tokenizer_from_args  # noqa: E402

LEVEL = "document"
"""The `{prefix}_{key}_{level}` suffix: whole documents (Megatron-LM's name without sentence
splitting)."""

CHUNK_SIZE = 32
"""Lines per task sent to a worker: enough to amortise the inter-process round trip, few
enough that a small corpus still spreads over all workers."""

UNBUILT = (
    Unbuilt(
        "sentence splitting (nltk, for BERT-style data)",
        "drop these flags: each JSON value is tokenized whole, as one document",
        ("--split-sentences", "--keep-newlines"),
        ("--lang",),
    ),
    Unbuilt(
        "input partitions, document limits and the worker-count search",
        "drop these flags: --workers processes tokenize the whole --input, in order",
        ("--keep-sequential-samples", "--find-optimal-num-workers"),
        ("--partitions", "--workers-to-check", "--max-documents"),
    ),
    *TOKENIZER_UNBUILT,
)
"""Megatron-LM's preprocessing flags of features not built here, refused by name."""

Line = tuple[int, bytes, int]
"""A non-blank line of `--input`: its 1-based number, its bytes, and the input's byte offset
after it (how far the input is read once it is written: the progress)."""

Encoded = tuple[int, "dict[str, numpy.ndarray] | str"]
"""A line's result: the input's byte offset after it, and its token ids per key or an error
message."""


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses Megatron-LM's preprocessing flags."""
    parser = argparse.ArgumentParser(
        description="Tokenize a JSON-lines corpus into Megatron indexed datasets (.bin/.idx)."
    )
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSON-lines file: one document a line.")
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys of the text to tokenize; one dataset per key (default: text).",
    )
    group = add_tokenizer_args(parser)
    group.add_argument(
        "--append-eod", action="store_true", help="end each document with the EOD id."
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix",
        required=True,
        help="writes {prefix}_{key}_document.bin/.idx for each json key.",
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes.")
    group.add_argument(
        "--log-interval", type=int, default=1000, help="print progress every N documents."
    )
    add_unbuilt_flags(parser, UNBUILT, listed_in="docs/data.md (the tokenizer's: docs/flags.md)")
    args = parser.parse_args(argv)
    refuse_unbuilt(args, UNBUILT)
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required: the tokenizer training will name too.")
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers} must be >= 1.")
    if args.log_interval < 1:
        raise ValueError(f"--log-interval {args.log_interval} must be >= 1.")
    duplicates = sorted({key for key in args.json_keys if args.json_keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"--json-keys names {duplicates} more than once; name each key once.")
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input {args.input}: no such file; give a JSON-lines file.")
    return args


def output_prefix(args: argparse.Namespace, key: str) -> str:
    """The path prefix of the dataset written for json key `key`."""
    return f"{args.output_prefix}_{key}_{LEVEL}"


class Encoder:
    """Turns numbered JSON lines into token ids.

    Args:
        args: the parsed flags (tokenizer, `--json-keys`, `--append-eod`).
        tokenizer: the tokenizer the flags describe.
        dtype: the dtype of the returned ids (the datasets', so results cross processes small).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        tokenizer: MegatronTokenizer,
        dtype: type[numpy.number],
    ):
        self.json_keys = list(args.json_keys)
        self.append_eod = args.append_eod
        self.tokenizer = tokenizer
        self.dtype = dtype

    def encode(self, item: Line) -> Encoded:
        """Token ids of each key of line `item`. Errors are returned as messages, not raised, so
        the writer reports them in input order and stops cleanly."""
        number, line, end = item
        try:
            document = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return end, f"--input line {number} is not valid JSON ({error})."
        if not isinstance(document, dict):
            return end, f"--input line {number} is not a JSON object."
        ids = {}
        for key in self.json_keys:
            if key not in document:
                return end, (
                    f"--input line {number} has no key {key!r} (its keys: "
                    f"{sorted(document)}); choose keys with --json-keys."
                )
            text = document[key]
            if not isinstance(text, str):
                return end, (
                    f"--input line {number}: key {key!r} holds a {type(text).__name__}, "
                    "not a string."
                )
            try:
                tokens = self.tokenizer.tokenize(text)
            except ValueError as error:
                return end, f"--input line {number}, key {key!r}: {error}"
            if self.append_eod and tokens:  # Megatron-LM's rule: no EOD ends an empty text
                tokens.append(self.tokenizer.eod)
            ids[key] = numpy.asarray(tokens, dtype=self.dtype)
        return end, ids


_worker_encoder: Encoder | None = None
"""The `Encoder` of a worker process, made once by `_init_worker` (a module global, not an
argument of each task, so tasks carry only their lines)."""


def _init_worker(args: argparse.Namespace, dtype: type[numpy.number]) -> None:
    """`Pool` initializer: builds the worker's tokenizer once (its warnings, said by the main
    process already, silenced)."""
    global _worker_encoder
    logging.disable(logging.WARNING)
    tokenizer = tokenizer_from_args(args)
    _worker_encoder = Encoder(args, tokenizer, dtype)


def _encode_in_worker(item: Line) -> Encoded:
    return _worker_encoder.encode(item)


_WORKER_MODULES = ("megatron.training.global_vars", "megatron.core.datasets.tokenizers")
"""What a worker imports, by names that a forkserver finds without this script's directory on
its path."""


def _worker_pool(args: argparse.Namespace, dtype: type[numpy.number]) -> Pool:
    """`args.workers` tokenizing processes. They fork from a forkserver, not from this
    process: a fork of a process that runs threads (a training job's, a test runner's) can
    inherit a lock that one of them held and hang. The server imports the tokenizers' modules
    (and torch) once, so that each worker starts without importing them again."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, *_WORKER_MODULES])
    return context.Pool(args.workers, initializer=_init_worker, initargs=(args, dtype))


def _numbered_lines(path: str) -> Iterator[Line]:
    """The non-blank lines of `path` (`Line`). Bytes, decoded in the workers, so the reading
    process does no per-character work."""
    end = 0
    with open(path, "rb") as stream:
        for number, line in enumerate(stream, start=1):
            end += len(line)
            if line.strip():
                yield number, line, end


def progress_line(documents: int, done_bytes: int, total_bytes: int, elapsed: float) -> str:
    """Megatron-LM's progress line (documents, docs/s, MB/s) with how much of the input is
    done, out of its size, and the time left at the rate so far."""
    rate = done_bytes / max(elapsed, 1e-9)
    left = (total_bytes - done_bytes) / rate if rate > 0 else 0.0
    percent = 100 * done_bytes / total_bytes if total_bytes else 100.0
    return (
        f"Processed {documents} documents, {done_bytes / 1024**2:.2f} of "
        f"{total_bytes / 1024**2:.2f} MB ({percent:.1f}%) ({documents / max(elapsed, 1e-9):.1f} "
        f"docs/s, {rate / 1024**2:.2f} MB/s, ETA {datetime.timedelta(seconds=round(left))})."
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict[str, str]:
    """Runs the preprocessing.

    Args:
        argv: the command-line flags (None: `sys.argv[1:]`).

    Returns:
        Each json key's dataset path prefix.

    Raises:
        FileNotFoundError: `--input` or a tokenizer file is missing.
        ValueError: a bad flag, or a line that is not a JSON object holding every key as a
            string, or text the tokenizer rejects (the message names the line).
    """
    args = get_args(argv)
    tokenizer = tokenizer_from_args(args)
    if args.append_eod:
        try:
            tokenizer.eod  # noqa: B018 (checked now, rather than in a worker mid-corpus)
        except NotImplementedError as error:
            raise ValueError(f"--append-eod: {error}") from None
    dtype = optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix(args, key) for key in args.json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    _log(
        f"Tokenizing {args.input} with {args.tokenizer_type} (vocab size "
        f"{tokenizer.vocab_size}, {numpy.dtype(dtype).name} ids) on {args.workers} worker(s)."
    )

    pool = None
    # Set at an error: the pool's feeder stops reading lines, and the pool ends once its
    # workers have encoded what was already sent (`Pool.terminate()` can wait on a feeder
    # blocked in a full pipe to workers it killed).
    stop_feeding = threading.Event()
    if args.workers > 1:
        pool = _worker_pool(args, dtype)
        lines = itertools.takewhile(
            lambda _: not stop_feeding.is_set(), _numbered_lines(args.input)
        )
        results: Iterable[Encoded] = pool.imap(_encode_in_worker, lines, chunksize=CHUNK_SIZE)
    else:
        results = map(Encoder(args, tokenizer, dtype).encode, _numbered_lines(args.input))

    builders: dict[str, IndexedDatasetBuilder] = {}
    try:
        for key, prefix in prefixes.items():
            builders[key] = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
        tokens = dict.fromkeys(prefixes, 0)
        start = time.perf_counter()
        input_bytes = os.path.getsize(args.input)
        documents = 0
        for documents, (done_bytes, encoded) in zip(itertools.count(1), results):
            if isinstance(encoded, str):
                raise ValueError(encoded)
            for key, ids in encoded.items():
                # An empty document has no sequence (not one of length 0), as in Megatron-LM.
                builders[key].add_document(ids, lengths=[len(ids)] if len(ids) else [])
                tokens[key] += len(ids)
            if documents % args.log_interval == 0:
                elapsed = time.perf_counter() - start
                _log(progress_line(documents, done_bytes, input_bytes, elapsed))
        for key, prefix in prefixes.items():
            builders[key].finalize(get_idx_path(prefix))
    except BaseException as error:
        stop_feeding.set()
        if pool is not None and not isinstance(error, Exception):
            pool.terminate()  # interrupted: workers may have died with their tasks
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()

    if documents == 0:
        _log(f"Warning: --input {args.input} holds no documents; the datasets are empty.")
    elapsed = time.perf_counter() - start
    for key, prefix in prefixes.items():
        _log(
            f"Wrote {documents} documents, {tokens[key]} tokens of key {key!r} to "
            f"{get_bin_path(prefix)} and {get_idx_path(prefix)} ({elapsed:.1f} s)."
        )
    return prefixes


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ImportError, ValueError) as error:
        sys.exit(f"{os.path.basename(__file__)}: error: {error}")
