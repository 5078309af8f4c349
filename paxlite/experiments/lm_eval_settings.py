"""LM_EVAL_*: lm-evaluation-harness tasks scored during training, mapped and checked once.

Apart from base.py because the settings are their own small family with their own mistakes, each
found when the experiment resolves (a task list that is empty, an interval that is not a multiple of
EVAL_INTERVAL_STEPS, a setting given without LM_EVAL_TASKS, an include path that does not exist), so
a run never trains for hours before it finds its evaluation settings wrong. Whether the task names
exist is asked of lm_eval itself when the run starts (train/lm_eval_hook.py), before anything
compiles. A mixin of ``LanguageModelExperiment`` (base.py): the LM_EVAL_* hyperparameters are
declared here; it also reads EVAL_INTERVAL_STEPS and the tokenizer (data_settings.py).
"""

from __future__ import annotations

import os

import fiddle as fdl

from paxlite.train.run_config import LmEvalConfig

_DEPENDENT = (
    "LM_EVAL_INTERVAL_STEPS",
    "LM_EVAL_NUM_FEWSHOT",
    "LM_EVAL_LIMIT",
    "LM_EVAL_INCLUDE_PATH",
)


class LmEvalSettings:
    """The LM_EVAL_* part of an experiment's run tree."""

    # Whether the model family was trained with BOS first (the LLaMA family); read by lm_eval
    # scoring and by `generate` (BosChoice.AUTO).
    family_adds_bos = False

    # lm-evaluation-harness tasks scored during training (docs/evaluation.md; the `eval` extra), at
    # every LM_EVAL_INTERVAL_STEPS-th step (None: at every EVAL_INTERVAL_STEPS boundary), into
    # metrics.jsonl as lm_eval/<task>/<metric>. LM_EVAL_LIMIT: examples per task (< 1: a
    # fraction), as lm_eval's --limit.
    LM_EVAL_TASKS: list[str] | None = None
    LM_EVAL_INTERVAL_STEPS: int | None = None
    LM_EVAL_NUM_FEWSHOT: int | None = None  # None: each task's own default (lm_eval --num_fewshot)
    LM_EVAL_LIMIT: float | None = None
    LM_EVAL_INCLUDE_PATH: str | None = None  # a directory of local task YAMLs (--include_path)

    def lm_eval_problems(self) -> list[str]:
        if not self.LM_EVAL_TASKS:
            if self.LM_EVAL_TASKS is not None:
                return [("LM_EVAL_TASKS=[] names no task: give task names (e.g. "
                        "--fdl.LM_EVAL_TASKS='[\"hellaswag\"]') or leave it unset")]
            given = [n for n in _DEPENDENT if n in self.overridden]
            return [(f"{', '.join(given)} set without LM_EVAL_TASKS: name the "
                    "lm-evaluation-harness tasks to score (--fdl.LM_EVAL_TASKS='[\"TASK\"]'), or "
                    f"drop {'it' if len(given) == 1 else 'them'}")] if given else []
        problems = []
        if any(not t.strip() for t in self.LM_EVAL_TASKS):
            problems.append(f"LM_EVAL_TASKS={self.LM_EVAL_TASKS} holds an empty task name")
        interval = self.LM_EVAL_INTERVAL_STEPS
        if interval is not None and (interval < 1 or interval % self.EVAL_INTERVAL_STEPS):
            problems.append(
                f"LM_EVAL_INTERVAL_STEPS={interval} must be a positive multiple of "
                f"EVAL_INTERVAL_STEPS={self.EVAL_INTERVAL_STEPS} (tasks are scored at evaluation "
                "boundaries); leave it unset to score at every one")
        if self.LM_EVAL_NUM_FEWSHOT is not None and self.LM_EVAL_NUM_FEWSHOT < 0:
            problems.append(f"LM_EVAL_NUM_FEWSHOT={self.LM_EVAL_NUM_FEWSHOT} must be >= 0")
        limit = self.LM_EVAL_LIMIT
        if limit is not None and not limit > 0:
            problems.append(f"LM_EVAL_LIMIT={limit} must be > 0 (a count of examples per task, "
                            "or below 1 a fraction of each task)")
        if limit is not None and limit >= 1 and limit != int(limit):
            problems.append(f"LM_EVAL_LIMIT={limit}: a count of examples is a whole number")
        path = self.LM_EVAL_INCLUDE_PATH
        if path is not None and not os.path.isdir(os.path.expanduser(path)):
            problems.append(f"LM_EVAL_INCLUDE_PATH={path!r} is not a directory (of task YAMLs)")
        if self.vocab_path() is None:
            problems.append("LM_EVAL_TASKS scores text and needs the tokenizer: --fdl.VOCAB_PATH "
                            "or the VOCAB_PATH environment variable")
        return problems

    def lm_eval_config(self) -> fdl.Config[LmEvalConfig] | None:
        if not self.LM_EVAL_TASKS:
            return None
        return fdl.Config(
            LmEvalConfig,
            tasks=tuple(t.strip() for t in self.LM_EVAL_TASKS),
            interval_steps=self.LM_EVAL_INTERVAL_STEPS or self.EVAL_INTERVAL_STEPS,
            num_fewshot=self.LM_EVAL_NUM_FEWSHOT,
            limit=self.LM_EVAL_LIMIT,
            include_path=(None if self.LM_EVAL_INCLUDE_PATH is None
                          else os.path.abspath(os.path.expanduser(self.LM_EVAL_INCLUDE_PATH))),
            vocab_path=self.vocab_path(),
            add_bos=self.family_adds_bos,
        )
