"""LM_EVAL_*: what they resolve to, and one line naming the bad value for each mistake, when the
experiment resolves (experiments/lm_eval_settings.py)."""

import fiddle as fdl
import pytest

from paxlite.config.errors import ConfigError
from paxlite.experiments.build import load_experiment


def _problem(overrides, name="TinyShakespeare") -> str:
    with pytest.raises(ConfigError) as info:
        load_experiment(name, ["VOCAB_PATH=/spm.model", *overrides])
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("overrides", "expected"), [
    (["LM_EVAL_LIMIT=3", "LM_EVAL_NUM_FEWSHOT=1"],
     "LM_EVAL_NUM_FEWSHOT, LM_EVAL_LIMIT set without LM_EVAL_TASKS"),
    (["LM_EVAL_TASKS=[]"], "LM_EVAL_TASKS=[] names no task"),
    (['LM_EVAL_TASKS=["a", " "]'], "LM_EVAL_TASKS=['a', ' '] holds an empty task name"),
    (['LM_EVAL_TASKS=["a"]', "EVAL_INTERVAL_STEPS=10", "LM_EVAL_INTERVAL_STEPS=15"],
     "LM_EVAL_INTERVAL_STEPS=15 must be a positive multiple of EVAL_INTERVAL_STEPS=10"),
    (['LM_EVAL_TASKS=["a"]', "LM_EVAL_NUM_FEWSHOT=-1"], "LM_EVAL_NUM_FEWSHOT=-1 must be >= 0"),
    (['LM_EVAL_TASKS=["a"]', "LM_EVAL_LIMIT=0"], "LM_EVAL_LIMIT=0.0 must be > 0"),
    (['LM_EVAL_TASKS=["a"]', "LM_EVAL_LIMIT=2.5"], ("LM_EVAL_LIMIT=2.5: a count of examples is a "
                                                   "whole number")),
    (['LM_EVAL_TASKS=["a"]', "LM_EVAL_INCLUDE_PATH=/no/such/dir"],
     "LM_EVAL_INCLUDE_PATH='/no/such/dir' is not a directory"),
])
def test_each_mistake_is_one_line_naming_the_value(overrides, expected):
    assert expected in _problem(overrides)


def test_tasks_without_a_tokenizer_are_refused(monkeypatch):
    monkeypatch.delenv("VOCAB_PATH", raising=False)
    with pytest.raises(ConfigError, match="LM_EVAL_TASKS scores text and needs the tokenizer"):
        load_experiment("TinyShakespeare", ['LM_EVAL_TASKS=["a"]'])


def test_settings_resolve_to_the_run_config(tmp_path):
    run = fdl.build(load_experiment("TinyShakespeare", [
        "VOCAB_PATH=/spm.model", "DATA_DIR=/data", 'LM_EVAL_TASKS=["arc_easy", "wikitext"]',
        "EVAL_INTERVAL_STEPS=5", "LM_EVAL_INTERVAL_STEPS=10", "LM_EVAL_LIMIT=0.5",
        f"LM_EVAL_INCLUDE_PATH={tmp_path}"]).run_config())
    lm_eval = run.lm_eval
    assert (lm_eval.tasks, lm_eval.interval_steps, lm_eval.limit, lm_eval.include_path) == (
        ("arc_easy", "wikitext"), 10, 0.5, str(tmp_path))
    assert (lm_eval.num_fewshot, lm_eval.vocab_path, lm_eval.add_bos) == (None, "/spm.model", False)
    # unset interval: every evaluation boundary; the LLaMA family starts text with BOS
    llama = load_experiment("LLaMA7B", ["VOCAB_PATH=/spm.model", 'LM_EVAL_TASKS=["a"]'])
    built = fdl.build(llama.lm_eval_config())
    assert (built.interval_steps, built.add_bos) == (llama.EVAL_INTERVAL_STEPS, True)
    assert (
        fdl.build(
            load_experiment("TinyShakespeare", ["VOCAB_PATH=/s", "DATA_DIR=/d"]).run_config()
        ).lm_eval
        is None
    )
