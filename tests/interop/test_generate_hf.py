"""A tiny HF LLaMA loaded with hf.load generates, greedily, exactly transformers' generate tokens;
and, converted to a paxlite checkpoint, the same through `python -m paxlite generate`."""

import dataclasses
import json

import numpy as np

from paxlite.__main__ import main
from paxlite.interop import hf
from paxlite.models.decode import generate

PROMPTS = [[17, 3, 99, 200, 5, 8], [61], [4, 250, 12]]
NEW = 8


def _hf_greedy(model, prompt, new, eos):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_matches_transformers(llama_gqa, tmp_path, capsys):
    directory, model = llama_gqa
    eos = model.config.eos_token_id
    want = [_hf_greedy(model, p, NEW, eos) for p in PROMPTS]
    assert len({tuple(w) for w in want}) == len(want)  # the prompts lead to different tokens
    pretrained = hf.load(directory)
    config = dataclasses.replace(pretrained.config, scan_layers=False)  # params are unstacked
    got = generate(config, pretrained.params, PROMPTS, max_new_tokens=NEW, eos_id=eos)
    assert got == want

    converted = hf.to_paxlite(pretrained, tmp_path / "converted")
    flags = [f"--prompt_ids={','.join(map(str, p))}" for p in PROMPTS]
    assert main(["generate", f"--checkpoint={converted}", *flags, f"--max_new_tokens={NEW}",
                 "--format=json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # no tokenizer, so no EOS: the CLI runs to max_new_tokens; up to HF's EOS the tokens agree
    for record, ids in zip(records, want, strict=True):
        assert record["ids"][:len(ids)] == ids
    assert np.all([len(r["ids"]) == NEW for r in records])


TEXTS = ["the quick brown fox", "hello world! said 7"]
TEXT_NEW = 6


def _hf_text_greedy(model, ids, *, vocab: int, eos: int):
    """transformers' greedy continuation of `ids`, over the model's whole vocabulary (padded
    beyond the tokenizer's ``vocab``, as real models' are)."""
    import torch

    assert vocab < model.config.vocab_size
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=TEXT_NEW,
                             eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def test_text_prompts_of_a_converted_llama_start_with_bos_as_in_transformers(
        llama_gqa, tmp_path, capsys):
    """An HF LLaMA directory with a SentencePiece tokenizer (BOS 1, EOS 2), converted: `generate
    --prompt=TEXT` encodes the text as transformers' own LlamaTokenizer does (BOS first) and
    continues it with transformers' greedy tokens; --add_bos=false gives the ids without BOS and
    their own (different) continuation. convert copies the tokenizer beside the checkpoint, so no
    VOCAB_PATH is needed."""
    import shutil

    import sentencepiece as spm
    from transformers import AutoTokenizer

    from paxlite.interop.hf_write import write_tokenizer
    from tests.interop.test_hf_export import train_bpe

    directory, model = llama_gqa
    with_tokenizer = tmp_path / "hf"
    shutil.copytree(directory, with_tokenizer)
    write_tokenizer(str(with_tokenizer), path=train_bpe(tmp_path / "spm"))
    assert main(["convert", "--from=hf", "--to=paxlite", f"--input={with_tokenizer}",
                 f"--output={tmp_path / 'pax'}"]) == 0
    assert (tmp_path / "pax" / "tokenizer.model").read_bytes() == (
        with_tokenizer / "tokenizer.model").read_bytes()
    assert (tmp_path / "pax" / "tokenizer_config.json").read_bytes() == (  # add_bos_token with it
        with_tokenizer / "tokenizer_config.json").read_bytes()
    hf_tokenizer = AutoTokenizer.from_pretrained(with_tokenizer)
    sp = spm.SentencePieceProcessor(model_file=str(with_tokenizer / "tokenizer.model"))
    vocab, eos = sp.get_piece_size(), sp.eos_id()
    capsys.readouterr()

    def paxlite_records(*flags):
        assert main(["generate", f"--checkpoint={tmp_path / 'pax'}",
                     *[f"--prompt={t}" for t in TEXTS], f"--max_new_tokens={TEXT_NEW}",
                     "--format=json", *flags]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    with_bos, without_bos = paxlite_records(), paxlite_records("--add_bos=false")
    assert paxlite_records("--add_bos=true") == with_bos
    for text, record, plain in zip(TEXTS, with_bos, without_bos, strict=True):
        hf_ids = hf_tokenizer(text)["input_ids"]
        assert hf_ids[0] == sp.bos_id() == 1 and hf_ids[1:] == sp.encode(text)
        assert record["prompt_ids"] == hf_ids and record["prompt"] == text
        assert record["ids"] == _hf_text_greedy(model, hf_ids, vocab=vocab, eos=eos)
        assert plain["prompt_ids"] == sp.encode(text)
        assert plain["ids"] == _hf_text_greedy(model, sp.encode(text), vocab=vocab, eos=eos)
    assert [r["ids"] for r in with_bos] != [r["ids"] for r in without_bos]  # BOS matters here


def test_a_tokenizer_config_beside_the_tokenizer_decides_bos(llama_gqa, tmp_path, capsys):
    """add_bos_token of the tokenizer_config.json beside the tokenizer (transformers' setting)
    overrides the tokenizer's own BOS under --add_bos=auto."""
    from paxlite.interop.hf_write import write_tokenizer
    from tests.interop.test_hf_export import train_bpe

    directory, _ = llama_gqa
    hf.to_paxlite(hf.load(directory), tmp_path / "pax")
    converted = tmp_path / "pax"  # as `convert` writes it: the tokenizer beside model_config.json
    write_tokenizer(str(converted), path=train_bpe(tmp_path / "spm"))
    config_path = converted / "tokenizer_config.json"
    firsts = {}
    for adds in (True, False):
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()),
                                           "add_bos_token": adds}))
        assert main(["generate", f"--checkpoint={converted}", "--prompt=the lazy dog",
                     "--max_new_tokens=1", "--format=json"]) == 0
        firsts[adds] = json.loads(capsys.readouterr().out)["prompt_ids"][0]
    assert firsts[True] == 1 and firsts[False] != 1
    # several processes need an experiment's mesh: refused before connecting to the others
    assert main(["generate", f"--checkpoint={converted}", "--prompt_ids=1", "--multiprocess_gpu",
                 "--server_addr=127.0.0.1:1", "--num_hosts=2", "--host_idx=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "generating over 2 processes needs the experiment's mesh" in err, err
    assert "add --fdl_config=NAME" in err and len(err.splitlines()) == 1, err
