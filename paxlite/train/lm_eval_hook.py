"""LM_EVAL_TASKS: lm-evaluation-harness tasks scored on the live train state at evaluation
boundaries.

Apart from the loop because scoring is its own conversation: lm_eval runs on process 0 and asks for
log-likelihoods and continuations, which every process computes together on the run's mesh with the
parameters as they are (paxlite/eval/harness.py); nothing is written to disk and the train state is
only read. Everything that can be wrong is found when the run is set up, before anything compiles:
the `eval` extra, the tokenizer and its fit to the model, and every task name (asked of lm_eval's
own task index, or only of LM_EVAL_INCLUDE_PATH when it holds them all).

The scores go into metrics.jsonl as ``lm_eval/<task>/<metric>`` (lm_eval's ``acc,none`` ->
``acc``; other filters are appended, ``exact_match_strict-match``) and into TensorBoard under
summaries/lm_eval. FP8 models are scored without their FP8 state (the harness runs the plain
bf16/fp32 forward), as `generate` decodes them.
"""

from __future__ import annotations

import jax

from paxlite.models.transformer import TransformerConfig
from paxlite.train.run_config import LmEvalConfig

METRIC_PREFIX = "lm_eval/"


class LmEvalScorer:
    """Scores one run's LM_EVAL_TASKS; built once per run, called from every process alike."""

    def __init__(self, config: LmEvalConfig, *, model_config: TransformerConfig, mesh,
                 batch_size: int, max_steps: int):
        from paxlite.data.tokenizer import Tokenizer, bind_model_vocab
        from paxlite.eval.harness_lm import task_manager

        self.config = config
        self._model_config = model_config
        self._mesh = mesh
        self._batch_size = batch_size
        self._max_steps = max_steps
        self._tokenizer = Tokenizer(config.vocab_path)
        bind_model_vocab(self._tokenizer, vocab_size=model_config.vocab_size)
        task_manager(config.include_path, list(config.tasks))  # an unknown task: one error, now
        bos = self._tokenizer.bos_id
        self._bos_id = bos if config.add_bos and bos is not None and bos >= 0 else None

    def due(self, step: int) -> bool:
        return step % self.config.interval_steps == 0 or step == self._max_steps

    def score(self, params) -> dict[str, float]:
        """``{"lm_eval/<task>/<metric>": value}`` on process 0, {} on the others (a collective)."""
        from paxlite.eval.harness import score_tasks

        with jax.set_mesh(self._mesh):
            flat = score_tasks(
                model_config=self._model_config, params=params, mesh=self._mesh,
                tokenizer=self._tokenizer, bos_id=self._bos_id, tasks=self.config.tasks,
                num_fewshot=self.config.num_fewshot, limit=self.config.limit,
                include_path=self.config.include_path, batch_size=self._batch_size)
        return {METRIC_PREFIX + key: value for key, value in flat.items()}
