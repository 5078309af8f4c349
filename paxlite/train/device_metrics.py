"""Metrics that stay on the device until the loop needs them: per-step train metrics, eval sums.

Why: reading a value back to the host waits for the step that computes it, so a loop that reads
every step's loss never lets the device run ahead of the host, and on a small model the host's
per-step work then adds straight to the step time. Here the loop only *keeps* each step's metric
arrays; at a summary, evaluation or checkpoint boundary they are stacked on the device and fetched
in one transfer, together with a finiteness flag per step computed there, so the first non-finite
step is still named exactly.

Evaluation sums are accumulated on the device as well (one fetch per evaluation). They are float32
pairs (sum, rounding error) updated row by row with Knuth's TwoSum, so the total is as exact as a
float64 sum of the per-row float32 scores: counts of weighted tokens stay exact integers far past
float32's 2**24, and a long evaluation's loss does not drift with the number of batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

EVAL_SUM_KEYS = ("loss_sum", "correct_tokens", "target_tokens")
FINITE_KEYS = ("loss", "grad_norm")  # a non-finite one stops the run


@jax.jit
def _stack(metrics: Sequence[Mapping[str, jax.Array]]) -> tuple[dict[str, jax.Array], jax.Array]:
    """[n] per key, and [n] bool: every FINITE_KEYS value of that step is finite."""
    stacked = {key: jnp.stack([m[key] for m in metrics]) for key in metrics[0]}
    finite = jnp.all(jnp.stack([jnp.isfinite(stacked[key]) for key in FINITE_KEYS]), axis=0)
    return stacked, finite


def _power_of_two_chunks(n: int) -> list[tuple[int, int]]:
    """[start, stop) spans of n items whose lengths are distinct powers of two, largest first:
    `_stack` then compiles for at most log2(n) + 1 lengths over a whole run."""
    spans, start = [], 0
    for bit in reversed(range(n.bit_length())):
        size = 1 << bit
        if n & size:
            spans.append((start, start + size))
            start += size
    return spans


class StepMetrics:
    """The device metric arrays of the steps since the last boundary."""

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._metrics: list[dict[str, jax.Array]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, metrics: dict[str, jax.Array]) -> None:
        self._steps.append(step)
        self._metrics.append(metrics)

    def wait_for(self, steps_back: int) -> None:
        """Block until the step `steps_back` before the newest is computed (no transfer): bounds
        how far the host runs ahead, and so how many batches wait on the device."""
        if len(self._metrics) > steps_back:
            jax.block_until_ready(self._metrics[-1 - steps_back]["loss"])

    def read(self) -> tuple[list[int], dict[str, np.ndarray], np.ndarray]:
        """(steps, {key: host float values [n]}, finite [n]) of the kept steps, fetched in one
        transfer; the buffer is emptied."""
        steps, metrics = self._steps, self._metrics
        self._steps, self._metrics = [], []
        if not steps:
            return [], {}, np.zeros((0,), bool)
        chunks = [_stack(metrics[a:b]) for a, b in _power_of_two_chunks(len(metrics))]
        host = jax.device_get(chunks)
        values = {key: np.concatenate([c[0][key] for c in host]) for key in host[0][0]}
        finite = np.concatenate([c[1] for c in host])
        return steps, values, finite


# ------------------------------------------------------------------ evaluation sums
def eval_totals_init(keys: Sequence[str] = EVAL_SUM_KEYS) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Zero totals of `keys` (the eval step's per-row sums: EVAL_SUM_KEYS, and a DPO
    evaluation's pair terms)."""
    zero = jnp.zeros((), jnp.float32)
    return {key: (zero, zero) for key in keys}


def _two_sum(carry: tuple[jax.Array, jax.Array], x: jax.Array):
    """(sum, error) + x, with the rounding error of the addition carried in `error`."""
    high, low = carry
    total = high + x
    virtual = total - high
    error = (high - (total - virtual)) + (x - virtual)
    return (total, low + error), None


@jax.jit
def eval_totals_add(totals: dict[str, tuple[jax.Array, jax.Array]],
                    scores: Mapping[str, jax.Array]) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Add one batch's per-row sums to the running totals, row by row with TwoSum: the totals
    equal a float64 sum of the float32 row values (to ~1e-14 relative), however many batches."""
    return {key: jax.lax.scan(_two_sum, totals[key], scores[key].astype(jnp.float32).reshape(-1))[0]
            for key in totals}


def eval_totals_value(host_totals: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Fetched totals as Python floats (high + low in float64)."""
    return {
        key: float(np.float64(high) + np.float64(low)) for key, (high, low) in host_totals.items()
    }
