"""The fine-tuning story end to end: a Hugging Face LLaMA -> paxlite -> LoRA on BoolQ -> merged ->
Hugging Face.

Each step is tested on its own elsewhere; this test checks that they fit together the way a user
chains them: `python -m paxlite convert` writes what CHECKPOINT_RESTORE_PATH reads, a LoRA run on
TRAIN_TASK=boolq starts from it and scores eval/boolq_acc, `export_merged` folds the adapters in,
and transformers, loading the exported model, computes the same logits as the trained LoRA model in
paxlite.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import jax
import numpy as np
import pytest
from flax import traverse_util

from paxlite.checkpointing import pretrained
from paxlite.data.boolq import boolq_batches, read_boolq
from paxlite.data.tokenizer import Tokenizer
from paxlite.experiments.build import build_run_config
from paxlite.interop import hf
from paxlite.models.lora import is_lora_path
from paxlite.models.transformer import Transformer
from paxlite.train.export import export_merged
from paxlite.train.loop import Run, RunContext
from tests.eval.test_boolq import _examples, _train_spm, _write_jsonl
from tests.in_process import paxlite_command

TINY_LLAMA = "paxlite.experiments.tiny.TinyLLaMA"
VOCAB = 150  # the test tokenizer's size


def _hf_llama(directory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # TinyLLaMA's shape: 2 layers, 4 query / 2 key-value heads x 8, d_model 32, ffn 64, eps 1e-5.
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)


def _flat(tree) -> dict[str, np.ndarray]:
    return {"/".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _boolq_by_hand(params, model_config, *, vocab_path: str, seq_len: int, val_path: str):
    """(accuracy, yes-predictions) of `params` on `val_path`, apart from the loop's eval step.

    The rows are the product's (`boolq_batches`: the prompt, then the answer as the row's last
    token); the labels come from the file, the yes/no ids from the tokenizer, and Pax's pairwise
    rule is written out in NumPy: an example counts when the right answer's logit beats the wrong
    answer's at the answer position (a tie loses).
    """
    examples = read_boolq(val_path)
    tokenizer = Tokenizer(vocab_path)
    (yes,), (no,) = tokenizer.encode("yes"), tokenizer.encode("no")
    model = Transformer(model_config)
    # One compiled forward pass for the 4 batches (op by op, the first batch alone costs seconds).
    forward = jax.jit(lambda params, inputs, positions, segment_ids: model.apply(
        {"params": params}, inputs, positions=positions, segment_ids=segment_ids))
    says_yes = []
    for batch in boolq_batches(examples, tokenizer, seq_len=seq_len, batch_size=4):
        logits = np.asarray(
            forward(params, batch["inputs"], batch["positions"], batch["segment_ids"]),
            dtype=np.float64,
        )  # [B, T, V]
        for row in range(logits.shape[0]):
            if len(says_yes) == len(examples):
                break  # the zero rows that fill the last batch
            answer_at = np.flatnonzero(batch["segment_ids"][row])[-1]
            says_yes.append(bool(logits[row, answer_at, yes] > logits[row, answer_at, no]))
    labels = [example.label for example in examples]
    assert len(says_yes) == len(labels) == 13
    # A tie loses either way: the rule is "right beats wrong", so compare with the label's side.
    won = sum(said == label for said, label in zip(says_yes, labels))
    return won / len(labels), says_yes


@pytest.mark.slow
def test_hf_to_lora_boolq_to_merged_hf(tmp_path, monkeypatch, capfd) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    vocab = _train_spm(str(tmp_path / "spm"), single_yes_no=True)
    train = _write_jsonl(tmp_path / "train.jsonl", _examples(24, seed=1))
    # the last batch is part padding
    val = _write_jsonl(tmp_path / "val.jsonl", _examples(13, seed=2))
    _hf_llama(tmp_path / "hf_in")

    # 1. Convert with the CLI (in this process, tests/in_process.py: a conversion compiles nothing),
    # checked against the experiment the fine-tuning run will use.
    converted = tmp_path / "converted"
    result = paxlite_command(monkeypatch, capfd)(
        "convert",
        "--from=hf",
        "--to=paxlite",
        f"--input={tmp_path / 'hf_in'}",
        f"--output={converted}",
        f"--fdl_config={TINY_LLAMA}",
        f"--fdl.VOCAB_SIZE={VOCAB}",
    )
    assert result.returncode == 0, result.stderr[-3000:]

    # 2. LoRA on BoolQ's train split, initialised from the converted checkpoint, scored on BoolQ.
    job = tmp_path / "job"
    _, config = build_run_config(
        TINY_LLAMA,
        [
            f"VOCAB_SIZE={VOCAB}",
            f"VOCAB_PATH={vocab!r}",
            f"CHECKPOINT_RESTORE_PATH={str(converted)!r}",
            "USE_LORA=True",
            "LORA_RANK=4",
            "TRAIN_TASK='boolq'",
            f"BOOLQ_TRAIN_PATH={train!r}",
            "EVAL_TASK='boolq'",
            f"BOOLQ_PATH={val!r}",
            "MAX_STEPS=3",
            "LEARNING_RATE=3e-2",
        ],
    )
    with Run(config, RunContext(job_dir=str(job), async_checkpointing=False)) as run:
        trained = jax.device_get(run.train().params)
    evals = [
        json.loads(line)
        for line in (job / "metrics.jsonl").read_text().splitlines()
        if "eval/boolq_acc" in line
    ]
    assert [line["step"] for line in evals] == [3]
    # The logged score is the one the trained parameters earn on val.jsonl, recomputed here by hand.
    by_hand = functools.partial(
        _boolq_by_hand, vocab_path=vocab, seq_len=config.eval_task.seq_len, val_path=val
    )
    acc, _ = by_hand(trained, config.model)
    assert evals[0]["eval/boolq_acc"] == pytest.approx(acc, abs=1e-6)

    start = hf.from_paxlite(converted)
    # Zero-shot BoolQ of the converted model (--mode=eval, Pax's EVAL_ONLY): its answers are mixed,
    # so the by-hand score checks which example is which, not only a constant answer against the
    # labels.
    with Run(config, RunContext(job_dir=str(tmp_path / "zero_shot"), training=False)) as run:
        zero_shot = run.run_eval()
    acc, says_yes = by_hand(
        start.params, dataclasses.replace(config.model, lora_rank=None, lora_alpha=None)
    )
    assert 0 < sum(says_yes) < len(says_yes), says_yes
    assert zero_shot["boolq_acc"] == pytest.approx(acc, abs=1e-6)
    flat_trained, flat_start = _flat(trained), _flat(start.params)
    assert {k for k in flat_trained if not is_lora_path(k)} == set(flat_start)
    # the base model is frozen: bit for bit what was converted
    for name, value in flat_start.items():
        np.testing.assert_array_equal(flat_trained[name], value, err_msg=name)
    assert any(
        is_lora_path(k) and k.endswith("lora_b") and np.abs(v).max() > 0
        for k, v in flat_trained.items()
    )

    # 3. Fold the adapters in, export to Hugging Face, and compare transformers with the LoRA model.
    export_merged(job, tmp_path / "merged", model_config=config.model)
    hf.save(hf.from_paxlite(tmp_path / "merged"), tmp_path / "hf_out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 24)).astype(np.int32)
    with torch.no_grad():
        theirs = reloaded(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    lora_logits = jax.jit(Transformer(config.model).apply)
    ours = np.asarray(lora_logits({"params": trained}, tokens))
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    # The start's logits, from the same compiled program: with every lora_b at zero the adapters
    # add exactly zero, and the base weights are the converted ones bit for bit (checked above).
    # start.logits(tokens) would run the model op by op, compiling each primitive (~1.5 s).
    at_start = {k: np.zeros_like(v) if is_lora_path(k) and k.endswith("lora_b") else v
                for k, v in traverse_util.flatten_dict(trained, sep="/").items()}
    before = np.asarray(lora_logits(
        {"params": traverse_util.unflatten_dict(at_start, sep="/")}, tokens))
    # the fine-tuning changed the model the export carries
    assert np.abs(before - ours).max() > 1e-3
    assert pretrained.load_model_config(tmp_path / "merged").lora_rank is None
