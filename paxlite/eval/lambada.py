"""Lambada's score as Pax computes it: `acc_strict` over per-example token counts.

Pax (`CustomMetricsLM` with `eval_task='lambada'`) scores a passage as correct only when *every*
token of its last word is the model's greedy (argmax) prediction. The examples and their batches
are built by `paxlite.data.lambada`; this module only scores what the model produced.
"""

from __future__ import annotations

import numpy as np


def acc_strict(
    *,
    correct_tokens: np.ndarray,
    target_tokens: np.ndarray,
    example_weights: np.ndarray,
) -> float:
    """Fraction of real examples whose every weighted target token is the greedy prediction.

    Inputs are per-example [N] arrays (concatenate `paxlite.train.losses.per_example_scores` over
    batches). The sums are of 0/1 weights, hence exact small integers in float32, so equality is an
    exact test.
    """
    correct_tokens = np.asarray(correct_tokens, dtype=np.float64)
    target_tokens = np.asarray(target_tokens, dtype=np.float64)
    example_weights = np.asarray(example_weights, dtype=np.float64)
    shapes = {a.shape for a in (correct_tokens, target_tokens, example_weights)}
    if len(shapes) != 1 or correct_tokens.ndim != 1:
        raise ValueError(
            "correct_tokens, target_tokens and example_weights must be 1-D arrays of one shape, "
            f"got {correct_tokens.shape}, {target_tokens.shape}, {example_weights.shape}"
        )
    real = example_weights > 0
    if not np.any(real):
        raise ValueError(
            "acc_strict needs at least one real example (example_weights > 0), got none"
        )
    no_target = real & (target_tokens <= 0)
    if np.any(no_target):
        raise ValueError(
            f"real examples {np.flatnonzero(no_target).tolist()} have no weighted target tokens"
        )
    correct = correct_tokens[real] == target_tokens[real]
    return float(np.mean(correct))
