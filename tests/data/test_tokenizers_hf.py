"""tokenizer.json and tiktoken tokenizers against transformers' AutoTokenizer and tiktoken itself,
on tiny tokenizers built here with the `tokenizers` library and saved by transformers."""

import base64
import json
import shutil

import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
tiktoken = pytest.importorskip("tiktoken")

from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from paxlite.data.tokenizer import Tokenizer, TokenizerFormat, VocabError
from paxlite.data.tokenizer_tiktoken import (
    LLAMA3_PATTERN,
    _byte_pieces,
    llama3_special_tokens,
)

CORPUS = [f"{w} number {i}, said the {v} to the {u}.\n" for i, (w, v, u) in enumerate(
    zip(["Hello", "The king", "A fool", "Some  spaces", "tab\there"] * 60,
        ["king", "queen", "fool", "knight", "bishop", "rook"] * 50,
        ["people", "court", "crowd", "world"] * 75, strict=False))]
TEXTS = [
    "", "hello world", "Hello   world\n\n  with  runs\tof whitespace  ", "The king said.\r\n",
    "<|begin_of_text|>the fool<|eot_id|> and more", "汉字 and ひらがな", "emoji 😀👍🏽 end",
    "combining e\u0301 and a\u0308", "  leading", "trailing  ", "\n", "123456789 digits 42",
]


def _save(tokenizer, directory, **special):
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(directory)
    return directory


def _check_against_transformers(directory, texts=tuple(TEXTS)):
    ours, theirs = Tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    for text in texts:
        assert ours.encode(text, add_bos=ours.adds_bos) == theirs(text)["input_ids"], text
        plain = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == plain, text
        assert ours.decode(plain) == theirs.decode(plain), text
    assert ours.encode_batch(TEXTS) == [theirs(t, add_special_tokens=False)["input_ids"]
                                        for t in TEXTS]
    every = list(range(ours.vocab_size))
    assert ours.decode(every) == theirs.decode(every)
    assert [ours.id_to_piece(i) for i in every] == theirs.convert_ids_to_tokens(every)
    return ours


@pytest.fixture(scope="module")
def llama3_like(tmp_path_factory):
    """A byte-level BPE with LLaMA-3's pre-tokenizer and post-processor, its special tokens after
    the ranks; (its directory, the ranks a tiktoken file holds for the same merges)."""
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre
    trained.train_from_iterator(CORPUS, tokenizers.trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    merges = json.loads(trained.to_str())["model"]["merges"]
    byte_of = {piece: byte for byte, piece in enumerate(_byte_pieces())}
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in merges:
        token = bytes(byte_of[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    # LLaMA-3's tokenizer.json: vocab = ranks (as byte-level strings), merges in rank order
    vocab = {"".join(_byte_pieces()[b] for b in token): rank for token, rank in ranks.items()}
    bpe = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in merges],
                                          ignore_merges=True))
    bpe.pre_tokenizer = pre
    bpe.decoder = decoders.ByteLevel()
    specials = llama3_special_tokens()
    bpe.add_special_tokens(specials)
    assert bpe.token_to_id(specials[0]) == len(ranks)
    bpe.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      special_tokens=[("<|begin_of_text|>", len(ranks))])])
    directory = _save(bpe, tmp_path_factory.mktemp("llama3"), bos_token="<|begin_of_text|>",
                      eos_token="<|end_of_text|>")
    return directory, ranks


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory):
    """A SentencePiece-derived (LLaMA-2 style) tokenizer.json: Metaspace, byte fallback,
    `<s> $A`; only ASCII pieces, so CJK and emoji fall back to bytes."""
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=200, show_progress=False,
                                             special_tokens=["<unk>", "<s>", "</s>"])
    trained = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(CORPUS, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    bpe = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in model["merges"]],
                                          unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.normalizer = trained.normalizer
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bpe.add_special_tokens(["<unk>", "<s>", "</s>"])
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    return _save(bpe, tmp_path_factory.mktemp("fallback"), bos_token="<s>", eos_token="</s>",
                 unk_token="<unk>")


def test_llama3_like_tokenizer_json_equals_transformers(llama3_like):
    directory, ranks = llama3_like
    ours = _check_against_transformers(directory)
    assert ours.format is TokenizerFormat.HF_TOKENIZER_JSON and ours.adds_bos
    assert ours.bos_id == len(ranks) and ours.encode("<|eot_id|>") == [len(ranks) + 9]
    assert ours.path == str(directory / "tokenizer.json")
    assert Tokenizer(directory / "tokenizer.json").sha256() == ours.sha256()


def test_byte_fallback_tokenizer_json_equals_transformers(byte_fallback):
    ours = _check_against_transformers(byte_fallback)
    assert ours.adds_bos and ours.bos_id == 1
    assert ours.encode("汉")[1:] == [3 + b for b in "汉".encode()]  # byte fallback
    # An invalid byte run decodes to one U+FFFD per byte, a valid piece between them kept
    n = ours.encode("N")[-1]
    theirs = AutoTokenizer.from_pretrained(byte_fallback)
    for ids in ([3 + 0xE6, n, 3 + 0xB1], [3 + 0xE6, 3 + 0xB1], [3 + 0xFF, n]):
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode([3 + 0xE6, 3 + 0xB1]) == "\ufffd\ufffd"


# (tokenizer_config.json settings, config.json's model_type or None for no config.json)
LLAMA_CLASS_CASES = {
    "legacy": (dict(tokenizer_class="LlamaTokenizer", legacy=True), "llama"),
    "not legacy": (dict(tokenizer_class="LlamaTokenizerFast", legacy=False), "llama"),
    "legacy unset, no config.json": (dict(tokenizer_class="LlamaTokenizer"), None),
    "no prefix space": (dict(tokenizer_class="LlamaTokenizer", add_prefix_space=False), None),
    # transformers reads these as written (its Mistral or generic reader)
    "mistral": (dict(tokenizer_class="LlamaTokenizer", legacy=False), "mistral"),
}
# text beside special tokens: where "▁" is put differs between the pipelines
AROUND_SPECIALS = ("Hi</s>there", "<s>hello</s>", " Hello", "a </s> b", "  x</s>  y")


@pytest.mark.parametrize("settings, model_type", LLAMA_CLASS_CASES.values(),
                         ids=LLAMA_CLASS_CASES.keys())
def test_a_llama_tokenizer_class_is_built_as_transformers_builds_it(
        tmp_path, byte_fallback, settings, model_type):
    """transformers 5 rebuilds a non-byte-level tokenizer.json whose config names LlamaTokenizer
    (LLaMA-2's hub files: a Prepend + Replace normalizer, which puts one more "▁" before a text
    that starts with a space, and one before the text after each special token)."""
    directory = tmp_path / "llama2"
    shutil.copytree(byte_fallback, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **settings}))
    if model_type is not None:
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours = _check_against_transformers(directory, texts=(*TEXTS, *AROUND_SPECIALS))
    as_written = Tokenizer(byte_fallback)
    rebuilt = model_type != "mistral"
    assert (ours.encode(" Hello") != as_written.encode(" Hello")) is rebuilt
    assert ours.sha256() != as_written.sha256()  # tokenizer_config.json differs


# (fixture, tokenizer_config.json settings, config.json's model_type or None): directories whose
# tokenizer.json is not what the class transformers picks builds, so transformers rebuilds it
OTHER_CLASS_CASES = {
    # Qwen's regex (one digit a piece) and NFC over LLaMA-3's regex; unk/pad '<|endoftext|>' added
    "Qwen2Tokenizer, qwen2": ("llama3_like", dict(tokenizer_class="Qwen2Tokenizer"), "qwen2"),
    "no class, qwen3": ("llama3_like", dict(tokenizer_class=None), "qwen3"),
    # qwen2's hub class is overridden by the registered Qwen2Tokenizer
    "generic class, qwen2": ("llama3_like", dict(tokenizer_class="PreTrainedTokenizerFast"),
                             "qwen2"),
    # read as written: a generic class named under another model type
    "generic class, qwen3": ("llama3_like", dict(tokenizer_class="PreTrainedTokenizerFast"),
                             "qwen3"),
    # Gemma's Replace normalizer and Split pre-tokenizer; its '<pad>' and '<mask>' added
    "GemmaTokenizer, gemma2": ("byte_fallback", dict(tokenizer_class="GemmaTokenizer"), "gemma2"),
    "no class, gemma3_text": ("byte_fallback", dict(tokenizer_class=None), "gemma3_text"),
}


@pytest.mark.parametrize("fixture, settings, model_type", OTHER_CLASS_CASES.values(),
                         ids=OTHER_CLASS_CASES.keys())
def test_the_class_transformers_picks_is_built_as_it_builds_it(
        tmp_path, request, fixture, settings, model_type):
    source = request.getfixturevalue(fixture)
    source = source[0] if isinstance(source, tuple) else source
    directory = tmp_path / "tok"
    shutil.copytree(source, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config = {key: value for key, value in {**config, **settings}.items() if value is not None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    texts = (*TEXTS, "e\u0301t\u00e9 1,234,567 dollars", "x  y\t\tz")
    ours = _check_against_transformers(directory, texts=texts)
    written = Tokenizer(source)
    as_written = "generic" in request.node.callspec.id and "qwen3" in request.node.callspec.id
    assert (ours.encode(texts[-2]) == written.encode(texts[-2])) is as_written
    assert (ours.vocab_size == written.vocab_size) is as_written


def test_a_converted_directory_reads_its_tokenizer_as_its_source_did(tmp_path, byte_fallback):
    """A converted directory holds the tokenizer files but not the HF config.json: the
    model_type `convert` records beside them (tokenizer_model_type.json) keeps transformers'
    choice of class, so a Mistral directory's LlamaTokenizer-named file stays as written there
    too; without the record the directory reads as transformers reads it (rebuilt)."""
    source = tmp_path / "mistral"
    shutil.copytree(byte_fallback, source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps(
        {**config, "tokenizer_class": "LlamaTokenizer", "legacy": False}))
    (source / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    converted, bare = tmp_path / "converted", tmp_path / "bare"
    for directory in (converted, bare):
        directory.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (source / name).is_file():
                shutil.copyfile(source / name, directory / name)
    (converted / "tokenizer_model_type.json").write_text(json.dumps({"model_type": "mistral"}))
    theirs = AutoTokenizer.from_pretrained(source)
    texts = (*TEXTS, *AROUND_SPECIALS)
    ours = Tokenizer(converted)
    for text in texts:
        assert ours.encode(text, add_bos=ours.adds_bos) == theirs(text)["input_ids"], text
    assert Tokenizer(bare).encode(" Hello") != ours.encode(" Hello")  # rebuilt without it
    _check_against_transformers(bare, texts=texts)


def test_no_post_processor_adds_no_bos_and_config_tokens_are_added(tmp_path, byte_fallback):
    """transformers ignores add_bos_token beside a tokenizer.json; without a post-processor it adds
    no BOS; a named special token the tokenizer.json lacks is added (and matched in text)."""
    directory = tmp_path / "plain"
    shutil.copytree(byte_fallback, directory)
    data = json.loads((directory / "tokenizer.json").read_text())
    data["post_processor"] = None
    (directory / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, pad_token="<pad>")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = _check_against_transformers(directory)
    assert ours.adds_bos is False and ours.pad_id == AutoTokenizer.from_pretrained(
        directory).pad_token_id
    assert ours.encode("a<pad>b").count(ours.pad_id) == 1


def test_a_directory_with_both_files_reads_tokenizer_json(tmp_path, byte_fallback):
    from tests.interop.test_hf_export import train_bpe

    directory = tmp_path / "both"
    shutil.copytree(byte_fallback, directory)
    shutil.copyfile(train_bpe(tmp_path / "spm"), directory / "tokenizer.model")
    ours = Tokenizer(directory)
    assert ours.format is TokenizerFormat.HF_TOKENIZER_JSON
    assert ours.path == str(directory / "tokenizer.json")
    alone = Tokenizer(directory / "tokenizer.model")
    assert alone.format is TokenizerFormat.SENTENCEPIECE


def test_tiktoken_file_equals_tiktoken_and_the_same_tokenizer_json(tmp_path, llama3_like):
    directory, ranks = llama3_like
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    ours, as_json = Tokenizer(path), Tokenizer(directory)
    specials = {t: len(ranks) + i for i, t in enumerate(llama3_special_tokens())}
    reference = tiktoken.Encoding(name="t", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                  special_tokens=specials)
    assert ours.format is TokenizerFormat.TIKTOKEN and ours.adds_bos
    assert (ours.vocab_size, ours.bos_id, ours.eos_id) == (len(ranks) + 256, len(ranks),
                                                           len(ranks) + 1)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text, allowed_special="all") == as_json.encode(text), text
        assert ours.decode(ids) == reference.decode(ids) == as_json.decode(ids) == text
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
    invalid = [ranks[bytes([0xE6])], ranks[b"N"], ranks[bytes([0xB1])]]
    assert ours.decode(invalid) == as_json.decode(invalid)
    assert [ours.id_to_piece(i) for i in range(ours.vocab_size)] == [
        as_json.id_to_piece(i) for i in range(ours.vocab_size)]
    assert ours.sha256() == __import__("hashlib").sha256(path.read_bytes()).hexdigest()


def test_a_file_that_is_no_tokenizer_says_what_would_be(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("hello world\nnot base64!! 3\n")
    with pytest.raises(VocabError, match=r"bad\.model.*SentencePiece.*tiktoken.*line 1.*"
                                         r"tokenizer\.json"):
        Tokenizer(bad)
    with pytest.raises(VocabError, match="neither tokenizer.json nor tokenizer.model"):
        Tokenizer(tmp_path)
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{\"model\": 3}")
    with pytest.raises(VocabError, match="not a valid Hugging Face tokenizer.json"):
        Tokenizer(broken)
    with pytest.raises(FileNotFoundError, match="absent.json.*tokenizer.json"):
        Tokenizer(tmp_path / "absent.json")


def test_prepare_with_a_tokenizer_json_directory(tmp_path, llama3_like):
    """`data.prepare` stores the tokenizer.json's ids (no BOS, as for SentencePiece) and records
    the sha256 of the files read; the text pipeline's check accepts the same directory."""
    import numpy as np
    from array_record.python import array_record_module

    from paxlite.data.prepare import prepare
    from paxlite.data.records import shard_paths
    from paxlite.data.tokenizer import tokenizer_sha256

    directory, _ = llama3_like
    docs = [t for t in TEXTS if t.strip()]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    info = prepare([tmp_path / "in.jsonl"], tmp_path / "ds", vocab_path=directory,
                   validation_fraction=0.0)
    tok = Tokenizer(directory)
    assert info.tokenizer["sha256"] == tok.sha256() == tokenizer_sha256(directory)
    assert info.tokenizer["path"] == str(directory / "tokenizer.json")
    assert len(tok.files) == 2  # tokenizer.json and tokenizer_config.json
    reader = array_record_module.ArrayRecordReader(shard_paths(info, "train")[0])
    stored = sorted(reader.read_all())
    reader.close()
    assert stored == sorted(np.asarray(tok.encode(d), "<i4").tobytes() for d in docs)
