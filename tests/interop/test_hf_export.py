"""--to=hf as users load it: sharded safetensors + index, bf16, tokenizer files, transformers'
from_pretrained giving paxlite's logits; the size flag and its mistakes."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from safetensors import safe_open

from paxlite.cli.convert import ConvertRequest, Source, Target, convert
from paxlite.errors import UserError
from paxlite.interop import hf, hf_write
from tests.interop.conftest import TOKENS, hf_logits

TOL = 1e-4
TEXTS = ["hello world!", "the lazy dog said hello to the fox", "a fox, 42 dogs!"]


def train_bpe(root, *, dummy_prefix: bool = True) -> str:
    """A tiny LLaMA-like SentencePiece BPE model (unk 0, bos 1, eos 2; identity normalization,
    whitespace kept; no byte fallback, which needs 256 pieces more than the 256-token test model
    has), 200 pieces, in ``root``; ``dummy_prefix=False``: no "▁" before the text, as Gemma's
    models."""
    import sentencepiece as spm

    root.mkdir(parents=True, exist_ok=True)
    lines = [f"the quick brown fox {i} jumps over the lazy dog, hello world! said {i * 7}"
             for i in range(200)]
    (root / "corpus.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"), model_prefix=str(root / "tok"), vocab_size=200,
        model_type="bpe", byte_fallback=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        add_dummy_prefix=dummy_prefix, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2)
    return str(root / "tok.model")


# Whitespace runs inside the text; a text that starts with a space is encoded with one "▁" fewer
# by transformers' Metaspace pre-tokenizer than by SentencePiece (docs/interop.md).
SPACED_TEXTS = [*TEXTS, "hello  world!", "a   fox ,  42"]


@pytest.mark.parametrize("dummy_prefix,family", [(False, "llama"), (True, "gemma2")])
def test_the_prefix_space_follows_the_model_in_transformers(tmp_path, dummy_prefix, family):
    """add_prefix_space follows the model, and a Gemma model whose tokenizer puts "▁" before the
    text ships LlamaTokenizer, which honours it (GemmaTokenizer never adds it; Gemma's own
    tokenizers, without the prefix: test_hf_gemma.py)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    vocab = train_bpe(tmp_path / "spm", dummy_prefix=dummy_prefix)
    (tmp_path / "out").mkdir()
    hf_write.write_tokenizer(str(tmp_path / "out"), path=vocab, family=family)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert type(tokenizer).__name__ == "LlamaTokenizer"
    sp = spm.SentencePieceProcessor(model_file=vocab)
    for text in SPACED_TEXTS:
        assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)], text


@pytest.mark.parametrize("normalization", [
    {"normalization_rule_name": "nmt_nfkc", "remove_extra_whitespaces": False},
    {"normalization_rule_name": "identity", "remove_extra_whitespaces": True},
])
def test_a_normalizing_tokenizer_is_refused(llama_gqa, tmp_path, normalization):
    """transformers' LlamaTokenizer, built from such a model, skips its normalization and encodes
    other ids than SentencePiece (checked here first): refused in one line, nothing written."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    (tmp_path / "c.txt").write_text("\n".join(f"a fox {i} and a dog" for i in range(300)))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "n"), vocab_size=60,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, minloglevel=2, **normalization)
    vocab = str(tmp_path / "n.model")
    (tmp_path / "shipped").mkdir()
    hf_write.write_tokenizer(str(tmp_path / "shipped"), path=vocab)
    text = "a  fox \uff14\uff12"  # a run of spaces, full-width digits (NFKC: 42)
    sp = spm.SentencePieceProcessor(model_file=vocab)
    assert AutoTokenizer.from_pretrained(tmp_path / "shipped").encode(text)[1:] != sp.encode(text)
    field = ("normalization_rule_name='nmt_nfkc'" if normalization["normalization_rule_name"]
             != "identity" else "remove_extra_whitespaces=true")
    with pytest.raises(UserError, match=rf"n\.model .*\({field}\) before encoding, and "
                                        "transformers' tokenizers built from a SentencePiece"):
        _convert(llama_gqa[0], tmp_path / "never", vocab_path=vocab)
    assert not os.path.exists(tmp_path / "never")


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def hf_with_tokenizer(llama_gqa, spm_model, tmp_path_factory):
    directory, model = llama_gqa
    copy = tmp_path_factory.mktemp("in") / "llama"
    shutil.copytree(directory, copy)
    shutil.copyfile(spm_model, copy / "tokenizer.model")
    return copy, model


def _convert(source, output, **kw):
    return convert(ConvertRequest(source=Source.HF, target=Target.HF, input=str(source),
                                  output=str(output), **kw))


def test_sharded_export_loads_in_transformers_with_paxlite_logits(hf_with_tokenizer, spm_model,
                                                                  tmp_path):
    import sentencepiece as spm
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, model = hf_with_tokenizer
    pretrained = _convert(directory, tmp_path / "out", max_shard_size="100KB")
    files = sorted(os.listdir(tmp_path / "out"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {"model.safetensors.index.json", "config.json", "generation_config.json",
            "tokenizer.model", "tokenizer_config.json"} <= set(files)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    sizes = 0
    for shard in shards:
        with safe_open(str(tmp_path / "out" / shard), framework="np") as f:
            names = list(f.keys())
            arrays = [f.get_tensor(n) for n in names]
        assert all(index["weight_map"][n] == shard for n in names)
        shard_bytes = sum(a.nbytes for a in arrays)
        assert shard_bytes <= 100_000 or len(arrays) == 1, (shard, shard_bytes)
        sizes += shard_bytes
    assert index["metadata"]["total_size"] == sizes == pretrained.num_params * 4
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(reloaded), pretrained.logits(TOKENS), atol=TOL, rtol=0)
    np.testing.assert_allclose(hf_logits(reloaded), hf_logits(model), atol=TOL, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    sp = spm.SentencePieceProcessor(model_file=spm_model)
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)]
        assert tokenizer.decode(sp.encode(text)) == sp.decode(sp.encode(text))
    assert tokenizer.eos_token_id == sp.eos_id() and tokenizer.unk_token_id == sp.unk_id()


def test_bfloat16_export_and_vocab_path(llama_gqa, spm_model, tmp_path):
    import ml_dtypes
    import torch
    from transformers import AutoModelForCausalLM

    directory, _ = llama_gqa  # no tokenizer.model: --vocab_path names one
    _convert(directory, tmp_path / "bf16", dtype="bfloat16", vocab_path=spm_model)
    out = tmp_path / "bf16"
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "special_tokens_map.json", "tokenizer.model",
                                       "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="np") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {np.dtype(ml_dtypes.bfloat16)}  # noqa: SIM118
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # Reference: paxlite in float32 on the same bf16-rounded weights (so the tolerance stays tight).
    rounded = hf.load(directory, dtype="bfloat16")
    rounded = dataclasses.replace(
        rounded, params=hf.cast_params(rounded.params, "float32"),
        config=dataclasses.replace(rounded.config, dtype="float32", param_dtype="float32"))
    np.testing.assert_allclose(hf_logits(reloaded), rounded.logits(TOKENS), atol=TOL, rtol=0)


def test_without_tokenizer_no_tokenizer_files(llama_gqa, tmp_path):
    _convert(llama_gqa[0], tmp_path / "plain")
    assert sorted(os.listdir(tmp_path / "plain")) == [
        "config.json", "generation_config.json", "model.safetensors"]


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 10**9), ("500MB", 500 * 10**6),
                                            ("2GiB", 2 * 2**30), ("1000", 1000), (4096, 4096),
                                            ("1.5KB", 1500)])
def test_parse_size(text, size):
    assert hf_write.parse_size(text) == size


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_shard_size": "5 parsecs"}, r"--max_shard_size='5 parsecs' is not a size"),
        ({"max_shard_size": "0"}, "must be a positive size"),
        (
            {"vocab_path": "/nonexistent/tok.model"},
            "--vocab_path=/nonexistent/tok.model does not exist",
        ),
    ],
)
def test_bad_flags_refused_before_writing(llama_gqa, tmp_path, kw, match):
    with pytest.raises(UserError, match=match):
        _convert(llama_gqa[0], tmp_path / "never", **kw)
    assert not os.path.exists(tmp_path / "never")


def test_hf_flags_refused_for_other_targets(llama_gqa, tmp_path):
    with pytest.raises(UserError, match=r"--max_shard_size only applies to --to=hf"):
        convert(ConvertRequest(source=Source.HF, target=Target.PAXLITE, input=str(llama_gqa[0]),
                               output=str(tmp_path / "x"), max_shard_size="1GB"))


def test_tokenizer_larger_than_model_vocab_is_shipped_as_transformers_runs_it(llama_gqa, tmp_path):
    """transformers loads a model whose tokenizer has more pieces than its embedding has rows,
    and runs it on a text whose ids fit: so the export does not refuse it."""
    import sentencepiece as spm
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lines = [f"w{i} x{i * 3} y{i * 7} zz{i}" for i in range(2000)]
    (tmp_path / "c.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "c.txt"),
        model_prefix=str(tmp_path / "big"),
        vocab_size=400,
        model_type="bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    out = tmp_path / "shipped"
    _convert(llama_gqa[0], out, vocab_path=str(tmp_path / "big.model"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert len(tokenizer) == 400 and model.config.vocab_size == 256
    ids = [i for i in tokenizer.encode("w1 x3 y7 zz1") if i < 256]
    assert len(ids) >= 2
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 256)


def test_unigram_tokenizer_refused(llama_gqa, tmp_path):
    """LlamaTokenizer rebuilds a SentencePiece model as BPE: a unigram model would encode
    differently, so it is refused rather than shipped."""
    import sentencepiece as spm

    (tmp_path / "c.txt").write_text("\n".join(f"a fox {i} and a dog" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "u"),
                                   vocab_size=40, model_type="unigram", minloglevel=2)
    with pytest.raises(UserError, match=r"is a UNIGRAM SentencePiece model; transformers' "
                                        "LlamaTokenizer .* BPE models only"):
        _convert(llama_gqa[0], tmp_path / "never", vocab_path=str(tmp_path / "u.model"))
    assert not os.path.exists(tmp_path / "never")
