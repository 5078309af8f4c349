"""DPO end to end (TRAIN_TASK=dpo, EVAL_TASK=dpo) on a tiny LLaMA built with transformers and
converted to paxlite, with the byte-level BPE tokenizer and chat template of test_chat_sft.py.

The evaluation is checked against transformers: each side's ids and learned tokens computed with
the tokenizer (`apply_chat_template` for message rows, plain encoding for strings), its
log-probability summed under the policy and under a second model (the reference) run on the side
alone, and the DPO terms in float64. Training: step 1's loss is log 2 (the policy is the reference
it starts from), a resumed run equals the uninterrupted one (the reference is rebuilt from where
the job started, not from its newer checkpoint), and LoRA's reference is the base model.
"""

import copy
import json
import math
import random

import numpy as np
import pytest

pytest.importorskip("transformers")

from paxlite.interop import hf
from paxlite.train.loop import Run, RunContext
from tests.train.test_chat_sft import (
    SEQ_LEN,
    WORDS,
    _config,
    _records,
    _stopped_after_step_two,
    _train,
    make_chat_model,
)

BETA = 0.5
GLOBAL_BATCH = 4
STEPS = 3


def _text(rng, low, high):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _rows(seed, *, count):
    """String rows and message rows, alternately; every fifth longer than a row."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        long = index % 5 == 4
        prompt = _text(rng, 8, 10) if long else _text(rng, 1, 3)
        sides = [_text(rng, 6, 8) if long else _text(rng, 1, 3) for _ in range(2)]
        if index % 2:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         **{key: [{"role": "assistant", "content": side}]
                            for key, side in zip(("chosen", "rejected"), sides, strict=True)}})
        else:
            rows.append({"prompt": prompt, "chosen": " " + sides[0], "rejected": " " + sides[1]})
    return rows


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(tokenizer dir, policy paxlite dir, policy model, reference paxlite dir, reference model)."""
    import torch

    root = tmp_path_factory.mktemp("dpo_models")
    tokenizer, policy_dir, policy = make_chat_model(root)
    reference = copy.deepcopy(policy)
    torch.manual_seed(1)
    with torch.no_grad():
        for weight in reference.parameters():
            weight.add_(0.05 * torch.randn_like(weight))
    reference.save_pretrained(root / "reference_hf", safe_serialization=True)
    hf.to_paxlite(hf.load(root / "reference_hf"), root / "reference")
    return tokenizer, policy_dir, policy, str(root / "reference"), reference


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_data")
    return {"train": _write(root / "train.jsonl", _rows(0, count=20)),
            "eval": _write(root / "eval.jsonl", _rows(1, count=10))}


def _flags(models, *extra):
    tokenizer, policy_dir, *_ = models
    return ["--fdl_config=FineTune", *(f"--fdl.{o}" for o in (
        f"CHECKPOINT_RESTORE_PATH={policy_dir}", f"VOCAB_PATH={tokenizer}",
        f"MAX_SEQ_LEN={SEQ_LEN}", "ICI_MESH_SHAPE=[2,2,2]", f"GLOBAL_BATCH_SIZE={GLOBAL_BATCH}",
        f"DPO_BETA={BETA}", "SUMMARY_INTERVAL_STEPS=1", "LEARNING_RATE=1e-2", *extra))]


def _train_flags(models, data, *extra):
    return _flags(models, "TRAIN_TASK=dpo", f"DPO_DATA={data['train']}",
                  "CHECKPOINT_EVERY_N_STEPS=2", "EVAL_TASK=dpo",
                  f"DPO_EVAL_DATA={data['eval']}", f"EVAL_INTERVAL_STEPS={STEPS}", *extra)


# ------------------------------------------------------------------ the reference (transformers)

def _side(theirs, prompt, side):
    """(ids, learned) of one side as transformers' tokenizer has it."""
    if isinstance(prompt, list):
        def ids(messages, **more):
            return theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **more)

        whole = ids(prompt + side)
        start = len(ids(prompt, add_generation_prompt=True))
    else:
        start = len(theirs(prompt)["input_ids"])
        whole = (theirs(prompt)["input_ids"] + theirs(side, add_special_tokens=False)["input_ids"]
                 + [theirs.eos_token_id])
    learned = np.arange(len(whole)) >= start
    learned[0] = False
    return np.asarray(whole), learned


def _logp(model, ids, learned):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor(ids[None], dtype=torch.long)).logits[0].double()
    logp = torch.log_softmax(logits, -1).numpy()
    return sum(logp[t - 1, ids[t]] for t in np.flatnonzero(learned))


def _cut(chosen, rejected):
    """Both sides to their first L tokens, L the largest that fits the row (docs/chat.md)."""
    length = max(L for L in range(SEQ_LEN + 1)
                 if min(len(chosen[0]), L) + min(len(rejected[0]), L) <= SEQ_LEN)
    return [(ids[:length], learned[:length]) for ids, learned in (chosen, rejected)]


def _expected_eval(models, rows):
    from transformers import AutoTokenizer

    tokenizer, _, policy, _, reference = models
    theirs = AutoTokenizer.from_pretrained(tokenizer)
    chosen_rewards, rejected_rewards, truncated = [], [], 0
    for row in rows:
        sides = [_side(theirs, row["prompt"], row[key]) for key in ("chosen", "rejected")]
        if len(sides[0][0]) + len(sides[1][0]) > SEQ_LEN:
            truncated += 1
            sides = _cut(*sides)
        rewards = [BETA * (_logp(policy, *side) - _logp(reference, *side)) for side in sides]
        chosen_rewards.append(rewards[0])
        rejected_rewards.append(rewards[1])
    chosen, rejected = np.asarray(chosen_rewards), np.asarray(rejected_rewards)
    margin = chosen - rejected
    return {"dpo/loss": np.mean(np.logaddexp(0.0, -margin)), "dpo/rewards_chosen": chosen.mean(),
            "dpo/rewards_rejected": rejected.mean(), "dpo/accuracy": np.mean(margin > 0),
            "dpo/margin": margin.mean()}, truncated


def test_eval_only_equals_transformers(models, data, tmp_path):
    """--mode=eval: the policy from CHECKPOINT_RESTORE_PATH against DPO_REFERENCE_PATH."""
    flags = _flags(models, "EVAL_TASK=dpo", f"DPO_EVAL_DATA={data['eval']}",
                   f"DPO_REFERENCE_PATH={models[3]}")
    with Run(_config(flags), RunContext(job_dir=str(tmp_path), training=False)) as run:
        metrics = run.run_eval()
    rows = _read(data["eval"])
    want, truncated = _expected_eval(models, rows)
    assert 0 < want["dpo/accuracy"] < 1  # both outcomes occur
    for key, value in want.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
    assert truncated >= 1
    assert (metrics["dpo/pairs"], metrics["dpo/truncated"], metrics["dpo/skipped_rows"]) == (
        len(rows), truncated, 0)
    (record,) = _records(tmp_path)
    assert record["step"] == 0 and record["eval/dpo/loss"] == metrics["dpo/loss"]


@pytest.fixture(scope="module")
def straight(models, data, tmp_path_factory):
    job = tmp_path_factory.mktemp("straight")
    _train(job, _train_flags(models, data, f"MAX_STEPS={STEPS}"))
    return job


def test_step_one_starts_at_log_two_and_evaluates(models, data, straight):
    records = _records(straight)
    first = records[0]
    assert first["step"] == 1
    # the policy is the reference it starts from: every reward 0, the loss log 2
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["loss"] == first["dpo/loss"]
    assert first["dpo/margin"] == pytest.approx(0, abs=1e-6)
    assert first["dpo/rewards_chosen"] == pytest.approx(0, abs=1e-6)
    rows = _read(data["train"])
    assert first["data/dpo/dropped"] == sum(index % 5 == 4 for index in range(len(rows)))
    later = [r for r in records if r.get("step") == STEPS and "dpo/loss" in r]
    assert later and later[0]["dpo/margin"] != pytest.approx(0, abs=1e-6)  # it moved
    (evaluated,) = [r for r in records if "eval/dpo/loss" in r]
    assert evaluated["step"] == STEPS and evaluated["eval/dpo/pairs"] == 10


def test_resume_equals_the_uninterrupted_run(models, data, straight, tmp_path):
    job = tmp_path / "job"
    _stopped_after_step_two(straight, job)
    _train(job, _train_flags(models, data, f"MAX_STEPS={STEPS}"))

    def steps(path):
        return {r["step"]: (r["dpo/loss"], r["dpo/margin"]) for r in _records(path)
                if "dpo/loss" in r}

    assert steps(job) == steps(straight)
    assert sorted(steps(job)) == list(range(1, STEPS + 1))


def test_lora_reference_is_the_base_model(models, data, tmp_path):
    """With LoRA the adapters start at zero, so step 1 is log 2 against the base model; after it
    they are not, and the policy moves away from the reference."""
    job = tmp_path / "lora"
    _train(job, _flags(models, "TRAIN_TASK=dpo", f"DPO_DATA={data['train']}", "USE_LORA=True",
                       "MAX_STEPS=2", "LEARNING_RATE=0.1"))
    records = [r for r in _records(job) if "dpo/loss" in r]
    assert records[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[1]["dpo/margin"] != pytest.approx(0, abs=1e-6)


def test_dpo_settings_where_nothing_reads_them_are_refused(models):
    from paxlite.config.errors import ConfigError

    with pytest.raises(ConfigError, match="DPO_BETA is read only with TRAIN_TASK='dpo'"):
        _config(_flags(models))
    with pytest.raises(ConfigError, match="DPO_BETA must be a number > 0"):
        _config(_flags(models, "EVAL_TASK=dpo", "DPO_EVAL_DATA=/tmp", "DPO_BETA=0"))
    with pytest.raises(ConfigError, match="PACKED_INPUT=True does not apply to TRAIN_TASK='dpo'"):
        _config(_flags(models, "TRAIN_TASK=dpo", "DPO_DATA=/tmp", "PACKED_INPUT=true"))


def test_the_trained_job_exports_to_transformers_with_its_tokenizer(models, data, straight,
                                                                     tmp_path):
    """`convert --from=paxlite --to=hf` of the DPO job: transformers loads the model with the
    tokenizer and chat template the job trained with, and its logits are the job's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paxlite.__main__ import main
    from paxlite.cli.conversion import read_paxlite

    tokenizer, policy_dir, *_ = models
    # the job trained in this process has no config.json (the command line writes one): its
    # experiment is named here, as the error would ask
    assert main(["convert", "--from=paxlite", "--to=hf", f"--input={straight}",
                 f"--output={tmp_path / 'hf'}", "--fdl_config=FineTune",
                 f"--fdl.CHECKPOINT_RESTORE_PATH={policy_dir}",
                 f"--vocab_path={tokenizer}/tokenizer.json"]) == 0
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    mine = AutoTokenizer.from_pretrained(tokenizer)
    messages = [{"role": "user", "content": "hello sky"}]
    assert theirs.apply_chat_template(messages, add_generation_prompt=True) == (
        mine.apply_chat_template(messages, add_generation_prompt=True))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = np.asarray([mine.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)])
    with torch.no_grad():
        exported = model(torch.tensor(ids)).logits.numpy()
    ours = read_paxlite(straight, config=_config(_train_flags(models, data)).model)
    np.testing.assert_allclose(exported, np.asarray(ours.logits(ids)), atol=1e-4)
