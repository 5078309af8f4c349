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


def test_a_converted_model_brings_its_tokenizer_for_text_prompts(llama_gqa, tmp_path, capsys):
    """convert --from=hf --to=paxlite copies the input's tokenizer.model beside the checkpoint;
    generate --checkpoint reads it, so a text prompt works without VOCAB_PATH."""
    import shutil

    import sentencepiece as spm

    from tests.interop.test_hf_export import train_bpe

    directory, _ = llama_gqa
    with_tokenizer = tmp_path / "hf"
    shutil.copytree(directory, with_tokenizer)
    shutil.copyfile(train_bpe(tmp_path / "spm"), with_tokenizer / "tokenizer.model")
    assert main(["convert", "--from=hf", "--to=paxlite", f"--input={with_tokenizer}",
                 f"--output={tmp_path / 'pax'}"]) == 0
    assert (tmp_path / "pax" / "tokenizer.model").read_bytes() == (
        with_tokenizer / "tokenizer.model").read_bytes()
    capsys.readouterr()
    assert main(["generate", f"--checkpoint={tmp_path / 'pax'}", "--prompt=the quick brown fox",
                 "--max_new_tokens=4", "--format=json"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "pax" / "tokenizer.model"))
    assert record["prompt_ids"] == sp.encode("the quick brown fox")
    assert isinstance(record["text"], str) and len(record["ids"]) >= 1
