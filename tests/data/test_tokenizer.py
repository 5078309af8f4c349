"""The Tokenizer wrapper and train_tokenizer defaults, on a tiny BPE model trained here (< 1 s)."""

import hashlib
import os
import random
import re

import pytest
import sentencepiece as spm

from paxlite.data.tokenizer import (
    Tokenizer,
    VocabError,
    bind_model_vocab,
    resolve_vocab_path,
)
from paxlite.data.train_tokenizer import sample_sentences, train_tokenizer

WORDS = (
    "the of and to in is was he for it with as his on be at by had not are but from or have an "
    "they which one you were her all she there would their we him been has when who will more no "
    "if out so said what up its about into than them can only other new some could time these two"
    " may"
).split()
VOCAB = 350  # 3 special + 256 byte pieces + ~40 characters leave ~50 merges


def english_like_text(*, lines: int = 300, seed: int = 0) -> str:
    """Sentences of common words, half of them ending in a number (frequent enough that BPE would
    merge "12345" into one piece without split_digits)."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize()
        if i % 2 == 0:
            sentence += f" {rng.choice(['12345', '2024', '12345 12345'])}"
        out.append(sentence + ".")
        if i % 5 == 4:
            out.append("")
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    corpus.write_text(english_like_text())
    return train_tokenizer([str(corpus)], str(root / "tiny"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tok(model_path) -> Tokenizer:
    return Tokenizer(model_path)


def test_ids_follow_t5_conventions(tok, model_path):
    assert tok.vocab_size == VOCAB
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, None)
    proto = spm.SentencePieceProcessor(model_file=model_path)
    assert proto.unk_id() == 2 and proto.bos_id() == -1
    assert tok.path == os.path.abspath(model_path)
    with open(model_path, "rb") as f:
        assert tok.sha256() == hashlib.sha256(f.read()).hexdigest()


def test_round_trip_is_exact(tok):
    texts = ["The time is now.", "  two  spaces and a tab\there\n\nnew paragraph", "Him 2024"]
    for text in texts:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch([]) == []


def test_ids_past_the_vocabulary_decode_to_nothing(tok):
    """A model's vocabulary is often padded past its tokenizer's; generation may pick those ids,
    and they decode to nothing, as transformers' tokenizers decode them (SentencePiece raises)."""
    ids = tok.encode("The time is now.")
    padded = [tok.vocab_size, *ids[:2], tok.vocab_size + 5, *ids[2:], 10**6]
    assert tok.decode(padded) == "The time is now."


def test_byte_fallback_round_trips_unseen_characters(tok):
    text = "naïve ✓ 中文 emoji 🙂"
    ids = tok.encode(text)
    assert 2 not in ids  # no unk: unseen characters become byte pieces
    assert "<0xE2>" in [tok.id_to_piece(i) for i in ids]  # first UTF-8 byte of "✓"
    assert tok.decode(ids) == text


def test_split_digits_gives_one_piece_per_digit(tok, tmp_path):
    pieces = [tok.id_to_piece(i) for i in tok.encode("12345")]
    assert [p.replace("\u2581", "") for p in pieces if p != "\u2581"] == list("12345")
    assert len(pieces) in (5, 6)  # 5 digits, possibly after a lone word-boundary piece
    # Control: the same corpus without split_digits does merge the number.
    lines = [line for line in english_like_text().split("\n") if line]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(tmp_path / "merged"), vocab_size=VOCAB,
        model_type="bpe", byte_fallback=True, split_digits=False, minloglevel=2,
    )
    merged = spm.SentencePieceProcessor(model_file=str(tmp_path / "merged.model"))
    assert len(merged.encode("12345")) < 5


def test_missing_model_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.model"):
        Tokenizer(tmp_path / "nope.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(VocabError, match="bad.model"):
        Tokenizer(bad)


def test_resolve_vocab_path_precedence(tmp_path):
    flag, env = tmp_path / "flag.model", tmp_path / "env.model"
    flag.write_bytes(b"x")
    env.write_bytes(b"x")
    assert resolve_vocab_path(str(flag), environ={"VOCAB_PATH": str(env)}) == str(flag)
    assert resolve_vocab_path(None, environ={"VOCAB_PATH": str(env)}) == str(env)
    assert resolve_vocab_path("", environ={"VOCAB_PATH": str(env)}) == str(env)
    with pytest.raises(VocabError, match=r"--fdl\.VOCAB_PATH.*VOCAB_PATH environment"):
        resolve_vocab_path(None, environ={})
    with pytest.raises(VocabError, match="missing.model"):
        resolve_vocab_path(str(tmp_path / "missing.model"), environ={"VOCAB_PATH": str(env)})
    with pytest.raises(VocabError, match="gone.model.*environment"):
        resolve_vocab_path(None, environ={"VOCAB_PATH": str(tmp_path / "gone.model")})


def test_a_tokenizer_larger_than_the_model_refuses_only_texts_past_its_rows(model_path, tok):
    """As transformers runs such a model: binding is never refused; a text is, once it holds an id
    the embedding has no row for, naming the piece and the id; texts below the bound encode as
    they did unbound."""
    last = VOCAB - 1
    piece = tok.id_to_piece(last)
    text = piece.replace("\u2581", " ")
    assert last in tok.encode(text)  # the piece's own text holds it
    plain = "the cat"
    assert max(tok.encode(plain)) < last
    for rows in (VOCAB, 512):
        bound = Tokenizer(model_path)
        bind_model_vocab(bound, vocab_size=rows)
        assert bound.encode(text) == tok.encode(text)
    bound = Tokenizer(model_path)
    bind_model_vocab(bound, vocab_size=last)
    assert bound.encode(plain) == tok.encode(plain)
    assert bound.encode_batch([plain, plain]) == [tok.encode(plain)] * 2
    said = rf"{re.escape(repr(piece))} \(id {last}\).*0\.\.{last - 1}"
    with pytest.raises(VocabError, match=said):
        bound.encode(text)
    with pytest.raises(VocabError, match=rf"id {last}"):
        bound.encode_batch([plain, text])


def test_sample_sentences_is_a_seeded_uniform_subset():
    docs = [f"line {i}\nother {i}\n\n" for i in range(100)]
    everything = {line for d in docs for line in d.split("\n") if line}
    sample = sample_sentences(docs, max_sentences=30, seed=1)
    assert len(sample) == 30 and len(set(sample)) == 30 and set(sample) <= everything
    assert sample == sample_sentences(docs, max_sentences=30, seed=1)
    assert sample != sample_sentences(docs, max_sentences=30, seed=2)
    assert sorted(sample_sentences(docs, max_sentences=1000, seed=0)) == sorted(everything)
    # Uniform: the first and the last line are each kept with probability 30/200 = 0.15, so in
    # 300 seeds about 45 times (binomial std 6.2).
    samples = [sample_sentences(docs, max_sentences=30, seed=s) for s in range(300)]
    assert 25 < sum("line 0" in s for s in samples) < 65
    assert 25 < sum("other 99" in s for s in samples) < 65


def test_train_tokenizer_unigram_and_refuses_overwrite(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(english_like_text(lines=200, seed=3))
    path = train_tokenizer([corpus], tmp_path / "uni", vocab_size=320, model_type="unigram")
    assert Tokenizer(path).vocab_size == 320
    before = os.path.getmtime(path)
    with pytest.raises(FileExistsError, match="uni.model"):
        train_tokenizer([corpus], tmp_path / "uni", vocab_size=320)
    assert os.path.getmtime(path) == before
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer([corpus], tmp_path / "x", vocab_size=320, model_type="wordpiece")
