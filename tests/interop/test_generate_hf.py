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
