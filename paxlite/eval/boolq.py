"""BoolQ's score as Pax computes it: `boolq_acc`, the pairwise yes/no rule.

Pax's score does not compare the answer with every word the model could say, only with the other
answer: at each target position the logit of the right answer must exceed the logit of the wrong
one (`paxlite.train.losses.choice_correct` counts those positions per row). The examples, prompts
and batches are built by `paxlite.data.boolq`; this module only scores what the model produced.
"""

from __future__ import annotations

import numpy as np


def boolq_acc(*, choice_correct: np.ndarray, example_weights: np.ndarray) -> float:
    """Pax's `boolq_acc`: weighted count of won target positions / sum of example weights.

    `choice_correct` [N] comes from `paxlite.train.step.eval_step` (concatenated over batches):
    per row, the weighted number of target positions where logit[label] - logit[other] > 0.
    """
    choice_correct = np.asarray(choice_correct, dtype=np.float64)
    example_weights = np.asarray(example_weights, dtype=np.float64)
    if choice_correct.ndim != 1 or choice_correct.shape != example_weights.shape:
        raise ValueError(
            "choice_correct and example_weights must be 1-D arrays of one shape, got "
            f"{choice_correct.shape} and {example_weights.shape}"
        )
    total = float(np.sum(example_weights))
    if total <= 0:
        raise ValueError(
            "boolq_acc needs at least one real example (example_weights > 0), got none"
        )
    return float(np.sum(choice_correct)) / total
