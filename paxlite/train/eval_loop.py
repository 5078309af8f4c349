"""The evaluation loop: eval batches through the compiled eval step, into eval metrics.

Apart from the train loop (train/loop.py) because evaluating is a loop of its own, run both between
training steps and alone (--mode=eval): it has its own feed, its own bound on how far the host runs
ahead of the device, its own per-example scores read back in one transfer, and its own metrics (the
loss and accuracy of the eval data, and the task scores of eval/: Lambada's acc_strict, BoolQ's
boolq_acc).
"""

from __future__ import annotations

import collections
import contextlib

import jax
import numpy as np
from jax.sharding import Mesh

from paxlite.data.chat_pipeline import chat_eval_metrics
from paxlite.data.dpo_pipeline import dpo_eval_counts
from paxlite.data.errors import DatasetError
from paxlite.data.feed import Feed, eval_sources, prefetch_eval_batches
from paxlite.eval.boolq import boolq_acc
from paxlite.eval.lambada import acc_strict
from paxlite.train import device_metrics
from paxlite.train.dpo import PAIR_SUM_KEYS, pair_metrics
from paxlite.train.step import CompiledSteps, TrainState
from paxlite.train.watchdog import Watchdog


class Evaluator:
    """Evaluates train states with one run's compiled eval step (`Run.evaluate`), and remembers
    whether that step has compiled yet: only the first batch of a run compiles."""

    def __init__(self, steps: CompiledSteps, mesh: Mesh, *, num_batches: int, steps_ahead: int):
        self._steps = steps
        self._mesh = mesh
        self._num_batches = num_batches
        self._steps_ahead = steps_ahead
        self._compiled = False  # the first evaluation batch compiles (not timed by the watchdog)

    def evaluate(self, state: TrainState, data: Feed, *,
                 watchdog: Watchdog | None = None) -> dict[str, float]:
        """Eval metrics over `num_batches` batches of `data` (built ahead by a producer thread);
        the sums are accumulated on the device and read once, with the per-example scores.

        A mixture (data/mixture.py) is evaluated source by source, `num_batches` batches of each
        source with a validation split through the same compiled step: `<source>/loss` etc. per
        source, and the plain `loss` etc. pooled over all of their tokens.

        The host runs at most `steps_ahead` batches ahead of the device, and `watchdog` is told of
        each batch computed: a long evaluation is progress, not a hang. The first batch of a run
        compiles, which the watchdog does not time."""
        sources = eval_sources(data)
        if not sources:
            sums, per_example = self._sums(state, data, watchdog=watchdog)
            metrics = _metrics(sums, per_example, prefix=data.metric_prefix)
            # EVAL_TASK=chat: chat/...; EVAL_TASK=dpo: dpo/pairs, ...
            return {**metrics, **chat_eval_metrics(data, metrics), **dpo_eval_counts(data)}
        metrics: dict[str, float] = {}
        pooled: dict[str, float] = {}
        for name, feed in sources.items():
            sums, _ = self._sums(state, feed, watchdog=watchdog)
            metrics.update({f"{name}/{key}": value for key, value in _metrics(sums, {}).items()})
            pooled = {key: pooled.get(key, 0.0) + value for key, value in sums.items()}
        return {**_metrics(pooled, {}), **metrics}

    def _sums(self, state: TrainState, data: Feed, *,
              watchdog: Watchdog | None) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """(the eval sums, the per-example scores) of `num_batches` batches of `data`."""
        totals = None  # made from the first batch's scores: a DPO evaluation sums pair terms too
        per_example: dict[str, list[jax.Array]] = {
            "correct": [],
            "targets": [],
            "weights": [],
            "choice": [],
        }
        # totals of batches maybe not computed
        dispatched: collections.deque[dict] = collections.deque()
        with jax.set_mesh(self._mesh), contextlib.closing(prefetch_eval_batches(
                data, num_batches=self._num_batches,
                sharding=self._steps.batch_sharding)) as batches:
            for batch in batches:
                if not self._compiled and watchdog is not None:
                    with watchdog.compiling():
                        out = jax.block_until_ready(
                            self._steps.eval(state.params, batch, state.fp8))
                else:
                    out = self._steps.eval(state.params, batch, state.fp8)
                self._compiled = True
                if totals is None:
                    totals = device_metrics.eval_totals_init(
                        [key for key in (*device_metrics.EVAL_SUM_KEYS, *PAIR_SUM_KEYS)
                         if key in out])
                totals = device_metrics.eval_totals_add(totals, out)
                dispatched.append(totals)
                if len(dispatched) > self._steps_ahead:
                    jax.block_until_ready(dispatched.popleft())  # computed: that batch is progress
                    if watchdog is not None:
                        watchdog.beat()
                if "example_weights" in out:
                    per_example["correct"].append(out["correct_tokens"])
                    per_example["targets"].append(out["target_tokens"])
                    per_example["weights"].append(out["example_weights"])
                if "choice_correct" in out:  # a two-way choice per example (BoolQ)
                    per_example["choice"].append(out["choice_correct"])
            if totals is None:  # no batch at all: said by _metrics (no weighted tokens)
                totals = device_metrics.eval_totals_init()
            host_totals, per_example = jax.device_get((totals, per_example))
        return device_metrics.eval_totals_value(host_totals), per_example


def _metrics(sums: dict[str, float], per_example: dict, *, prefix: str = "") -> dict[str, float]:
    """loss, accuracy, log_pplx and num_tokens from the sums; a task's score from the per-example
    scores where there are any."""
    if sums["target_tokens"] == 0:
        raise DatasetError("the evaluation data has no weighted tokens; nothing to evaluate")
    dpo = pair_metrics(sums) if "pairs" in sums else {}  # EVAL_TASK=dpo: dpo/loss, ...
    loss = sums["loss_sum"] / sums["target_tokens"]
    metrics = {
        "loss": loss,
        "accuracy": sums["correct_tokens"] / sums["target_tokens"],
        "log_pplx": loss,
        "num_tokens": sums["target_tokens"],
    }
    metrics.update(dpo)
    if per_example.get("choice"):  # Pax's boolq_acc: the right answer's logit beats the other's
        metrics[f"{prefix}acc"] = boolq_acc(
            choice_correct=np.concatenate(per_example["choice"]),
            example_weights=np.concatenate(per_example["weights"]),
        )
    elif per_example.get("weights"):
        metrics[f"{prefix}acc_strict"] = acc_strict(
            correct_tokens=np.concatenate(per_example["correct"]),
            target_tokens=np.concatenate(per_example["targets"]),
            example_weights=np.concatenate(per_example["weights"]),
        )
    return metrics
