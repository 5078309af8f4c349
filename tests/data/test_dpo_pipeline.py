"""The DPO feeds (data/dpo_pipeline.py) on a tiny tokenizer built here and a few rows: the
training order and its counts, an exact resume, the shares of two processes, evaluation of every
pair once, bad rows, and the settings that make them.

The host batches are read as the feed lays them out: `global_batch` (placing them on devices,
feeding.py's and tested there) is replaced by the identity, so a plan may be one of several
processes' in this one."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from paxlite.config.errors import ConfigError
from paxlite.data import row_feeds
from paxlite.data.chat_rows import Overlong, RowEncoder, prompt_bos_id
from paxlite.data.chat_template import BadRowError, ChatTemplateError, chat_template_for
from paxlite.data.dpo_pipeline import (
    DpoEvalConfig,
    DpoEvalFeed,
    DpoTrainConfig,
    DpoTrainFeed,
    dpo_eval_counts,
    dpo_train_summaries,
)
from paxlite.data.dpo_rows import encode_pair, truncate_pair
from paxlite.data.errors import DatasetError
from paxlite.data.feed import make_feed
from paxlite.data.feeding import FeedPlan
from paxlite.data.row_feeds import ChatBadRows
from paxlite.data.tokenizer import Tokenizer
from paxlite.experiments.build import build_run_config
from tests.data.test_chat_rows import CHATML, _save

SEQ_LEN = 136
LONG = " and the king said why is the sky blue" * 4


def _rows(count):
    """String pairs, every fourth longer than a row; conversational ones between them."""
    rows = []
    for i in range(count):
        prompt = f"What is {i} plus {i}?" + (LONG if i % 4 == 3 else "")
        if i % 3 == 1:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": f"{2 * i}."}],
                         "rejected": [{"role": "assistant", "content": "I am fine."}]})
        else:
            rows.append({"prompt": prompt, "chosen": f" {2 * i}.", "rejected": " Hello there"})
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("dpo_tokenizer"),
                 specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)


@pytest.fixture(autouse=True)
def host_batches(monkeypatch):
    monkeypatch.setattr(row_feeds, "global_batch", lambda local, sharding, plan: local)


def _plan(*, feed_index=0, num_feeds=1, rows=4):
    return FeedPlan(feed_index=feed_index, num_feeds=num_feeds, row_start=feed_index * rows,
                    row_stop=(feed_index + 1) * rows, global_batch_size=num_feeds * rows)


def _pairs(tokenizer, rows):
    """The pairs of `rows`, encoded one by one."""
    tok = Tokenizer(tokenizer)
    encoder = RowEncoder(tokenizer=tok, template=chat_template_for(tok),
                         bos_id=prompt_bos_id(tok))
    return [encode_pair(encoder, row, where="t") for row in rows]


def _train_config(path, tokenizer, **fields):
    return DpoTrainConfig(path=path, vocab_path=tokenizer, vocab_size=512, seq_len=SEQ_LEN,
                          seed=3, **fields)


def _chosen(batch):
    """Each row's chosen ids (segment 1)."""
    return [tuple(row[segments == 1].tolist())
            for row, segments in zip(batch["inputs"], batch["segment_ids"], strict=True)]


def _batches(feed, start, stop):
    return [feed.train_batch(index, None) for index in range(start, stop)]


def test_training_order_and_long_pairs(tokenizer, tmp_path):
    rows = _rows(12)
    path = _write(tmp_path / "pairs.jsonl", rows)
    pairs = _pairs(tokenizer, rows)
    long = [pair.length > SEQ_LEN for pair in pairs]
    assert sum(long) == 3

    feed = make_feed(_train_config(path, tokenizer), plan=_plan())
    assert isinstance(feed, DpoTrainFeed)
    assert dpo_train_summaries(feed) == {"data/dpo/dropped": 3, "data/dpo/truncated": 0,
                                         "data/dpo/skipped_rows": 0}
    kept = [pair for pair, cut in zip(pairs, long, strict=True) if not cut]
    order = np.random.default_rng([3, 0]).permutation(len(kept))
    batch = feed.train_batch(0, None)
    assert _chosen(batch) == [tuple(kept[i].chosen.ids.tolist()) for i in order[:4]]
    assert (batch["segment_ids"] == 1).any(axis=1).tolist() == [True] * 4
    for row, index in enumerate(order[:4]):  # chosen, then rejected, then padding
        pair = kept[index]
        n, m = pair.chosen.ids.shape[0], pair.rejected.ids.shape[0]
        assert batch["segment_ids"][row].tolist() == [1] * n + [2] * m + [0] * (SEQ_LEN - n - m)
        assert batch["inputs"][row, n:n + m].tolist() == pair.rejected.ids.tolist()
        assert batch["positions"][row, n:n + m].tolist() == list(range(m))

    cut = DpoTrainFeed(_train_config(path, tokenizer, overlong=Overlong.TRUNCATE), plan=_plan())
    assert cut.summaries() == {"data/dpo/dropped": 0, "data/dpo/truncated": 3,
                               "data/dpo/skipped_rows": 0}
    order = np.random.default_rng([3, 0]).permutation(len(pairs))
    batches = _batches(cut, 0, 3)  # the 12 pairs of epoch 0
    chosen = [ids for batch in batches for ids in _chosen(batch)]
    want = [truncate_pair(pairs[i], seq_len=SEQ_LEN) for i in order]
    assert chosen == [tuple(pair.chosen.ids.tolist()) for pair in want]
    assert all((b["segment_ids"] > 0).sum(axis=1).max() <= SEQ_LEN for b in batches)


def test_a_restored_feed_continues_as_the_uninterrupted_one(tokenizer, tmp_path):
    path = _write(tmp_path / "pairs.jsonl", _rows(10))
    config = _train_config(path, tokenizer, overlong=Overlong.TRUNCATE)
    straight = DpoTrainFeed(config, plan=_plan())
    want = _batches(straight, 0, 2)
    record = straight.state()  # after 2 batches, 8 of the 10 pairs of epoch 0
    assert record["processes"][0]["kind"] == "dpo" and record["processes"][0]["cursor"] == 8
    want += _batches(straight, 2, 5)  # crosses into epoch 1
    resumed = DpoTrainFeed(config, plan=_plan())
    resumed.restore(record, step=2)
    for expected, got in zip(want[2:], _batches(resumed, 2, 5), strict=True):
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])
    other = DpoTrainFeed(_train_config(path, tokenizer), plan=_plan())
    with pytest.raises(DatasetError, match="saved with pairs=10 but this run has pairs=8"):
        other.restore(record, step=2)


def test_two_processes_share_each_epoch(tokenizer, tmp_path):
    rows = _rows(16)
    path = _write(tmp_path / "pairs.jsonl", rows)
    pairs = _pairs(tokenizer, rows)
    config = _train_config(path, tokenizer, overlong=Overlong.TRUNCATE)
    feeds = [DpoTrainFeed(config, plan=_plan(feed_index=f, num_feeds=2, rows=2))
             for f in range(2)]
    seen = [ids for feed in feeds for batch in _batches(feed, 0, 4) for ids in _chosen(batch)]
    every = [tuple(truncate_pair(p, seq_len=SEQ_LEN).chosen.ids.tolist()) for p in pairs]
    assert sorted(seen) == sorted(every) and len(set(every)) == 16
    assert [f.state()["processes"][0]["epoch"] for f in feeds] == [1, 1]


def test_evaluation_scores_every_pair_once_in_file_order(tokenizer, tmp_path):
    rows = _rows(10)
    path = _write(tmp_path / "eval.jsonl", rows)
    pairs = [truncate_pair(pair, seq_len=SEQ_LEN) for pair in _pairs(tokenizer, rows)]
    config = DpoEvalConfig(path=path, vocab_path=tokenizer, vocab_size=512, seq_len=SEQ_LEN)
    feed = make_feed(config, plan=_plan())
    assert isinstance(feed, DpoEvalFeed) and feed.metric_prefix == "dpo/"
    assert dpo_eval_counts(feed) == {"dpo/pairs": 10, "dpo/truncated": 2, "dpo/skipped_rows": 0}
    batches = list(feed.eval_batches(-1, None))
    assert len(batches) == 3  # 10 pairs in rows of 4: two padding rows at the end
    holds_pair = np.concatenate([(b["segment_ids"] == 1).any(axis=1) for b in batches])
    assert holds_pair.tolist() == [True] * 10 + [False, False]
    chosen = [ids for b in batches for ids in _chosen(b)]
    assert chosen[:10] == [tuple(pair.chosen.ids.tolist()) for pair in pairs]
    assert not batches[-1]["segment_ids"][2:].any() and not batches[-1]["weights"][2:].any()
    # the second of two processes supplies rows 2 and 3 of the same global batches
    second = DpoEvalFeed(config, plan=_plan(feed_index=1, num_feeds=2, rows=2))
    for whole, part in zip(list(DpoEvalFeed(config, plan=_plan()).eval_batches(-1, None)),
                           second.eval_batches(-1, None), strict=True):
        np.testing.assert_array_equal(part["inputs"], whole["inputs"][2:4])
        np.testing.assert_array_equal(part["segment_ids"], whole["segment_ids"][2:4])


def test_bad_rows_name_the_file_and_row_or_are_counted(tokenizer, tmp_path):
    rows = _rows(6)
    bad = [*rows[:2], {"prompt": "a", "chosen": "", "rejected": "b"}, *rows[2:],
           {"prompt": "a", "chosen": "b"}]
    path = _write(tmp_path / "pairs.jsonl", bad)
    with pytest.raises(BadRowError, match=r"pairs.jsonl:3: an empty 'chosen', so nothing"):
        DpoTrainFeed(_train_config(path, tokenizer), plan=_plan())
    feed = DpoTrainFeed(_train_config(path, tokenizer, bad_rows=ChatBadRows.SKIP), plan=_plan())
    assert feed.summaries()["data/dpo/skipped_rows"] == 2
    evaluated = DpoEvalFeed(DpoEvalConfig(path=path, vocab_path=tokenizer, vocab_size=512,
                                          seq_len=SEQ_LEN, bad_rows=ChatBadRows.SKIP),
                            plan=_plan())
    assert dpo_eval_counts(evaluated)["dpo/skipped_rows"] == 2
    assert dpo_eval_counts(evaluated)["dpo/pairs"] == 6

    bare = _save(tmp_path / "bare", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 eos_token="<|im_end|>")  # no chat template: conversational rows cannot render
    with pytest.raises(ChatTemplateError, match=r"pairs.jsonl:2 is a chat row, and no chat "
                                                "template in "):
        DpoTrainFeed(_train_config(path, bare), plan=_plan())


def _settings(tokenizer, *assignments):
    return build_run_config("DemoSynthetic", [f"VOCAB_PATH={tokenizer}", *assignments])[1]


def test_settings(tokenizer, tmp_path):
    path = _write(tmp_path / "pairs.jsonl", _rows(4))
    config = _settings(tokenizer, "TRAIN_TASK=dpo", f"DPO_DATA={path}", "CHAT_OVERLONG=truncate",
                       "EVAL_TASK=dpo", f"DPO_EVAL_DATA={path}", "CHAT_BAD_ROWS=skip")
    assert isinstance(config.data, DpoTrainConfig) and config.data.path == path
    assert (config.data.overlong, config.data.bad_rows) == (Overlong.TRUNCATE, ChatBadRows.SKIP)
    assert isinstance(config.eval_task, DpoEvalConfig) and config.eval_task.path == path
    for assignments, message in (
            ([f"DPO_DATA={path}"], ("DPO_DATA is read only with TRAIN_TASK='dpo', and "
                                    "TRAIN_TASK='text': add --fdl.TRAIN_TASK=dpo, or drop")),
            ([f"DPO_EVAL_DATA={path}"], "DPO_EVAL_DATA is read only with EVAL_TASK='dpo'"),
            (["TRAIN_TASK=dpo"], "TRAIN_TASK=dpo needs its rows: --fdl.DPO_DATA=PATH"),
            (["EVAL_TASK=dpo", f"DPO_EVAL_DATA={path}", "EVAL_LOOP_NUM_BATCHES=2"],
             "EVAL_TASK=dpo scores the whole of DPO_EVAL_DATA, every pair once"),
            (["TRAIN_TASK=dpo", f"DPO_DATA={path}", "DATA_DIR=/x"],
             "TRAIN_TASK=dpo trains on DPO_DATA, but DATA_DIR='/x' is set too")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            _settings(tokenizer, *assignments)
