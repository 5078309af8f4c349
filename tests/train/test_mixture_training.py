"""Training on a DATA_MIXTURE of two prepared directories: exact resume (also on another device
count), the data/mixture/* fractions, per-source evaluation, and the configuration errors.

References: the same run uninterrupted; token counts rebuilt from Grain's mix over plain index
ranges and each source read alone; each source evaluated alone as DATA_DIR with the same parameters.
"""

import json
import os
import random
import shutil
import subprocess
import sys

import grain
import jax
import numpy as np
import pytest

from paxlite.checkpointing.checkpoint import Checkpointer
from paxlite.config.errors import ConfigError
from paxlite.data.mixture import grain_proportions
from paxlite.data.pipeline import TextData, TextDataConfig
from paxlite.data.prepare import prepare
from paxlite.data.train_tokenizer import train_tokenizer
from paxlite.experiments.build import build_run_config
from paxlite.train.loop import Run, RunContext
from tests.fork_server import paxlite_python
from tests.in_process import paxlite_main
from tests.xla_test_flags import COMPILE_FLAGS

WORDS = {"a": "the king and queen of a far land rode out at dawn to see the sea".split(),
         "b": "bells rang and children sang of rain wind fire stone gold silver bread wine".split()}
WEIGHTS = (0.7, 0.3)
SEQ, BATCH = 32, 8


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(dir a, dir b, vocab): two prepared directories both called `books` (named books, books_2),
    tokenised with one SentencePiece model; b is small, so it re-epochs during the runs."""
    root = tmp_path_factory.mktemp("mixture")
    rng = random.Random(0)
    corpora = {}
    for key, count in (("a", 300), ("b", 4)):
        longest = 60 if key == "a" else 15
        paragraphs = [
            " ".join(rng.choice(WORDS[key]) for _ in range(rng.randint(5, longest)))
            for _ in range(count)
        ]
        corpora[key] = root / f"{key}.txt"
        corpora[key].write_text("\n\n".join(paragraphs) + "\n")
    vocab = train_tokenizer([str(c) for c in corpora.values()], str(root / "spm"), vocab_size=300)
    dirs = []
    for key in ("a", "b"):
        out = root / key / "books"
        prepare(
            [str(corpora[key])], str(out), vocab_path=vocab, validation_fraction=0.2, num_shards=2
        )
        dirs.append(str(out))
    return dirs[0], dirs[1], vocab


def _overrides(sources, max_steps, *extra):
    a, b, vocab = sources
    return [
        f"DATA_MIXTURE=[[{a!r}, {WEIGHTS[0]}], [{b!r}, {WEIGHTS[1]}]]",
        f"VOCAB_PATH={vocab}",
        "NUM_LAYERS=1",
        "MODEL_DIMS=32",
        "NUM_HEADS=4",
        "DIMS_PER_HEAD=8",
        "HIDDEN_DIMS=64",
        "VOCAB_SIZE=320",
        f"MAX_SEQ_LEN={SEQ}",
        f"GLOBAL_BATCH_SIZE={BATCH}",
        f"MAX_STEPS={max_steps}",
        "SUMMARY_INTERVAL_STEPS=1",
        "CHECKPOINT_EVERY_N_STEPS=3",
        "EVAL_INTERVAL_STEPS=3",
        "EVAL_LOOP_NUM_BATCHES=2",
        "LR_COS_WARMUP=2",
        "LR_COS_DECAY_END=6",
        *extra,
    ]


def _train(job, overrides):
    _, config = build_run_config("TinyShakespeare", overrides)
    with Run(config, RunContext(job_dir=str(job))) as run:
        return jax.device_get(run.train())


def _lines(job, key):
    with open(os.path.join(job, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if key in r]


def _data_record(job, step):
    with Checkpointer(
        os.path.join(job, "checkpoints"), save_interval_steps=3, max_to_keep=None
    ) as ckpt:
        return ckpt.restore_data(step)


@pytest.fixture(scope="module")
def straight(sources, tmp_path_factory):
    job = tmp_path_factory.mktemp("straight")
    return job, _train(job, _overrides(sources, 6))


def test_resume_is_bit_for_bit_and_names_are_unique(straight, sources, tmp_path):
    job, want_state = straight
    _train(tmp_path / "r", _overrides(sources, 3))
    got_state = _train(tmp_path / "r", _overrides(sources, 6))
    keys = ("step", "loss", "grad_norm", "data/mixture/books", "data/mixture/books_2")
    assert [[r[k] for k in keys] for r in _lines(tmp_path / "r", "loss")] == [
        [r[k] for k in keys] for r in _lines(job, "loss")]
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (process,) = _data_record(job, 6)["processes"]
    assert process["names"] == ["books", "books_2"] and process["selection"] == 6 * BATCH
    # the small source re-epoched on its own
    assert process["streams"]["books_2"]["epoch"] >= 1 and process["streams"]["books"]["epoch"] == 0


def test_fractions_equal_an_independent_count(straight, sources):
    """data/mixture/<name> at step s: weighted tokens of the rows Grain's mix gives each source in
    the first s x BATCH rows, counted on each source read alone."""
    job, _ = straight
    a, b, vocab = sources
    m = sys.maxsize // 4
    mixed = grain.MapDataset.mix([grain.MapDataset.range(0, m), grain.MapDataset.range(m, 2 * m)],
                                 list(grain_proportions(WEIGHTS)))
    lines = _lines(job, "data/mixture/books")
    assert [r["step"] for r in lines] == list(range(1, 7))
    for line in lines:
        picks = np.array([mixed[k] // m for k in range(line["step"] * BATCH)])
        tokens = []
        for index, directory in enumerate((a, b)):
            it = TextData(
                TextDataConfig(data_dir=directory, vocab_path=vocab, vocab_size=320, seq_len=SEQ),
                global_batch_size=1,
            ).train_iterator()
            tokens.append(
                sum(float(next(it)["weights"].sum()) for _ in range(int((picks == index).sum())))
            )
        assert line["data/mixture/books"] == pytest.approx(tokens[0] / sum(tokens), abs=1e-12)
        assert line["data/mixture/books_2"] == pytest.approx(tokens[1] / sum(tokens), abs=1e-12)


def test_each_sources_eval_equals_that_source_alone(straight, sources, tmp_path):
    job, _ = straight
    a, b, _ = sources
    (line,) = [r for r in _lines(job, "eval/loss") if r["step"] == 6]
    checkpoint = str(job / "checkpoints" / "checkpoint_00000006")
    alone = {}
    for name, directory in (("books", a), ("books_2", b)):
        overrides = [o for o in _overrides(sources, 6) if not o.startswith("DATA_MIXTURE")]
        _, config = build_run_config("TinyShakespeare", [*overrides, f"DATA_DIR={directory}",
                                                         f"CHECKPOINT_RESTORE_PATH={checkpoint}"])
        with Run(config, RunContext(job_dir=str(tmp_path / name), training=False)) as run:
            alone[name] = run.run_eval()
        for key in ("loss", "accuracy", "log_pplx", "num_tokens"):
            assert line[f"eval/{name}/{key}"] == pytest.approx(alone[name][key], rel=1e-6), (
                name,
                key,
            )
    counts = [alone[n]["num_tokens"] for n in alone]
    pooled = sum(alone[n]["loss"] * alone[n]["num_tokens"] for n in alone) / sum(counts)
    assert line["eval/loss"] == pytest.approx(pooled, rel=1e-6)
    # --mode=eval on the mixture's own job evaluates the same way
    _, config = build_run_config("TinyShakespeare", _overrides(sources, 6))
    with Run(config, RunContext(job_dir=str(job), training=False)) as run:
        again = run.run_eval()
    assert {f"eval/{k}": v for k, v in again.items()} == pytest.approx(
        {k: v for k, v in line.items() if k.startswith("eval/")}, rel=1e-6)


def test_resume_on_another_device_count_continues_the_same_data(straight, sources, tmp_path):
    """The same global batch on one device instead of eight: the input position restores and the
    batches continue exactly (the saved data record at step 6 is the uninterrupted run's)."""
    job, _ = straight
    resumed = tmp_path / "one_device"
    shutil.copytree(
        job / "checkpoints" / "checkpoint_00000003", resumed / "checkpoints" / "checkpoint_00000003"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": COMPILE_FLAGS}
    result = subprocess.run(
        [paxlite_python(), "-m", "paxlite.main", "--fdl_config=TinyShakespeare",
         *(f"--fdl.{o}" for o in _overrides(sources, 6)), f"--job_log_dir={resumed}"],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _data_record(resumed, 6) == _data_record(job, 6)
    got = {r["step"]: r for r in _lines(resumed, "loss")}
    for line in _lines(job, "loss")[3:]:
        assert got[line["step"]]["data/mixture/books"] == line["data/mixture/books"]
        assert got[line["step"]]["loss"] == pytest.approx(line["loss"], rel=1e-4)


def _config_error(sources, value, *extra, drop=("DATA_MIXTURE",)):
    overrides = [o for o in _overrides(sources, 1) if not o.startswith(drop)]
    with pytest.raises(ConfigError) as info:
        build_run_config("TinyShakespeare", [*overrides, f"DATA_MIXTURE={value}", *extra])
    message = str(info.value)
    assert "\n" not in message
    return message


def test_configuration_errors_are_one_line(sources, tmp_path, monkeypatch):
    monkeypatch.delenv("VOCAB_PATH", raising=False)
    a, b, vocab = sources
    assert "not a list of [source, weight] pairs" in _config_error(sources, f"[{a!r}]")
    assert "not a [source, weight] pair" in _config_error(sources, f"[[{a!r}, 1, 2]]")
    assert "must be a list" in _config_error(sources, "[]")
    for bad in ("0", "-1", "'x'"):
        assert "weights must be numbers > 0" in _config_error(sources, f"[[{a!r}, {bad}]]")
    assert "DATA_DIR" in _config_error(sources, f"[[{a!r}, 1]]", f"DATA_DIR={a}")
    assert "does not exist" in _config_error(sources, f"[[{str(tmp_path / 'nowhere')!r}, 1]]")
    (tmp_path / "empty").mkdir()
    assert "paxlite_dataset.json" in _config_error(sources, f"[[{str(tmp_path / 'empty')!r}, 1]]")
    assert "same source twice" in _config_error(sources, f"[[{a!r}, 1], [{a + '/'!r}, 2]]")
    assert "INPUT_PIPELINE=seqio" in _config_error(sources, "'my_mixture'")
    assert "TFDS_DATA_DIR" in _config_error(sources, "[['the_pile:1.0.0', 1]]")
    other = tmp_path / "other"
    other_vocab = train_tokenizer([os.path.join(os.path.dirname(os.path.dirname(b)), "b.txt")],
                                  str(tmp_path / "spm2"), vocab_size=290)
    prepare(
        [os.path.join(os.path.dirname(os.path.dirname(b)), "b.txt")],
        str(other),
        vocab_path=other_vocab,
        validation_fraction=0.2,
    )
    message = _config_error(sources, f"[[{a!r}, 1], [{str(other)!r}, 1]]")
    assert "share one tokenizer" in message and str(other) in message and vocab in message
    message = _config_error(sources, f"[[{str(other)!r}, 1]]")  # against VOCAB_PATH
    assert "VOCAB_PATH" in message and str(other) in message
    message = _config_error(
        sources, f"[[{a!r}, 1], [{str(other)!r}, 1]]", drop=("DATA_MIXTURE", "VOCAB_PATH")
    )
    assert a in message and str(other) in message and message.count("sha256") == 2


def test_cli_exit_2_with_one_line(sources, tmp_path, monkeypatch, capfd):
    # in this process (tests/in_process.py): the weight is refused before any data is read
    a, _, _ = sources
    with paxlite_main(monkeypatch, capfd) as run:
        result = run("--fdl_config=TinyShakespeare", f"--fdl.DATA_MIXTURE=[[{a!r}, 0]]",
                     f"--job_log_dir={tmp_path / 'job'}")
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("paxlite: error:")]
    assert len(errors) == 1 and "weight 0" in errors[0] and "Traceback" not in result.stderr
