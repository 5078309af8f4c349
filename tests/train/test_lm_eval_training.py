"""LM_EVAL_TASKS during training (train/lm_eval_hook.py): lm-evaluation-harness scores of the live
train state on its 8-device mesh at every LM_EVAL_INTERVAL_STEPS-th step and the last, into
metrics.jsonl and TensorBoard, equal to `python -m paxlite lm_eval` on the checkpoint that step
saved (that command's scores are checked against lm_eval's own hf model in
tests/eval/test_lm_eval.py); a task lm_eval does not know stops the run before anything compiles."""

import json
import pathlib

import pytest

from tests.in_process import paxlite_command, paxlite_main
from tests.interop.test_hf_export import train_bpe

TASKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "testdata" / "lm_eval"
TASKS = '["paxlite_mc", "paxlite_ppl"]'


def _flags(job, vocab, *extra, tasks=TASKS):
    return [
        "--fdl_config=TinySynthetic",
        "--fdl.MAX_STEPS=3",
        "--fdl.EVAL_INTERVAL_STEPS=1",
        "--fdl.SUMMARY_INTERVAL_STEPS=1",
        # no CHECKPOINT_EVERY_N_STEPS=1: the command reads the last step's, saved in any case
        "--fdl.ICI_MESH_SHAPE=[2,2,2]",
        f"--fdl.VOCAB_PATH={vocab}",
        f"--fdl.LM_EVAL_TASKS={tasks}",
        f"--fdl.LM_EVAL_INCLUDE_PATH={TASKS_DIR}",
        f"--job_log_dir={job}",
        *extra,
    ]


def test_scores_at_the_interval_and_the_last_step_equal_the_command_on_its_checkpoint(
        tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(TASKS_DIR)  # the tasks' data_files are relative to it
    vocab = train_bpe(tmp_path / "spm")
    job = tmp_path / "job"
    with paxlite_main(monkeypatch, capfd) as run:
        result = run(*_flags(job, vocab, "--fdl.LM_EVAL_INTERVAL_STEPS=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: {k: v for k, v in r.items() if k.startswith("lm_eval/")}
              for r in lines if any(k.startswith("lm_eval/") for k in r)}
    assert sorted(scored) == [2, 3]  # the interval, and the last step
    assert set(scored[3]) == {"lm_eval/paxlite_mc/acc", "lm_eval/paxlite_mc/acc_norm",
                              "lm_eval/paxlite_ppl/word_perplexity",
                              "lm_eval/paxlite_ppl/byte_perplexity",
                              "lm_eval/paxlite_ppl/bits_per_byte"}
    assert scored[2] != scored[3]  # the train state moved between them
    assert list((job / "summaries" / "lm_eval").glob("events*"))

    # the command, on the checkpoint of step 3 (the latest), restored onto the same mesh
    output = tmp_path / "results.json"
    command = paxlite_command(monkeypatch, capfd)
    result = command(
        "lm_eval",
        f"--job_log_dir={job}",
        "--tasks=paxlite_mc,paxlite_ppl",
        f"--include_path={TASKS_DIR}",
        "--bootstrap_iters=0",
        f"--output_path={output}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())["results"]
    for key, value in scored[3].items():
        _, task, metric = key.split("/")
        assert value == pytest.approx(results[task][f"{metric},none"], rel=1e-5), key


def test_an_unknown_task_stops_the_run_before_it_compiles(tmp_path, monkeypatch, capfd):
    vocab = train_bpe(tmp_path / "spm")
    with paxlite_main(monkeypatch, capfd) as run:
        result = run(*_flags(tmp_path / "job", vocab, tasks='["paxlite_mcq"]'))
    assert result.returncode == 2
    assert "'paxlite_mcq' is not a task" in result.stderr and "paxlite_mc" in result.stderr
    assert not (tmp_path / "job" / "checkpoints").exists()
