"""Chat SFT end to end (TRAIN_TASK=chat, EVAL_TASK=chat) on a tiny LLaMA built with transformers
and converted to paxlite, its byte-level BPE tokenizer and chat template built here.

The losses are checked against transformers: each example's ids and learned tokens computed with
the tokenizer's `apply_chat_template` (the prefix convention) or plain encoding, the model run on
each example alone (no packing), the next-token cross entropy summed over the learned tokens.
Which examples make up step 1's batch follows the documented order (a permutation of the kept
examples from (SEED, epoch 0), packed greedily into rows of MAX_SEQ_LEN), written out here.
"""

import gzip
import json
import random
import shutil

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tokenizers import decoders, models, pre_tokenizers

from paxlite.checkpointing.checkpoint import Checkpointer
from paxlite.data.chat_pipeline import ChatTrainFeed
from paxlite.data.chat_template import ChatTemplateError
from paxlite.data.errors import DatasetError
from paxlite.data.feeding import plan_feeding
from paxlite.experiments.build import build_run_config
from paxlite.interop import hf
from paxlite.parallel import rules as rules_lib
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.loop import Run, RunContext
from tests.in_process import paxlite_main

SEQ_LEN = 32
GLOBAL_BATCH = 8
STEPS = 4
WORDS = "yes no two four sky blue king sea rain hello thanks what why is the a of and".split()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, short: one letter per role, so that a conversation fits in a row of 32
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'][0] + '\\n' + m['content'] + "
            "'<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>a\\n' }}{% endif %}")


def _text(rng, low, high):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _rows(seed, *, count, long_every=0):
    """Conversations of one or two turns (some with a system message) and prompt/completion
    rows; every `long_every`-th longer than a row."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        long = long_every and index % long_every == long_every - 1
        words = (26, 30) if long else (1, 3)
        if index % 5 == 2:
            rows.append({"prompt": _text(rng, *words), "completion": " " + _text(rng, 1, 3)})
            continue
        messages = [{"role": "system", "content": _text(rng, 1, 2)}] if index % 7 == 3 else []
        for _ in range(1 + (index % 3 == 1)):
            messages += [{"role": "user", "content": _text(rng, *words)},
                         {"role": "assistant", "content": _text(rng, 1, 3)}]
        rows.append({"messages": messages})
    return rows


def _write_jsonl(path, rows, *, opener=open):
    with opener(path, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def make_chat_model(root):
    """(tokenizer dir with its chat_template.jinja, converted paxlite dir, transformers model)
    under `root`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [_text(random.Random(i), 5, 20) for i in range(200)]
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS, show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>",
                            chat_template=TEMPLATE).save_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.1, tie_word_embeddings=False)).eval()
    llama.save_pretrained(root / "hf", safe_serialization=True)
    hf.to_paxlite(hf.load(root / "hf"), root / "paxlite")
    return str(root / "tokenizer"), str(root / "paxlite"), llama


def make_chat_data(root):
    """Training and evaluation rows under `root`: JSONL, some longer than a row."""
    return {"train": _write_jsonl(root / "train.jsonl", _rows(0, count=44, long_every=11)),
            "eval": _write_jsonl(root / "eval.jsonl", _rows(1, count=12, long_every=6))}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_chat_data(tmp_path_factory.mktemp("chat_data"))


def chat_flags(model, data, *extra):
    tokenizer, checkpoint, _ = model
    return ["--fdl_config=FineTune", *(f"--fdl.{o}" for o in (
        f"CHECKPOINT_RESTORE_PATH={checkpoint}", f"VOCAB_PATH={tokenizer}",
        f"MAX_SEQ_LEN={SEQ_LEN}", "ICI_MESH_SHAPE=[2,2,2]", f"GLOBAL_BATCH_SIZE={GLOBAL_BATCH}",
        "PACKED_INPUT=true", "TRAIN_TASK=chat", f"CHAT_DATA={data['train']}",
        "SUMMARY_INTERVAL_STEPS=1", "CHECKPOINT_EVERY_N_STEPS=2", "LEARNING_RATE=1e-2",
        *extra))]


def _config(flags):
    name = flags[0].split("=", 1)[1]
    return build_run_config(name, [f.removeprefix("--fdl.") for f in flags[1:]])[1]


def _train(job, flags):
    with Run(_config(flags), RunContext(job_dir=str(job))) as run:
        run.train()


def _records(job):
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


def _losses(job):
    return {r["step"]: r["loss"] for r in _records(job) if "loss" in r}


# ------------------------------------------------------------------ the reference (transformers)

def _reference_examples(tokenizer_dir, rows, *, keep_long: bool):
    """(ids, learned) per row with transformers' tokenizer and apply_chat_template."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tokenizer_dir)
    examples = []
    for row in rows:
        if "messages" in row:
            messages = row["messages"]

            def ids(part, **more):
                return theirs.apply_chat_template(part, tokenize=True, return_dict=False, **more)

            whole = ids(messages)
            learned = np.zeros(len(whole), bool)
            for index, message in enumerate(messages):
                if message["role"] == "assistant":
                    before = ids(messages[:index], add_generation_prompt=True)
                    learned[len(before):len(ids(messages[:index + 1]))] = True
        else:
            prompt = theirs(row["prompt"])["input_ids"]
            completion = theirs(row["completion"], add_special_tokens=False)["input_ids"]
            whole = prompt + completion + [theirs.eos_token_id]
            learned = np.arange(len(whole)) >= len(prompt)
        learned[0] = False
        if len(whole) > SEQ_LEN and not keep_long:
            continue
        examples.append((np.asarray(whole[:SEQ_LEN]), learned[:SEQ_LEN]))
    return examples


def _loss_sums(llama, examples):
    """(summed next-token cross entropy over the learned tokens, their number)."""
    import torch

    total, count = 0.0, 0
    for ids, learned in examples:
        with torch.no_grad():
            logits = llama(torch.tensor(ids[None], dtype=torch.long)).logits[0].double()
        logp = torch.log_softmax(logits, -1).numpy()
        for t in np.flatnonzero(learned):
            total -= logp[t - 1, ids[t]]
        count += int(learned.sum())
    return total, count


def _first_batch(examples, *, seed):
    """Step 1's examples: the kept ones permuted from (seed, epoch 0), packed greedily."""
    order = np.random.default_rng([seed, 0]).permutation(len(examples))
    rows, used = [[]], 0
    for index in order:
        length = len(examples[index][0])
        if used + length > SEQ_LEN:
            rows.append([])
            used = 0
        rows[-1].append(examples[index])
        used += length
    return [example for row in rows[:GLOBAL_BATCH] for example in row]


@pytest.fixture(scope="module")
def straight(model, data, tmp_path_factory):
    job = tmp_path_factory.mktemp("straight")
    _train(job, chat_flags(model, data, f"MAX_STEPS={STEPS}"))
    return job


def test_step_one_loss_equals_transformers(model, data, straight):
    tokenizer, _, llama = model
    rows = _read_jsonl(data["train"])
    kept = _reference_examples(tokenizer, rows, keep_long=False)
    assert sum("prompt" in row for row in rows) == 9 and len(rows) - len(kept) >= 3
    seed = _config(chat_flags(model, data)).data.seed
    total, count = _loss_sums(llama, _first_batch(kept, seed=seed))
    records = _records(straight)
    assert records[0]["step"] == 1
    np.testing.assert_allclose(records[0]["loss"], total / count, rtol=2e-5)
    # the examples longer than a row are dropped; nothing is skipped
    assert {k: v for k, v in records[0].items() if k.startswith("data/chat/")} == {
        "data/chat/dropped": len(rows) - len(kept), "data/chat/truncated": 0,
        "data/chat/skipped_rows": 0}


def test_one_device_equals_the_sharded_run(model, data, straight):
    """Step 1's batch through the eval step on one device: the loss of the 2x2x2 run's step 1."""
    from paxlite.checkpointing.pretrained import restore_params
    from paxlite.models.transformer import Transformer
    from paxlite.train import device_metrics
    from paxlite.train.optimizer import make_optimizer
    from paxlite.train.schedules import make_schedule
    from paxlite.train.step import compile_steps

    config = _config(chat_flags(model, data))
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    sharding = rules_lib.batch_sharding(mesh)
    feed = ChatTrainFeed(config.data, plan=plan_feeding(sharding, global_batch_size=GLOBAL_BATCH,
                                                        seq_len=SEQ_LEN))
    with jax.set_mesh(mesh):
        schedule = make_schedule(config.schedule)
        steps = compile_steps(model=Transformer(config.model), schedule=schedule,
                              optimizer=make_optimizer(config.optimizer, schedule), mesh=mesh,
                              seq_len=SEQ_LEN, seed=0, deterministic=True)
        _, params = restore_params(model[1], steps.abstract_state.params)
        out = steps.eval(params, feed.train_batch(0, sharding))
        sums = device_metrics.eval_totals_value(jax.device_get(
            device_metrics.eval_totals_add(device_metrics.eval_totals_init(), out)))
    loss = sums["loss_sum"] / sums["target_tokens"]
    np.testing.assert_allclose(loss, _losses(straight)[1], rtol=1e-5)


def _stopped_after_step_two(straight, job):
    """`job` as a run stopped after step 2 leaves it: the uninterrupted run's checkpoint at 2 (this
    process trained the same rows to it with the same programs; a run with MAX_STEPS=2 would train
    them again) and its lines up to step 2."""
    name = "checkpoint_00000002"
    shutil.copytree(straight / "checkpoints" / name, job / "checkpoints" / name)
    lines = (straight / "metrics.jsonl").read_text().splitlines()
    (job / "metrics.jsonl").write_text(
        "".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= 2))


def test_resume_equals_the_uninterrupted_run(model, data, straight, tmp_path):
    job = tmp_path / "job"
    _stopped_after_step_two(straight, job)
    _train(job, chat_flags(model, data, f"MAX_STEPS={STEPS}"))  # resumes at 2, then an epoch ends
    assert _losses(job) == _losses(straight)
    # the resumed run started at step 3: each step trained once
    assert [r["step"] for r in _records(job) if "loss" in r] == list(range(1, STEPS + 1))
    assert sorted(_losses(job)) == list(range(1, STEPS + 1))
    with Checkpointer(job / "checkpoints", save_interval_steps=2, max_to_keep=None) as ckpt:
        positions = [ckpt.restore_data(step)["processes"][0] for step in (2, STEPS)]
    assert positions[0]["epoch"] == 0 and positions[1]["epoch"] == 1  # the resume crossed one


def test_eval_only_loss_and_tokens_equal_transformers(model, data, tmp_path):
    tokenizer, _, llama = model
    flags = chat_flags(model, data, "TRAIN_TASK=text", "EVAL_TASK=chat",
                       f"CHAT_EVAL_DATA={data['eval']}")
    flags = [f for f in flags if "CHAT_DATA=" not in f]
    with Run(_config(flags), RunContext(job_dir=str(tmp_path), training=False)) as run:
        metrics = run.run_eval()
    rows = _read_jsonl(data["eval"])
    total, count = _loss_sums(llama, _reference_examples(tokenizer, rows, keep_long=True))
    np.testing.assert_allclose(metrics["chat/loss"], total / count, rtol=2e-5)
    assert metrics["chat/tokens"] == count
    long = len(rows) - len(_reference_examples(tokenizer, rows, keep_long=False))
    assert long >= 1 and (metrics["chat/examples"], metrics["chat/truncated"]) == (12, long)
    (record,) = _records(tmp_path)
    assert record["step"] == 0 and record["eval/chat/loss"] == metrics["chat/loss"]


# ------------------------------------------------------------------ inputs, counts, errors

def test_parquet_truncate_and_skipped_rows_in_metrics(model, data, tmp_path):
    """A Parquet file with two bad rows, skipped, and the long examples truncated: counted in
    metrics.jsonl."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer, _, _ = model
    # one kind of row per file: Parquet gives every row every column of the file
    rows = [row for row in _rows(2, count=20, long_every=5) if "messages" in row]
    bad = [{"messages": [{"role": "user", "content": "hello"}]}, {"messages": []}]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([*rows[:5], *bad, *rows[5:]]), path)
    flags = chat_flags(model, data, f"CHAT_DATA={path}", "CHAT_OVERLONG=truncate",
                       "CHAT_BAD_ROWS=skip", "MAX_STEPS=1")
    _train(tmp_path / "job", flags)
    (record,) = [r for r in _records(tmp_path / "job") if "loss" in r]
    long = len(rows) - len(_reference_examples(tokenizer, rows, keep_long=False))
    assert long >= 3
    assert {k: v for k, v in record.items() if k.startswith("data/chat/")} == {
        "data/chat/dropped": 0, "data/chat/truncated": long, "data/chat/skipped_rows": 2}


def test_gzip_jsonl_and_prompt_completion_rows(model, data, tmp_path):
    """A .jsonl.gz of prompt/completion rows: ids and learned tokens as transformers has them."""
    tokenizer, _, _ = model
    rows = [r for r in _rows(3, count=30) if "prompt" in r]
    path = _write_jsonl(tmp_path / "pairs.jsonl.gz", rows, opener=gzip.open)
    config = _config(chat_flags(model, data, f"CHAT_DATA={path}", "PACKED_INPUT=false"))
    sharding = rules_lib.batch_sharding(build_mesh(config.mesh))
    feed = ChatTrainFeed(config.data, plan=plan_feeding(sharding, global_batch_size=GLOBAL_BATCH,
                                                        seq_len=SEQ_LEN))
    batch = jax.device_get(feed.train_batch(0, sharding))
    want = _reference_examples(tokenizer, rows, keep_long=True)
    order = np.random.default_rng([config.data.seed, 0]).permutation(len(rows))
    for row, index in enumerate(order[:GLOBAL_BATCH]):  # one example a row (unpacked)
        ids, learned = want[index]
        n = len(ids)  # transformers' layout: position t reads token t and predicts t + 1
        np.testing.assert_array_equal(batch["inputs"][row, :n], ids)
        np.testing.assert_array_equal(batch["targets"][row, :n - 1], ids[1:])
        np.testing.assert_array_equal(batch["weights"][row, :n - 1], learned[1:])
        assert not batch["weights"][row, n - 1:].any()
        assert not batch["segment_ids"][row, n:].any() and batch["segment_ids"][row, 0] == 1


def test_bad_row_is_one_line_naming_file_and_row(model, data, tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [*_rows(4, count=6),
                                                 {"messages": [{"role": "user"}]}])
    with pytest.raises(DatasetError, match=r"bad.jsonl:7: message 0 \(user\) needs a string "
                                           "content, got none"):
        _train(tmp_path / "job", chat_flags(model, data, f"CHAT_DATA={path}", "MAX_STEPS=1"))


def test_chat_rows_without_a_template_are_one_line(model, data, tmp_path):
    """A tokenizer directory with no chat template: the first chat row says so, before
    compiling."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(model[0], tokenizer)
    (tokenizer / "chat_template.jinja").unlink()
    flags = chat_flags(model, data, f"VOCAB_PATH={tokenizer}", "MAX_STEPS=1")
    with pytest.raises(ChatTemplateError, match=r"train.jsonl:1 is a chat row, and no chat "
                                                "template in .*pass one with "
                                                r"--fdl.CHAT_TEMPLATE=FILE"):
        _train(tmp_path / "job", flags)


@pytest.mark.parametrize("settings, messages", [
    (["CHAT_DATA='/nonexistent/chat.jsonl'"],
     ["CHAT_DATA: input path /nonexistent/chat.jsonl does not exist"]),
    (["TRAIN_TASK=text", "DATA_DIR='/x'"],
     ["CHAT_DATA is read only with TRAIN_TASK='chat', and TRAIN_TASK='text'"]),
    (["CHAT_TEMPLATE='/nonexistent/t.jinja'"],
     ["CHAT_TEMPLATE: no chat template file at /nonexistent/t.jinja"]),
    (["CHAT_TEMPLATE_NAME=tools"],
     ["CHAT_TEMPLATE_NAME: ", "chat_template.jinja is one template, not one named 'tools'"]),
    (["EVAL_TASK=chat", "CHAT_EVAL_DATA=EVAL", "EVAL_LOOP_NUM_BATCHES=2"],
     ["EVAL_TASK=chat scores the whole of CHAT_EVAL_DATA"]),
])
def test_setting_mistakes_are_one_line_exit_2(model, data, settings, messages, monkeypatch,
                                             capfd, tmp_path):
    settings = [s.replace("=EVAL", f"={data['eval']}") for s in settings]
    flags = chat_flags(model, data, *settings, "MAX_STEPS=1")
    with paxlite_main(monkeypatch, capfd) as run:
        result = run(*flags, f"--job_log_dir={tmp_path}")
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if "paxlite: error: " in line]
    assert all(part in line for part in messages), line


def test_a_resume_renders_the_template_at_the_jobs_clock(model, data, tmp_path, monkeypatch):
    """A template that writes the date: a feed restored from a position saved on another day
    renders the rows at the saved instant, so it builds the batches the first run would."""
    import datetime

    from paxlite.data import row_feeds

    template = tmp_path / "dated.jinja"
    template.write_text("{{ strftime_now('%d %b %Y') }}" + TEMPLATE)
    config = _config(chat_flags(model, data, f"CHAT_TEMPLATE={template}",
                                "CHAT_OVERLONG=truncate"))
    sharding = rules_lib.batch_sharding(build_mesh(config.mesh))
    plan = plan_feeding(sharding, global_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN)

    def feed_on(day):
        monkeypatch.setattr(row_feeds, "now", lambda: datetime.datetime(2024, 1, day, 9))
        return ChatTrainFeed(config.data, plan=plan)

    first = feed_on(5)
    record = first.state()
    assert record["processes"][0]["template_time"] == "2024-01-05T09:00:00"
    want = jax.device_get(first.train_batch(0, sharding))
    resumed, other_day = feed_on(28), feed_on(28)
    resumed.restore(record, step=0)
    for feed, same in ((resumed, True), (other_day, False)):
        got = jax.device_get(feed.train_batch(0, sharding))
        assert np.array_equal(got["inputs"], want["inputs"]) == same
