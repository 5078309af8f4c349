"""paxlite's lm-evaluation-harness model against lm_eval's own `hf` model (HFLM), offline.

One tiny Hugging Face LLaMA with a SentencePiece tokenizer (BOS 1, EOS 2), its vocabulary cut to
the tokenizer's 200 pieces and MAX_SEQ_LEN 32, converted to paxlite with `convert`. The three local
tasks of tests/testdata/lm_eval (multiple choice, rolling log-likelihood over documents longer than
32 tokens, generate_until) are scored by HFLM on the original directory and by paxlite's LM on the
converted checkpoint: every per-sample log-likelihood agrees to 1e-4, every greedy flag and
generated string is the same, and so are the accuracies; then batch size and mesh change nothing.
"""

import argparse
import dataclasses
import importlib.metadata
import json
import os
import pathlib

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import numpy as np
import pytest

from paxlite.__main__ import main

TASKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "testdata" / "lm_eval"
TASKS = ["paxlite_mc", "paxlite_ppl", "paxlite_gen"]
MAX_LEN = 32  # the documents of paxlite_ppl are longer: they are scored in windows
PIECES = 200  # the tokenizer's (tests/interop/test_hf_export.py's train_bpe)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF directory, converted paxlite directory)."""
    from paxlite.interop.hf_write import write_tokenizer
    from tests.interop.conftest import make_llama
    from tests.interop.test_hf_export import train_bpe

    root = tmp_path_factory.mktemp("lm_eval")
    _, model = make_llama(root / "base", kv_heads=2)
    # No ids beyond the tokenizer's (HFLM would generate them; paxlite generates decodable ids)
    model.resize_token_embeddings(PIECES)
    model.config.max_position_embeddings = MAX_LEN
    model.save_pretrained(root / "hf")
    write_tokenizer(str(root / "hf"), path=train_bpe(root / "spm"))
    assert main(["convert", "--from=hf", "--to=paxlite", f"--input={root / 'hf'}",
                 f"--output={root / 'pax'}"]) == 0
    return root / "hf", root / "pax"


def _source(pax, mesh_shape=None):
    from paxlite.cli import model_source
    from paxlite.parallel.mesh import MeshConfig

    source = model_source.resolve_model(
        argparse.Namespace(checkpoint=str(pax), job_log_dir=None, fdl_config=None), [])
    if mesh_shape is not None:
        source = dataclasses.replace(source, mesh_config=MeshConfig(ici_mesh_shape=mesh_shape))
    return source


def _paxlite(pax, *, batch_size, add_bos=True, mesh_shape=None, tasks=TASKS):
    """lm_eval's results of paxlite's LM (samples logged), and the runner."""
    from paxlite.cli import model_source
    from paxlite.eval.harness import ModelRunner
    from paxlite.eval.harness_lm import evaluate

    source = _source(pax, mesh_shape)
    tokenizer = model_source.load_tokenizer(source)
    bos = model_source.bos_id(model_source.BosChoice.AUTO, source, tokenizer)
    assert bos == 1  # the converted tokenizer_config.json says add_bos_token
    mesh, _ = model_source.build_mesh(source)
    runner = ModelRunner(
        model_config=source.config,
        params=model_source.restore_params(source, mesh),
        mesh=mesh,
        batch_size=batch_size,
        eos_id=tokenizer.eos_id,
        decode=tokenizer.decode,
    )
    results = evaluate(runner=runner, tokenizer=tokenizer, bos_id=bos if add_bos else None,
                       tasks=tasks, include_path=str(TASKS_DIR), log_samples=True,
                       bootstrap_iters=0)
    return results, runner


def _hf(hf_dir, *, add_bos=True, tasks=TASKS):
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(hf_dir), max_length=MAX_LEN, batch_size=4, device="cpu",
              add_bos_token=add_bos)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True,
                           bootstrap_iters=0)


@pytest.fixture(scope="module")
def runs(converted):
    """The shared runs: HFLM and paxlite (batch 4, one device), with BOS and without."""
    hf_dir, pax = converted
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(TASKS_DIR)  # the task YAMLs name their data relative to it
        return {"hf": _hf(hf_dir), "paxlite": _paxlite(pax, batch_size=4),
                "hf_no_bos": _hf(hf_dir, add_bos=False),
                "paxlite_no_bos": _paxlite(pax, batch_size=4, add_bos=False)}


@pytest.fixture(autouse=True)
def _in_tasks_dir(monkeypatch):
    monkeypatch.chdir(TASKS_DIR)


def _per_sample(results):
    """{task: [(log-likelihoods or generated strings) of each document, in document order]}."""
    out = {}
    for task in TASKS:
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        out[task] = [[r[0] for r in s["resps"]] for s in samples]
    return out


def _assert_same_scores(got, want, *, tol):
    """Log-likelihoods to `tol`, greedy flags and generated text exactly, accuracies exactly,
    perplexities to the relative error the log-likelihoods allow."""
    got_samples, want_samples = _per_sample(got), _per_sample(want)
    for task in TASKS:
        assert len(got_samples[task]) == len(want_samples[task]) > 0
        for mine, theirs in zip(got_samples[task], want_samples[task], strict=True):
            if task == "paxlite_gen":
                assert mine == theirs
            elif task == "paxlite_mc":  # (log-likelihood, is_greedy) per choice
                np.testing.assert_allclose([m[0] for m in mine], [t[0] for t in theirs], atol=tol)
                assert [m[1] for m in mine] == [t[1] for t in theirs]
            else:  # one rolling log-likelihood per document
                np.testing.assert_allclose(mine, theirs, atol=tol)
    for task in TASKS:
        for key, value in want["results"][task].items():
            if "_stderr" in key:
                continue
            if key.startswith(("acc", "exact_match")):
                assert got["results"][task][key] == value, (task, key)
            elif "perplexity" in key or key.startswith("bits_per_byte"):
                assert got["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)


def test_scores_equal_lm_evals_own_hf_model(runs, converted):
    from paxlite.data.tokenizer import Tokenizer

    tokenizer = Tokenizer(converted[1] / "tokenizer.model")
    documents = [json.loads(line)["text"]
                 for line in (TASKS_DIR / "ppl.jsonl").read_text().splitlines()]
    assert max(len(tokenizer.encode(d)) for d in documents) > MAX_LEN  # windows matter
    ours, runner = runs["paxlite"]
    _assert_same_scores(ours, runs["hf"], tol=1e-4)
    assert ours["results"]["paxlite_mc"]["acc,none"] > 0  # a task with something right
    # one compile per (rows, length bucket): buckets 16 and 32 only
    assert {bucket for _, bucket in runner.compiled_shapes} <= {16, 32}


def test_without_bos_as_lm_eval_with_add_bos_token_false(runs):
    ours, _ = runs["paxlite_no_bos"]
    _assert_same_scores(ours, runs["hf_no_bos"], tol=1e-4)
    with_bos = _per_sample(runs["paxlite"][0])["paxlite_mc"]
    assert _per_sample(ours)["paxlite_mc"] != with_bos  # BOS changes the scores here


def test_scores_do_not_change_with_batch_size_or_mesh(runs, converted):
    """Batch 1 on one device and batch 3 on an 8-device mesh (data 2, fsdp 2, tensor 2: rows
    padded to a multiple of 4) give the batch-4 one-device scores."""
    reference, _ = runs["paxlite"]
    for batch_size, mesh in ((1, None), (3, (2, 2, 2))):
        results, runner = _paxlite(converted[1], batch_size=batch_size, mesh_shape=mesh)
        assert runner.batch_size == (1 if mesh is None else 4)
        _assert_same_scores(results, reference, tol=1e-5)


def test_score_tasks_returns_flat_metrics(runs, converted):
    """The in-process API (for LM_EVAL_TASKS): lm_eval's "metric,filter" keys as task/metric."""
    from paxlite.cli import model_source
    from paxlite.eval.harness import flatten_results, score_tasks

    source = _source(converted[1])
    tokenizer = model_source.load_tokenizer(source)
    flat = score_tasks(model_config=source.config, params=model_source.restore_params(source, None),
                       mesh=None, tokenizer=tokenizer, bos_id=1, tasks=["paxlite_mc"],
                       include_path=str(TASKS_DIR), batch_size=4)
    want = runs["paxlite"][0]["results"]["paxlite_mc"]
    assert flat == {
        "paxlite_mc/acc": want["acc,none"],
        "paxlite_mc/acc_norm": want["acc_norm,none"],
    }
    assert flatten_results({"results": {"gsm8k": {
        "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1,
        "alias": "gsm8k"}}}) == {"gsm8k/exact_match_strict-match": 0.25}


def test_the_command_line_end_to_end(runs, converted, tmp_path, capsys):
    """--output_path gets lm_eval's results dict (and, with --log_samples, the samples); a second
    run refuses to overwrite it; an unknown task is one line and exit 2."""
    pax = converted[1]
    output = tmp_path / "results.json"
    # --batch_size=4 (not the default 8): the reference runs' batch, whose programs this process has
    # compiled already (that batch size changes no score is test_scores_do_not_change_with_...'s)
    flags = ["lm_eval", f"--checkpoint={pax}", "--tasks=paxlite_mc,paxlite_gen",
             f"--include_path={TASKS_DIR}", "--bootstrap_iters=0", "--batch_size=4"]
    assert main([*flags, f"--output_path={output}", "--log_samples"]) == 0
    printed = capsys.readouterr().out
    assert "|paxlite_mc" in printed and "acc_norm" in printed  # lm_eval's table
    written = json.loads(output.read_text())
    reference = runs["paxlite"][0]
    for task in ("paxlite_mc", "paxlite_gen"):
        assert written["results"][task] == reference["results"][task]
        assert len(written["samples"][task]) == len(reference["samples"][task])
    # lm_eval's environment keys, filled without torch's collector (harness_lm.py): JAX's report
    import jax
    import lm_eval.evaluator
    import lm_eval.loggers.utils

    assert written["pretty_env_info"] == jax.print_environment_info(return_string=True)
    assert written["transformers_version"] == importlib.metadata.version("transformers")
    assert written["lm_eval_version"] == importlib.metadata.version("lm_eval")
    assert lm_eval.evaluator.add_env_info is lm_eval.loggers.utils.add_env_info  # put back
    before = output.read_bytes()
    assert main([*flags, f"--output_path={output}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "exists; nothing is overwritten" in err and len(err.splitlines()) == 1, err
    assert output.read_bytes() == before
    assert main(["lm_eval", f"--checkpoint={pax}", "--tasks=paxlite_mcq",
                 f"--include_path={TASKS_DIR}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'paxlite_mcq' is not a task" in err and "did you mean paxlite_mc" in err, err
    assert len(err.splitlines()) == 1


def test_seed_and_gen_kwargs_are_lm_evals(runs, converted, tmp_path, capsys):
    """--gen_kwargs overrides the task's generation settings (max_gen_toks=1: one token each);
    --num_fewshot=1 puts another document of the task before each question, picked by the
    few-shot seed (the 4th --seed value, as lm_eval reads it); bad values are one line, exit 2."""
    flags = [
        "lm_eval",
        f"--checkpoint={converted[1]}",
        "--tasks=paxlite_gen",
        f"--include_path={TASKS_DIR}",
        "--bootstrap_iters=0",
        "--log_samples",
        "--num_fewshot=1",
        "--gen_kwargs=max_gen_toks=1",
    ]
    contexts = {}
    for seed in ("0,1234,1234,1", "0,1234,1234,2"):
        output = tmp_path / f"{seed[-1]}.json"
        assert main([*flags, f"--seed={seed}", f"--output_path={output}"]) == 0
        samples = json.loads(output.read_text())["samples"]["paxlite_gen"]
        assert written_config_max(samples) == 1
        contexts[seed] = [s["arguments"][0][0] for s in samples]
        assert all(c.count("\n\n") == 1 for c in contexts[seed])  # one example, then the question
    assert contexts["0,1234,1234,1"] != contexts["0,1234,1234,2"]
    capsys.readouterr()
    for bad, message in (("--seed=1,2", "--seed='1,2' has 2 values: give 1, 3 or 4"),
                         ("--seed=x", "--seed='x': 'x' is not an integer or None"),
                         ("--gen_kwargs=max_gen_toks", "is not key=value pairs")):
        assert main([*flags, bad]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def written_config_max(samples) -> int:
    """The max_gen_toks every sample was generated with."""
    return max(int(s["arguments"][0][1]["max_gen_toks"]) for s in samples)


def test_without_the_eval_extra_one_error_names_it(converted, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    assert main(["lm_eval", f"--checkpoint={converted[1]}", "--tasks=paxlite_mc"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install -e '.[eval]'" in err and len(err.splitlines()) == 1, err
