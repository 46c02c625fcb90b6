"""TikTokenizer against references computed directly with `tiktoken` on the same rank files,
which the tests write (nothing is downloaded)."""

from __future__ import annotations

import base64
import json

import pytest

from megatron.core.datasets.tokenizers import build_tokenizer
from megatron.training.arguments import parse_args, validate_args
from tests.unit_tests.datasets.test_tokenizers import TEXTS, TRICKY

tiktoken = pytest.importorskip("tiktoken")

MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"an", b"and", b" and", b"\xc3\xa9"]
"""BPE tokens after the 256 single bytes, in rank order."""

RANKS = [bytes([i]) for i in range(256)] + MERGES
NUM_SPECIAL = 16
VOCAB_SIZE = NUM_SPECIAL + len(RANKS)


def write_tiktoken(path, tokens=RANKS) -> None:
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")


def write_megatron_json(path, tokens=RANKS) -> None:
    entries = [
        {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": repr(t)}
        for r, t in enumerate(tokens)
    ]
    path.write_text(json.dumps(entries))


@pytest.fixture
def rank_file(tmp_path):
    path = tmp_path / "tiny.tiktoken"
    write_tiktoken(path)
    return path


def _tik(path, **kwargs):
    kwargs = {"vocab_size": VOCAB_SIZE, "tiktoken_num_special_tokens": NUM_SPECIAL, **kwargs}
    return build_tokenizer("TikTokenizer", tokenizer_model=path, **kwargs)


def _reference_ids(text: str, pattern: str) -> list[int]:
    """Upstream's ids: plain tiktoken BPE over the unshifted ranks, shifted past the specials."""
    from megatron.core.datasets.tokenizers.tiktoken_tokenizer import PATTERNS

    plain = tiktoken.Encoding(
        name="reference",
        pat_str=PATTERNS[pattern],
        mergeable_ranks={t: r for r, t in enumerate(RANKS)},
        special_tokens={},
    )
    return [i + NUM_SPECIAL for i in plain.encode(text, disallowed_special=())]


@pytest.mark.parametrize("pattern", ["v1", "v2"])
@pytest.mark.parametrize("text", TEXTS + TRICKY + ["the thing and theme, écrit"])
def test_tiktoken_matches_plain_bpe_and_round_trips(rank_file, pattern, text):
    tokenizer = _tik(rank_file, tiktoken_pattern=pattern)
    ids = tokenizer.tokenize(text)
    assert ids == _reference_ids(text, pattern)
    assert tokenizer.detokenize(ids) == text


def test_tiktoken_merges_are_used(rank_file):
    tokenizer = _tik(rank_file)
    # " the" is one merged token (rank 260), shifted past the special tokens.
    assert tokenizer.tokenize(" the") == [NUM_SPECIAL + RANKS.index(b" the")]


def test_tiktoken_special_tokens_follow_megatron(rank_file):
    tokenizer = _tik(rank_file)
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert (tokenizer.bos, tokenizer.eod, tokenizer.eos, tokenizer.pad) == (1, 2, 2, 4)
    assert tokenizer.special_tokens["<SPECIAL_7>"] == 7
    assert tokenizer.special_tokens[f"<SPECIAL_{NUM_SPECIAL - 1}>"] == NUM_SPECIAL - 1
    # Special texts in the input become their ids (Megatron-LM's allowed_special="all").
    assert tokenizer.tokenize("<s>the</s>") == [1, *_reference_ids("the", "v2"), 2]
    assert tokenizer.token_bytes(NUM_SPECIAL + 97) == b"a"


def test_tiktoken_custom_special_tokens(rank_file):
    special = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<tool>"]
    tokenizer = _tik(rank_file, special_tokens=special)
    assert tokenizer.tokenize("<tool>") == [7]
    with pytest.raises(ValueError, match="--tokenizer-special-tokens must contain"):
        _tik(rank_file, special_tokens=["<s>", "</s>"])
    with pytest.raises(ValueError, match="duplicates"):
        _tik(rank_file, special_tokens=[*special, "<tool>"])


def test_json_rank_file_gives_the_same_ids(rank_file, tmp_path):
    json_file = tmp_path / "tokenizer.json"
    write_megatron_json(json_file)
    text = "the thing and theme, écrit 😀"
    assert _tik(json_file).tokenize(text) == _tik(rank_file).tokenize(text)


def test_vocab_size_keeps_the_first_ranks(rank_file):
    smaller = _tik(rank_file, vocab_size=VOCAB_SIZE - 2)  # drops the last two merges
    assert smaller.vocab_size == VOCAB_SIZE - 2
    assert NUM_SPECIAL + RANKS.index(b"\xc3\xa9") not in smaller.tokenize("é")
    assert smaller.detokenize(smaller.tokenize("é and")) == "é and"


def test_tiktoken_errors(rank_file, tmp_path):
    with pytest.raises(ValueError, match="--vocab-size 131072"):
        build_tokenizer("TikTokenizer", tokenizer_model=rank_file)  # upstream's default size
    with pytest.raises(ValueError, match="--tiktoken-pattern v3"):
        _tik(rank_file, tiktoken_pattern="v3")
    with pytest.raises(ValueError, match="--tiktoken-num-special-tokens 3"):
        _tik(rank_file, tiktoken_num_special_tokens=3)
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        _tik(tmp_path / "missing.tiktoken")
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("TikTokenizer")
    bad = tmp_path / "bad.tiktoken"
    write_tiktoken(bad, RANKS[1:])
    with pytest.raises(ValueError, match="single bytes"):
        _tik(bad)
    bad.write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="not a tiktoken rank file"):
        _tik(bad)


def test_tiktoken_flags_reach_the_tokenizer(rank_file):
    from megatron.training.global_vars import tokenizer_from_args

    args = parse_args(
        args=[
            *f"--tokenizer-type TikTokenizer --tokenizer-model {rank_file} --tiktoken-pattern v1 "
            f"--vocab-size {VOCAB_SIZE} --tiktoken-num-special-tokens {NUM_SPECIAL} "
            "--tokenizer-special-tokens <unk> <s> </s> <mask> <pad> <cls> <sep> <x>".split()
        ]
    )
    tokenizer = tokenizer_from_args(args)
    assert tokenizer.tokenize("<x> the") == [7, *_reference_ids(" the", "v1")]


def test_tiktoken_pattern_is_ignored_by_other_types():
    # Megatron-LM's Llama 3 launch scripts pass --tiktoken-pattern v2 with NullTokenizer.
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=10, tiktoken_pattern="v2")
    assert tokenizer.vocab_size == 10


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--vocab-extra-ids 100", "--vocab-extra-ids 100"),
        ("--tokenizer-prompt-format chatml", "--tokenizer-prompt-format chatml"),
    ],
)
def test_unbuilt_tokenizer_flags_are_refused(flags, message):
    base = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4 --lr 1e-2 --mock-data --vocab-size 64"
    ).split()
    with pytest.raises(ValueError, match=message):
        validate_args(parse_args(args=[*base, *flags.split()]), world_size=1)
