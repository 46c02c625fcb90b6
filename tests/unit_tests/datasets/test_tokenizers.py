"""Tokenizers: round trips on ASCII and non-ASCII text, special ids, vocabulary sizes, GPT-2 BPE
against HuggingFace's implementation, and the error of each missing file or argument.

Tokenizer files are made in temporary directories (a hand-written BPE, a BPE trained with
`tokenizers`, a SentencePiece model trained on generated text), so nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import sys

import numpy
import pytest

from megatron.core.datasets.tokenizers import (
    TOKENIZER_TYPES,
    ByteLevelTokenizer,
    GPT2BPETokenizer,
    MegatronTokenizer,
    NullTokenizer,
    build_tokenizer,
)
from megatron.core.datasets.tokenizers.gpt2_bpe import bytes_to_unicode
from megatron.training.arguments import parse_args
from megatron.training.global_vars import tokenizer_from_args

TEXTS = [
    "Hello, world!",
    "It is a truth universally acknowledged.\nThe end.\n",
    "Café naïve façade über Ærøskøbing",
    "東京は日本の首都です。",
    "emoji 😀🎉 and a family 👨‍👩‍👧",
    "",
]
"""Round-trip texts: ASCII, Latin accents, CJK, emoji (4-byte UTF-8, joiners), empty."""

TRICKY = [
    "I'm sure it's the man's dog; they'll've said we'd, you're, I've",
    "'s 's's ''s  's' IT'S",
    "numbers 123 4567890 1,000.50 3rd 2x ½ ²",
    "multiple   spaces    here  ",
    "   leading spaces",
    "newlines\n\n\nand\r\nwindows\ttabs \t \n mixed",
    "punctuation!!! ... ?!? -- (brackets) [x] {y} <z> @#$%^&*",
    "aaaaaaaa abababab",
    " café 東京 😀 ",
]
"""GPT-2 pre-tokenisation edge cases: contractions, digits, whitespace runs, symbols."""


def test_tokenizer_types_are_megatron_names():
    assert TOKENIZER_TYPES == (
        "ByteLevelTokenizer",
        "GPT2BPETokenizer",
        "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer",
        "Llama2Tokenizer",
        "TikTokenizer",
        "HuggingFaceTokenizer",
        "NullTokenizer",
    )


def test_unknown_type_lists_choices():
    with pytest.raises(ValueError, match="GPT2BPETokenizer") as error:
        build_tokenizer("BertWordPieceCase")
    assert "'BertWordPieceCase'" in str(error.value)
    for name in TOKENIZER_TYPES:
        assert name in str(error.value)


# ByteLevelTokenizer ------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(text):
    tokenizer = build_tokenizer("ByteLevelTokenizer")
    ids = tokenizer.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= index < 256 for index in ids)
    assert tokenizer.detokenize(ids) == text
    assert tokenizer.detokenize(numpy.array(ids, dtype=numpy.uint16)) == text


def test_byte_level_special_tokens():
    tokenizer = ByteLevelTokenizer()
    assert isinstance(tokenizer, MegatronTokenizer)
    assert tokenizer.vocab_size == 259
    assert (tokenizer.pad, tokenizer.bos, tokenizer.eos, tokenizer.eod) == (256, 257, 258, 258)
    assert len(tokenizer.vocab) == len(tokenizer.inv_vocab) == tokenizer.vocab_size
    assert tokenizer.vocab["<eos>"] == 258 and tokenizer.inv_vocab[65] == "<0x41>"
    assert all(tokenizer.vocab[token] == index for index, token in tokenizer.inv_vocab.items())
    # Special ids are skipped; a character cut in half decodes to U+FFFD, not an exception.
    ids = [tokenizer.bos, *tokenizer.tokenize("hé"), tokenizer.eod, tokenizer.pad]
    assert tokenizer.detokenize(ids) == "hé"
    assert tokenizer.detokenize(tokenizer.tokenize("é")[:1] + [ord("x")]) == "\ufffdx"
    with pytest.raises(ValueError, match="259"):
        tokenizer.detokenize([65, 259])


def test_byte_level_takes_no_arguments():
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("ByteLevelTokenizer", vocab_size=100)


# NullTokenizer -----------------------------------------------------------------------------


def test_null_tokenizer_follows_megatron_core():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=10)
    assert isinstance(tokenizer, NullTokenizer)
    # Megatron-core: --vocab-size is the whole vocabulary; EOD is its last id; no pad id.
    assert tokenizer.vocab_size == 10
    assert tokenizer.eod == tokenizer.eos == 9
    with pytest.raises(NotImplementedError, match="no attribute 'pad'"):
        tokenizer.pad  # noqa: B018
    assert tokenizer.tokenize("5 9 0") == [5, 9, 0]
    assert tokenizer.tokenize(" 5  9\n0\t1 ") == [5, 9, 0, 1]
    assert tokenizer.tokenize("") == []
    assert tokenizer.detokenize([5, 9, 3]) == "5 9 3"
    assert tokenizer.detokenize(numpy.array([3, 4])) == "3 4"
    with pytest.raises(NotImplementedError, match="vocab"):
        tokenizer.vocab  # noqa: B018
    with pytest.raises(NotImplementedError, match="NullTokenizer has no attribute 'bos'"):
        tokenizer.bos  # noqa: B018


def test_null_tokenizer_eod_and_pad_ids_from_the_flags():
    args = parse_args(
        args="--tokenizer-type NullTokenizer --vocab-size 10 --null-tokenizer-eod-id 0 "
        "--null-tokenizer-pad-id 7".split()
    )
    tokenizer = tokenizer_from_args(args)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (10, 0, 7)
    for flag, value in (("--null-tokenizer-eod-id", 10), ("--null-tokenizer-pad-id", -2)):
        key = "null_eod_id" if "eod" in flag else "null_pad_id"
        with pytest.raises(ValueError, match=f"{flag} {value}"):
            build_tokenizer("NullTokenizer", vocab_size=10, **{key: value})
    with pytest.raises(ValueError, match="does not read --null-tokenizer-eod-id"):
        build_tokenizer("ByteLevelTokenizer", null_eod_id=3)


@pytest.mark.parametrize(
    ("text", "message"), [("1 x 2", "'x' is not an integer"), ("3 10", "id 10 is not in")]
)
def test_null_tokenizer_rejects_bad_ids(text, message):
    with pytest.raises(ValueError, match=message):
        NullTokenizer(10).tokenize(text)


def test_null_tokenizer_needs_vocab_size():
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="--vocab-size"):
            NullTokenizer(bad)


# GPT2BPETokenizer --------------------------------------------------------------------------


def write_bpe(directory, vocab: dict[str, int], merges: list[str], header: bool = True):
    """Writes vocab.json and merges.txt; returns their paths."""
    vocab_file, merge_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    lines = (["#version: 0.2"] if header else []) + merges
    merge_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return vocab_file, merge_file


@pytest.fixture
def hand_bpe(tmp_path):
    """All 256 byte characters, `<|endoftext|>` at 256 and three merges: t+h, th+e, Ġ+the."""
    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    vocab.update({"<|endoftext|>": 256, "th": 257, "the": 258, "Ġthe": 259})
    return write_bpe(tmp_path, vocab, ["t h", "th e", "Ġ the"])


def test_gpt2_bpe_hand_made_merges(hand_bpe):
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=hand_bpe[0], merge_file=hand_bpe[1])
    assert isinstance(tokenizer, GPT2BPETokenizer)
    assert tokenizer.vocab_size == 260
    assert tokenizer.eod == tokenizer.eos == 256
    byte_id = {byte: tokenizer.vocab[char] for byte, char in bytes_to_unicode().items()}
    # "the" merges fully; " the" takes its leading space (Ġ) along; "they" keeps "y" apart.
    assert tokenizer.tokenize("the the they") == [258, 259, 259, byte_id[ord("y")]]
    # Space and newline are bytes 32 and 10, mapped to Ġ and Ċ.
    assert tokenizer.tokenize("a\n") == [byte_id[ord("a")], byte_id[10]]
    # The end-of-document text inside a document is its id, as in Megatron-LM 0.19 (whose
    # GPT2BPETokenizer is HuggingFace's), and the text around it is encoded apart.
    assert tokenizer.tokenize("the<|endoftext|> the") == [258, 256, 259]
    assert tokenizer.bos == 256
    assert tokenizer.detokenize([258, 259, 256]) == "the the<|endoftext|>"
    # Bytes of a character cut in half decode to U+FFFD.
    assert tokenizer.detokenize(tokenizer.tokenize("é")[:1]) == "\ufffd"


def test_gpt2_bpe_merges_without_version_header(tmp_path, hand_bpe):
    vocab = json.loads(hand_bpe[0].read_text(encoding="utf-8"))
    directory = tmp_path / "plain"
    directory.mkdir()
    vocab_file, merge_file = write_bpe(directory, vocab, ["t h", "th e"], header=False)
    assert GPT2BPETokenizer(vocab_file, merge_file).tokenize("the") == [258]


@pytest.mark.parametrize("text", TEXTS)
def test_gpt2_bpe_round_trip(hand_bpe, text):
    tokenizer = GPT2BPETokenizer(*hand_bpe)
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_gpt2_bpe_missing_arguments_and_files(tmp_path, hand_bpe):
    vocab_file, merge_file = hand_bpe
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file)
    with pytest.raises(ValueError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", merge_file=merge_file)
    with pytest.raises(FileNotFoundError, match="--vocab-file .*missing.json: no such file"):
        build_tokenizer(
            "GPT2BPETokenizer", vocab_file=tmp_path / "missing.json", merge_file=merge_file
        )
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=tmp_path)
    with pytest.raises(ValueError, match="does not read --tokenizer-model"):
        build_tokenizer(
            "GPT2BPETokenizer",
            vocab_file=vocab_file,
            merge_file=merge_file,
            tokenizer_model=vocab_file,
        )


def test_gpt2_bpe_bad_files(tmp_path, hand_bpe):
    vocab_file, merge_file = hand_bpe
    not_json = tmp_path / "not.json"
    not_json.write_text("{oops", encoding="utf-8")
    with pytest.raises(ValueError, match="--vocab-file .* is not JSON"):
        GPT2BPETokenizer(not_json, merge_file)
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps({"a": 0, "b": 1}), encoding="utf-8")
    with pytest.raises(ValueError, match="<\\|endoftext\\|>"):
        GPT2BPETokenizer(no_eod, merge_file)
    bad_merges = tmp_path / "bad.txt"
    bad_merges.write_text("#version: 0.2\nt h\nthree parts here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="--merge-file .* line 3"):
        GPT2BPETokenizer(vocab_file, bad_merges)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="--merge-file .* cannot be read as UTF-8"):
        GPT2BPETokenizer(vocab_file, binary)


def corpus_for_bpe() -> list[str]:
    """Generated training text: English, contractions, digits, accents, CJK and emoji."""
    rng = random.Random(0)
    words = (
        "the of and to a in that it is was he for on are as with his they at be this from "
        "I have or by one had not but what all were when we there can an your which their "
        "it's don't they'll we've I'm she'd you're 1813 42 3.14 1,000 café naïve façade "
        "東京 日本語 😀 🎉 -- ... !? ( ) [ ]"
    ).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(400)]


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory):
    """A ByteLevel BPE trained with HuggingFace `tokenizers`: (its files, the model)."""
    tokenizers = pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("bpe")
    model = tokenizers.ByteLevelBPETokenizer()
    model.train_from_iterator(
        corpus_for_bpe(),
        vocab_size=800,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    model.save_model(str(directory))
    return (directory / "vocab.json", directory / "merges.txt"), model


@pytest.mark.parametrize("text", TEXTS + TRICKY)
def test_gpt2_bpe_matches_huggingface_tokenizers(trained_bpe, text):
    (vocab_file, merge_file), model = trained_bpe
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    ids = tokenizer.tokenize(text)
    assert ids == model.encode(text).ids
    assert tokenizer.detokenize(ids) == text


def test_gpt2_bpe_matches_huggingface_on_a_long_text(trained_bpe):
    (vocab_file, merge_file), model = trained_bpe
    text = "\n\n".join(corpus_for_bpe()[:100] + TRICKY)
    ids = GPT2BPETokenizer(vocab_file, merge_file).tokenize(text)
    assert ids == model.encode(text).ids
    # Merges happened: far fewer ids than bytes.
    assert len(ids) < len(text.encode("utf-8")) / 2


def test_gpt2_bpe_matches_transformers_gpt2_tokenizer(trained_bpe):
    transformers = pytest.importorskip("transformers")
    (vocab_file, merge_file), _ = trained_bpe
    reference = transformers.GPT2TokenizerFast.from_pretrained(
        str(vocab_file.parent), local_files_only=True
    )
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    assert tokenizer.eod == reference.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.vocab_size == len(reference)
    eod_texts = ["a <|endoftext|> b", "<|endoftext|>", "x<|endoftext|><|endoftext|>y \n"]
    for text in TEXTS + TRICKY + eod_texts:
        expected = reference(text, add_special_tokens=False).input_ids
        assert tokenizer.tokenize(text) == expected, text


# SentencePieceTokenizer --------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """A 320-piece BPE SentencePiece model with byte fallback, on generated text."""
    sentencepiece = pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("spm")
    (directory / "train.txt").write_text("\n".join(corpus_for_bpe()), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "train.txt"),
        model_prefix=str(directory / "tiny"),
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        # Identity normalisation and kept whitespace, so every text round-trips exactly.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return directory / "tiny.model"


@pytest.mark.parametrize("text", TEXTS + TRICKY)
def test_sentencepiece_round_trip(sentencepiece_model, text):
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    ids = tokenizer.tokenize(text)
    assert all(0 <= index < tokenizer.vocab_size for index in ids)
    assert tokenizer.detokenize(ids) == text


def test_sentencepiece_tokenizer_reads_the_models_own_ids(sentencepiece_model):
    """Megatron-LM 0.19's `SentencePieceTokenizer`: nothing appended to the vocabulary, EOS is
    the end of document, and a special piece's text is encoded as text (before: `<CLS> <SEP>
    <EOD> <MASK> <PAD>` appended, `<EOD>` the end of document, special text its id)."""
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    assert tokenizer.vocab_size == len(processor) == 320
    assert (tokenizer.eod, tokenizer.eos, tokenizer.bos) == (
        processor.eos_id(),
        processor.eos_id(),
        processor.bos_id(),
    )
    text = "x <s> y </s> z<EOD>"
    assert tokenizer.tokenize(text) == processor.encode_as_ids(text)
    assert tokenizer.eod not in tokenizer.tokenize(text)


def test_sentencepiece_errors(tmp_path, sentencepiece_model):
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model .*nope.model: no such file"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=tmp_path / "nope.model")
    not_a_model = tmp_path / "text.model"
    not_a_model.write_text("not a model", encoding="utf-8")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=not_a_model)


def test_sentencepiece_missing_package_message(tmp_path, monkeypatch):
    """Runs without the package installed too: the import fails before the model is read."""
    model = tmp_path / "any.model"
    model.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)


# GPTSentencePieceTokenizer / Llama2Tokenizer -------------------------------------------------


@pytest.mark.parametrize(
    "tokenizer_type", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
)
@pytest.mark.parametrize("text", TEXTS + TRICKY)
def test_sentencepiece_model_ids_are_the_models(sentencepiece_model, tokenizer_type, text):
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model=sentencepiece_model)
    ids = tokenizer.tokenize(text)
    assert ids == processor.encode_as_ids(text)
    assert tokenizer.detokenize(ids) == text
    assert tokenizer.vocab_size == len(processor) == 320
    assert (tokenizer.eod, tokenizer.eos, tokenizer.bos) == (
        processor.eos_id(),
        processor.eos_id(),
        processor.bos_id(),
    )


def test_sentencepiece_model_errors(tmp_path, sentencepiece_model):
    with pytest.raises(FileNotFoundError, match="Llama2Tokenizer reads a SentencePiece"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"junk")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=tmp_path / "junk.model")
    with pytest.raises(ValueError, match="does not read --vocab-size"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=sentencepiece_model, vocab_size=3)
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    with pytest.raises(ValueError, match=r"id 320 is not in \[0, 320\)"):
        tokenizer.detokenize([5, 320])


def test_sentencepiece_model_without_eos_is_refused(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    (tmp_path / "train.txt").write_text("\n".join(corpus_for_bpe()), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "train.txt"),
        model_prefix=str(tmp_path / "no_eos"),
        vocab_size=200,
        model_type="bpe",
        eos_id=-1,
        minloglevel=2,
    )
    with pytest.raises(ValueError, match="has no EOS piece"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=tmp_path / "no_eos.model")


# HuggingFaceTokenizer ----------------------------------------------------------------------


def save_huggingface_tokenizer(directory, trained_bpe, **special_tokens) -> None:
    transformers = pytest.importorskip("transformers")
    _, model = trained_bpe
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model._tokenizer, **special_tokens
    )
    wrapped.save_pretrained(str(directory))


@pytest.fixture(scope="module")
def huggingface_dir(tmp_path_factory, trained_bpe):
    directory = tmp_path_factory.mktemp("hf")
    save_huggingface_tokenizer(directory, trained_bpe, eos_token="<|endoftext|>")
    return directory


@pytest.mark.parametrize("text", TEXTS + TRICKY)
def test_huggingface_round_trip(huggingface_dir, trained_bpe, text):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=huggingface_dir)
    ids = tokenizer.tokenize(text)
    assert ids == trained_bpe[1].encode(text).ids
    assert tokenizer.detokenize(ids) == text


def test_huggingface_special_tokens(huggingface_dir, trained_bpe):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(huggingface_dir))
    endoftext = trained_bpe[1].token_to_id("<|endoftext|>")
    assert tokenizer.eod == tokenizer.eos == endoftext
    assert tokenizer.vocab_size == trained_bpe[1].get_vocab_size() == len(tokenizer.vocab)
    assert tokenizer.inv_vocab[endoftext] == "<|endoftext|>"
    with pytest.raises(NotImplementedError, match="has no attribute 'bos'"):
        tokenizer.bos  # noqa: B018
    with pytest.raises(NotImplementedError, match="has no attribute 'pad'"):
        tokenizer.pad  # noqa: B018


def test_huggingface_without_eos_has_no_eod(tmp_path, trained_bpe):
    save_huggingface_tokenizer(tmp_path, trained_bpe)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path)
    with pytest.raises(NotImplementedError, match="eos_token"):
        tokenizer.eod  # noqa: B018


def test_huggingface_without_eos_ends_documents_with_sep(tmp_path, trained_bpe):
    """A BERT-style tokenizer (SEP and CLS, no EOS or BOS): Megatron-LM's fallbacks make SEP
    the end of document and CLS the beginning (before: no end-of-document id)."""
    save_huggingface_tokenizer(tmp_path, trained_bpe, sep_token="<|endoftext|>", cls_token="Ġthe")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path)
    model = trained_bpe[1]
    assert tokenizer.eod == tokenizer.eos == model.token_to_id("<|endoftext|>")
    assert tokenizer.bos == model.token_to_id("Ġthe")


@pytest.mark.parametrize("tokenizer_type", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_vocab_size_flag_is_ignored_where_the_files_give_the_vocabulary(
    tokenizer_type, hand_bpe, huggingface_dir, caplog
):
    """As Megatron-LM (whose Llama 3 launch scripts pass --vocab-size with
    HuggingFaceTokenizer), with a warning; the library's `build_tokenizer` still refuses it."""
    files = {
        "GPT2BPETokenizer": ["--vocab-file", str(hand_bpe[0]), "--merge-file", str(hand_bpe[1])],
        "HuggingFaceTokenizer": ["--tokenizer-model", str(huggingface_dir)],
    }[tokenizer_type]
    flags = ["--tokenizer-type", tokenizer_type, *files]
    expected = tokenizer_from_args(parse_args(args=flags)).vocab_size
    with caplog.at_level("WARNING"):
        tokenizer = tokenizer_from_args(parse_args(args=[*flags, "--vocab-size", "1000"]))
    assert tokenizer.vocab_size == expected != 1000
    assert f"--tokenizer-type {tokenizer_type} takes its vocabulary from its files" in caplog.text
    assert "--vocab-size 1000 is ignored" in caplog.text


def test_huggingface_errors(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(FileNotFoundError, match="must be a local directory holding tokenizer"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="no-such-org/no-such-model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="must hold tokenizer files"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=empty)


def test_huggingface_missing_package_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install transformers"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path)
