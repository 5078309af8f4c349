"""A converted HF model whose directory carries a tokenizer.json: `generate --prompt=TEXT` reads
it (before the SentencePiece tokenizer.model beside it), with BOS as its post-processor adds it,
and continues exactly as transformers' AutoTokenizer and greedy generate do."""

import json
import shutil

import pytest

from paxlite.__main__ import main

NEW = 5
TEXTS = ["the quick brown fox", "hello  world\nsaid 7"]


def _tokenizer_json(directory):
    """A tiny Metaspace BPE (vocab < the model's 256) with a `<s> $A` post-processor."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bpe = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    corpus = [f"the quick brown fox {i} said hello world to the lazy dog" for i in range(50)]
    bpe.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)


def test_generate_reads_the_tokenizer_json_a_conversion_copied(llama_gqa, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    import torch
    from transformers import AutoTokenizer

    from tests.interop.test_hf_export import train_bpe

    source, model = llama_gqa
    hf_dir = tmp_path / "hf"
    shutil.copytree(source, hf_dir)
    _tokenizer_json(hf_dir)
    shutil.copyfile(train_bpe(tmp_path / "spm"), hf_dir / "tokenizer.model")  # loses to .json
    # transformers 5 keeps a chat template beside tokenizer_config.json: chat SFT reads it there
    (hf_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}"
                                                "{% endfor %}")
    out = tmp_path / "pax"
    convert = ["convert", "--from=hf", "--to=paxlite", f"--input={hf_dir}", f"--output={out}"]
    assert main(convert) == 0
    assert main([*convert, "--overwrite"]) == 0  # every file it wrote is a conversion's
    capsys.readouterr()
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer.model").is_file()
    # the HF model's model_type, which transformers' choice of tokenizer class reads
    assert json.loads((out / "tokenizer_model_type.json").read_text()) == {"model_type": "llama"}
    template = "chat_template.jinja"
    assert (out / template).read_bytes() == (hf_dir / template).read_bytes()
    assert main(["generate", f"--checkpoint={out}", *[f"--prompt={t}" for t in TEXTS],
                 f"--max_new_tokens={NEW}", "--format=json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    assert len(theirs) < model.config.vocab_size  # ids past the tokenizer's can be generated
    for record, text in zip(records, TEXTS, strict=True):
        ids = theirs(text)["input_ids"]
        assert record["prompt_ids"] == ids and ids[0] == theirs.bos_token_id
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                  eos_token_id=theirs.eos_token_id,
                                  pad_token_id=theirs.eos_token_id)
        assert record["ids"] == want[0, len(ids):].tolist()
        assert record["prompt"] == theirs.decode(ids)
        assert record["prompt"] + record["text"] == theirs.decode(ids + record["ids"])
    # ... and converted back, it ships the same tokenizer files, which transformers reads alike
    back = tmp_path / "hf_again"
    assert main(["convert", "--from=paxlite", "--to=hf", f"--input={out}",
                 f"--output={back}"]) == 0
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", template):
        assert (back / name).read_bytes() == (hf_dir / name).read_bytes(), name
    # a paxlite checkpoint records no BOS / EOS ids: they are the shipped tokenizer's, so
    # transformers' generate stops at EOS as it does on the source
    for name in ("config.json", "generation_config.json"):
        written = json.loads((back / name).read_text())
        assert (written["bos_token_id"], written["eos_token_id"]) == (
            theirs.bos_token_id, theirs.eos_token_id) == (1, 2), name
    # an HF -> HF conversion (a dtype change, say) ships the same files
    direct = tmp_path / "hf_direct"
    assert main(["convert", "--from=hf", "--to=hf", f"--input={hf_dir}",
                 f"--output={direct}"]) == 0
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", template):
        assert (direct / name).read_bytes() == (hf_dir / name).read_bytes(), name
    again = AutoTokenizer.from_pretrained(back)
    for text in TEXTS:
        assert again(text)["input_ids"] == theirs(text)["input_ids"]


def test_a_tokenizer_with_more_tokens_than_the_model_generates_as_transformers_does(
        llama_gqa, tmp_path, capsys):
    """transformers runs a model whose tokenizer has more tokens than its embedding has rows (the
    logits never produce the extra ids): a prompt below the rows continues as transformers
    continues it, and one holding an id past them is refused in one line (transformers fails there
    with an index error)."""
    pytest.importorskip("tokenizers")
    import torch
    from transformers import AutoTokenizer

    source, model = llama_gqa
    rows = model.config.vocab_size
    hf_dir = tmp_path / "hf"
    shutil.copytree(source, hf_dir)
    _tokenizer_json(hf_dir)
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    theirs.add_tokens([f"<extra_{i}>" for i in range(rows + 10 - len(theirs))])
    theirs.save_pretrained(hf_dir)
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    assert len(theirs) == rows + 10
    out = tmp_path / "pax"
    assert main(["convert", "--from=hf", "--to=paxlite", f"--input={hf_dir}",
                 f"--output={out}"]) == 0
    capsys.readouterr()
    text = TEXTS[0]
    assert main(["generate", f"--checkpoint={out}", f"--prompt={text}",
                 f"--max_new_tokens={NEW}", "--format=json"]) == 0
    record = json.loads(capsys.readouterr().out)
    ids = theirs(text)["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                              eos_token_id=theirs.eos_token_id, pad_token_id=theirs.eos_token_id)
    assert record["prompt_ids"] == ids and record["ids"] == want[0, len(ids):].tolist()
    extra = f"<extra_{rows + 5 - 120}>"
    assert theirs.convert_tokens_to_ids(extra) >= rows
    with pytest.raises(IndexError):
        model(torch.tensor([theirs(f"{text} {extra}")["input_ids"]]))
    assert main(["generate", f"--checkpoint={out}", f"--prompt={text} {extra}",
                 "--max_new_tokens=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{extra}'" in err[0] and f"0..{rows - 1}" in err[0], err
